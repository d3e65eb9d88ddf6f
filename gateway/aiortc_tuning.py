"""Runtime adjustments to aiortc for a many-call voice gateway; installed files are never edited.

Six changes, all applied by `apply()` and undone by `restore()`:

- `aiortc.rtp.compute_audio_level_dbov` (RFC 6465 level of every sent audio frame) is a pure-Python
  loop of about 175 µs per stereo frame on the event loop; a numpy version computes the same integer
  in a few µs.
- The audio jitter buffer that `RTCRtpReceiver` builds holds `prefetch=4` frames (about 80 ms per
  receiving hop) before it releases one, and even at 0 one frame (20 ms); the gateway wants a
  low, configurable prefetch, and at 0 each audio frame handed on as it arrives. And stock,
  one lost packet leaves the frames queued behind it queued for the rest of the call
  (~280 ms); the buffer here waits 40 ms for a missing packet, then drops it and catches up.
- `RTCRtpSender._next_encoded_frame` hands every encode to the default executor; for Opus (tens
  of µs per 20 ms frame) the thread hop costs more than the encode and makes many calls queue
  behind a few executor threads, so audio is encoded inline. Video keeps aiortc's executor path.
- Each `RTCRtpReceiver` decodes on a thread of its own, and every 20 ms packet crosses to it
  and back (a queue.Queue, a GIL hand-off, `run_coroutine_threadsafe` writing to the loop's
  self-pipe), which costs more than the decode. Audio is decoded on the loop as each frame
  completes (`decode_on_loop`); the receiver's thread still starts but ends at once. Video
  keeps its decoder thread.
- With `opus="opuslib"`, Opus goes through libopus at the pipeline's rates (gateway.opus): every
  audio sender encodes 20 ms mono frames at an Opus rate as they are (no resampling to 48 kHz
  stereo), and receivers marked with `decode_at(receiver, rate)` decode straight to that rate,
  mono. Receivers not marked (a client in the same process) keep aiortc's 48 kHz stereo.
- asyncio's selector loop reads one datagram per wake-up of a UDP socket. Each call's ICE socket
  receives 50 or more packets a second, so once one turn of a busy loop takes about 20 ms the
  socket's queue only grows: media and STUN wait behind it (measured: consent checks answered
  0.5-0.9 s late at 10 calls on 2 cores, and every call dropped after 30 s as RFC 7675 says).
  The sockets of aioice's STUN protocol (every ICE host candidate) read up to
  `udp_reads_per_wake` queued datagrams a wake-up instead, as libuv does (32).

`verify()` checks that the aiortc internals these patches rely on are still there, so an aiortc
upgrade that moves them fails loudly at start-up instead of silently running stock.
"""

from __future__ import annotations

import asyncio
import asyncio.selector_events as _selector_events
import inspect
import logging
import math
import queue
import sys
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any

import aioice.ice as _aioice
import aiortc.rtcrtpreceiver as _rtcrtpreceiver
import aiortc.rtcrtpsender as _rtcrtpsender
import aiortc.rtp as _rtp
import numpy as np
from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.rtcrtpparameters import RTCRtpCodecParameters
from aiortc.rtcrtpreceiver import RTCRtpReceiver
from aiortc.rtcrtpsender import RTCRtpSender
from aiortc.utils import uint16_add as _uint16_add
from av import AudioFrame

from gateway.opus import OpuslibDecoder, OpuslibEncoder, opuslib

logger = logging.getLogger(__name__)

__all__ = [
    "OPUS_CODECS",
    "AiortcTuningError",
    "applied",
    "apply",
    "audio_prefetch",
    "compute_audio_level_dbov",
    "decode_at",
    "decode_on_loop",
    "opus_codec",
    "restore",
    "udp_reads_per_wake",
    "verify",
]

OPUS_CODECS = ("opuslib", "aiortc")


class AiortcTuningError(RuntimeError):
    """The installed aiortc no longer has an internal that a tuning patch replaces."""


# RFC 6465 bounds, as aiortc spells them.
_MAX_SAMPLE_VALUE = 32767
_MIN_AUDIO_LEVEL = -127

# The stock objects, captured at import (before any patch), so restore() and verify() see them.
_STOCK_LEVEL: Callable[[AudioFrame], int] = _rtp.compute_audio_level_dbov
_STOCK_JITTER_BUFFER: type[JitterBuffer] = _rtcrtpreceiver.JitterBuffer
_STOCK_NEXT_ENCODED_FRAME: Callable[..., Coroutine[Any, Any, Any]] = (
    RTCRtpSender._next_encoded_frame
)
_STOCK_GET_ENCODER: Callable[..., Any] = _rtcrtpsender.get_encoder
_STOCK_DECODER_WORKER: Callable[..., None] = _rtcrtpreceiver.decoder_worker
_STOCK_RECEIVER_INIT: Callable[..., None] = RTCRtpReceiver.__init__
_RECEIVER_QUEUE = "_RTCRtpReceiver__decoder_queue"  # the decoder thread's queue, name-mangled
_RECEIVER_JITTER = "_RTCRtpReceiver__jitter_buffer"
_RECEIVER_TIMESTAMPS = "_RTCRtpReceiver__timestamp_mapper"
_RECEIVER_ERROR = "_RTCRtpReceiver__decoder_error"  # set when a frame fails to decode
_DatagramTransport: Any = _selector_events._SelectorDatagramTransport
_STOCK_DATAGRAM_READ: Callable[[Any], None] = _DatagramTransport._read_ready

# Names the stock `_next_encoded_frame` must still use for the inline copy below to be faithful.
_SENDER_NAMES = (
    "_RTCRtpSender__track",
    "_enabled",
    "_RTCRtpSender__encoder",
    "_RTCRtpSender__force_keyframe",
    "get_encoder",
    "compute_audio_level_dbov",
    "run_in_executor",
    "encode",
    "pack",
    "RTCEncodedFrame",
)

_state: dict[str, Any] = {
    "applied": False,
    "audio_prefetch": 1,
    "level_sites": [],
    "opus": "aiortc",
    "udp_reads_per_wake": 32,
    "decode_on_loop": True,
}


def compute_audio_level_dbov(frame: AudioFrame) -> int:
    """RFC 6465 audio level of an s16 frame, the same integer aiortc's pure-Python loop returns.

    Mirrors aiortc's arithmetic exactly, quirks included: every int16 of plane 0 is summed (both
    channels of a packed stereo frame) but divided by `frame.samples` only. The sum of squares is
    exact in int64 (at most 2^30 per sample) and so is aiortc's float accumulation (< 2^53), hence
    bit-identical results. np.dot is avoided on purpose: it can wake BLAS threads for a 2k vector.
    """
    pcm = np.frombuffer(frame.planes[0], dtype=np.int16).astype(np.int64)
    energy = int((pcm * pcm).sum())
    rms = math.sqrt(energy / (frame.samples * _MAX_SAMPLE_VALUE * _MAX_SAMPLE_VALUE))
    if rms <= 0:
        return _MIN_AUDIO_LEVEL
    return round(min(max(20 * math.log10(rms), _MIN_AUDIO_LEVEL), 0))


class _PrefetchJitterBuffer(_STOCK_JITTER_BUFFER):
    """aiortc's JitterBuffer with the audio prefetch taken from `apply(audio_prefetch=...)`, and
    a bounded wait for a lost audio packet.

    Installed only as the name `JitterBuffer` inside aiortc.rtcrtpreceiver, the one place that
    builds receive buffers; video buffers pass through unchanged. Stock, a frame is released
    when the first packet of the next frame arrives (a video frame spans packets), so even
    prefetch 0 holds 20 ms. An audio packet is a whole frame (RFC 7587: one Opus packet per
    RTP packet): with prefetch 0, each is released as it arrives, in order (`pop_ready` hands
    out the ones a late packet held back).

    Stock, a missing packet blocks every frame behind it until the buffer is full (16 packets
    for audio), and as it releases one frame per packet added, the frames queued meanwhile stay
    queued: one lost packet adds ~280 ms to the rest of the call. Here an audio buffer waits
    `LATE_PACKETS` packets for a missing one, then gives up on it (with prefetch 1 or more,
    dropping the oldest frames until it is back at its prefetch); a packet that comes after
    that is ignored as too late.
    """

    LATE_PACKETS = 2  # 40 ms of 20 ms packets: reordering on a path, not a loss

    def __init__(self, capacity: int, prefetch: int = 0, is_video: bool = False) -> None:
        if not is_video:
            prefetch = _state["audio_prefetch"]
        super().__init__(capacity, prefetch=prefetch, is_video=is_video)
        self.on_arrival = not is_video and prefetch == 0

    def pop_ready(self) -> JitterFrame | None:
        """With prefetch 0, the next audio frame in order if it is here, else None."""
        if not self.on_arrival or self._origin is None:
            return None
        packet = self._packets[self._origin % self._capacity]
        if packet is None:
            return None
        self.remove(1)
        return JitterFrame(data=packet._data, timestamp=packet.timestamp)

    def _add_on_arrival(self, packet: Any) -> JitterFrame | None:
        if self._origin is None:
            self._origin = packet.sequence_number
        ahead = _uint16_add(packet.sequence_number, -self._origin)
        if ahead >= 0x8000:
            return None  # older than a frame already released: too late, or a duplicate
        if ahead >= self._capacity:  # far ahead of the rest: start again from this packet
            self.remove(self._capacity)
            self._origin, ahead = packet.sequence_number, 0
        self._packets[packet.sequence_number % self._capacity] = packet
        if ahead > self.LATE_PACKETS:  # give up on the holes before the oldest packet here
            skip = next(
                k
                for k in range(ahead + 1)
                if self._packets[(self._origin + k) % self._capacity] is not None
            )
            self.remove(skip)
        return self.pop_ready()

    def add(self, packet: Any) -> tuple[bool, Any]:
        if self.on_arrival:
            return False, self._add_on_arrival(packet)
        pli_flag, frame = super().add(packet)
        if self._is_video or self._origin is None:
            return pli_flag, frame
        keep = max(self._prefetch, 1)  # packets held normally: the next frame's first
        span = _uint16_add(packet.sequence_number, -self._origin) + 1
        if span > keep + self.LATE_PACKETS:
            # whole frames, oldest first, holes included (emptied: start again here, as stock)
            if self.smart_remove(span - keep):
                self._origin = packet.sequence_number
            if frame is None:
                frame = self._remove_frame(packet.sequence_number)
        return pli_flag, frame


async def _next_encoded_frame_inline(
    self: RTCRtpSender, codec: RTCRtpCodecParameters
) -> _rtcrtpsender.RTCEncodedFrame | None:
    """aiortc 1.16's `_next_encoded_frame` line for line, with the audio encode run inline.

    Non-audio senders go to the stock method (video encodes take milliseconds and belong off
    the loop). The private attributes are reached by their mangled names.
    """
    if self.kind != "audio":
        return await _STOCK_NEXT_ENCODED_FRAME(self, codec)

    data = await self._RTCRtpSender__track.recv()  # type: ignore[attr-defined]

    # A disabled sender still drains its track so frames do not pile up; it just drops them.
    if not self._enabled:
        return None

    audio_level = None
    if self._RTCRtpSender__encoder is None:  # type: ignore[attr-defined]
        self._RTCRtpSender__encoder = _rtcrtpsender.get_encoder(codec)  # type: ignore[attr-defined]
    encoder = self._RTCRtpSender__encoder  # type: ignore[attr-defined]

    if isinstance(data, _rtcrtpsender.Frame):
        if isinstance(data, _rtcrtpsender.AudioFrame):
            audio_level = _rtp.compute_audio_level_dbov(data)
        force_keyframe = self._RTCRtpSender__force_keyframe  # type: ignore[attr-defined]
        self._RTCRtpSender__force_keyframe = False  # type: ignore[attr-defined]
        payloads, timestamp = encoder.encode(data, force_keyframe)
    else:
        payloads, timestamp = encoder.pack(data)

    # The encoder may buffer (resampling delay) and return nothing for this frame.
    if not payloads:
        return None
    return _rtcrtpsender.RTCEncodedFrame(payloads, timestamp, audio_level)


class _AudioDecoder:
    """Stands where an audio receiver keeps its decoder thread's queue. On the loop (the
    default), `put` decodes the frame and hands the result to the receiver's track directly,
    in the order the frames complete; else `put` queues it for the receiver's thread, which
    decodes and hands over as aiortc's does. `put(None)` ends the track either way."""

    def __init__(self, receiver: RTCRtpReceiver, on_loop: bool) -> None:
        self._receiver = receiver
        self.on_loop = on_loop
        # a release-on-arrival jitter buffer may hold frames back behind a late packet
        buffer = getattr(receiver, _RECEIVER_JITTER)
        self._buffer = buffer if getattr(buffer, "on_arrival", False) else None
        self._timestamps = getattr(receiver, _RECEIVER_TIMESTAMPS)
        self.rate: int | None = None  # decode_at(): Opus straight to this rate, mono
        self._decoder: Any = None
        self._codec_name: str | None = None
        self._tasks: queue.Queue[Any] = queue.Queue()

    def put(self, task: tuple[RTCRtpCodecParameters, Any] | None) -> None:
        for one in [task, *self._held_back(task)]:
            if not self.on_loop:
                self._tasks.put(one)
                continue
            track = self._receiver._track
            if track is not None:
                for frame in self._decode(one):
                    track._queue.put_nowait(frame)

    def _held_back(self, task: tuple[RTCRtpCodecParameters, Any] | None) -> list[Any]:
        """Frames a late packet held back in a release-on-arrival jitter buffer, now in order
        behind it (the receiver hands over one frame a packet), stamped as the receiver does."""
        if task is None or self._buffer is None:
            return []
        more = []
        while (frame := self._buffer.pop_ready()) is not None:
            frame.timestamp = self._timestamps.map(frame.timestamp)
            more.append((task[0], frame))
        return more

    def run_thread(self, loop: asyncio.AbstractEventLoop, output_q: asyncio.Queue[Any]) -> None:
        """The receiver's decoder thread, when decoding off the loop."""
        while True:
            task = self._tasks.get()
            for frame in self._decode(task):
                asyncio.run_coroutine_threadsafe(output_q.put(frame), loop)
            if task is None:
                return

    def _decode(self, task: tuple[RTCRtpCodecParameters, Any] | None) -> list[Any]:
        if task is None:
            return [None]  # the track's end
        codec, encoded_frame = task
        if codec.name != self._codec_name:
            self._decoder = self._decoder_for(codec)
            self._codec_name = codec.name
        try:
            return list(self._decoder.decode(encoded_frame))
        except Exception as exc:  # one bad frame must not stop the receiver: log, go on
            logger.warning("dropped an audio frame %s failed to decode: %s", codec.name, exc)
            getattr(self._receiver, _RECEIVER_ERROR).set()
            return []

    def _decoder_for(self, codec: RTCRtpCodecParameters) -> Any:
        if self.rate and _state["opus"] == "opuslib" and codec.mimeType.lower() == "audio/opus":
            return OpuslibDecoder(self.rate)
        return _rtcrtpreceiver.get_decoder(codec)


def _receiver_init(self: RTCRtpReceiver, kind: str, transport: Any) -> None:
    _STOCK_RECEIVER_INIT(self, kind, transport)
    if kind == "audio":
        setattr(self, _RECEIVER_QUEUE, _AudioDecoder(self, _state["decode_on_loop"]))


def _decoder_worker(loop: Any, input_q: Any, output_q: Any, decode_error: Any) -> None:
    """aiortc's decoder thread; an audio receiver's that decodes on the loop ends at once."""
    if not isinstance(input_q, _AudioDecoder):
        _STOCK_DECODER_WORKER(loop, input_q, output_q, decode_error)
    elif not input_q.on_loop:
        input_q.run_thread(loop, output_q)


def decode_at(receiver: RTCRtpReceiver, rate: int) -> None:
    """Have `receiver` decode Opus straight to `rate` mono (with opus="opuslib"); call it
    before the connection starts receiving (right after setRemoteDescription)."""
    decoder = getattr(receiver, _RECEIVER_QUEUE)
    if not isinstance(decoder, _AudioDecoder):
        raise AiortcTuningError("decode_at() needs an audio receiver made after apply()")
    decoder.rate = rate


def _get_encoder(codec: RTCRtpCodecParameters) -> Any:
    if codec.mimeType.lower() == "audio/opus":
        return OpuslibEncoder()
    return _STOCK_GET_ENCODER(codec)


def _set_opus(codec: str) -> None:
    libopus = codec == "opuslib"
    _rtcrtpsender.get_encoder = _get_encoder if libopus else _STOCK_GET_ENCODER  # type: ignore[assignment]
    _state["opus"] = codec


def _read_ready_drained(self: Any) -> None:
    """asyncio's `_SelectorDatagramTransport._read_ready`, reading up to `udp_reads_per_wake`
    queued datagrams instead of one; transports of other protocols keep the stock read."""
    if not isinstance(self._protocol, _aioice.StunProtocol):
        _STOCK_DATAGRAM_READ(self)
        return
    for _ in range(_state["udp_reads_per_wake"]):
        if self._conn_lost:
            return
        try:
            data, addr = self._sock.recvfrom(self.max_size)
        except (BlockingIOError, InterruptedError):
            return  # drained
        except OSError as exc:
            self._protocol.error_received(exc)
            return
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal_error(exc, "Fatal read error on datagram transport")
            return
        self._protocol.datagram_received(data, addr)


def _aiortc_modules() -> list[ModuleType]:
    return [
        m
        for name, m in list(sys.modules.items())
        if m is not None and (name == "aiortc" or name.startswith("aiortc."))
    ]


def _fail(what: str) -> AiortcTuningError:
    import aiortc

    version = getattr(aiortc, "__version__", "?")
    return AiortcTuningError(
        f"aiortc {version}: {what}; gateway.aiortc_tuning was written against aiortc 1.16 "
        "and must be updated before it can tune this version"
    )


def _code_names(func: Any) -> set[str]:
    code = getattr(func, "__code__", None)
    return set(code.co_names) if code is not None else set()


def verify() -> None:
    """Raise AiortcTuningError if an aiortc internal that `apply()` replaces has changed."""
    # (a) the audio level function, looked up through the module by the sender
    level = getattr(_rtp, "compute_audio_level_dbov", None)
    if not callable(level):
        raise _fail("aiortc.rtp.compute_audio_level_dbov is missing")
    if list(inspect.signature(_STOCK_LEVEL).parameters) != ["frame"]:
        raise _fail("aiortc.rtp.compute_audio_level_dbov no longer takes (frame)")
    if getattr(_rtcrtpsender, "rtp", None) is not _rtp:
        raise _fail("aiortc.rtcrtpsender no longer reaches the level function as rtp.<name>")

    # (b) the receiver's jitter buffer, built from the name JitterBuffer in its module
    jitter_buffer = getattr(_rtcrtpreceiver, "JitterBuffer", None)
    if not (isinstance(jitter_buffer, type) and issubclass(jitter_buffer, _STOCK_JITTER_BUFFER)):
        raise _fail("aiortc.rtcrtpreceiver.JitterBuffer is missing")
    params = list(inspect.signature(_STOCK_JITTER_BUFFER.__init__).parameters)
    if params[:4] != ["self", "capacity", "prefetch", "is_video"]:
        raise _fail(f"JitterBuffer.__init__ takes {params[1:]}, not (capacity, prefetch, is_video)")
    if "JitterBuffer" not in _code_names(RTCRtpReceiver.__init__):
        raise _fail("RTCRtpReceiver.__init__ no longer builds a JitterBuffer")

    # (c) the sender's encode step that is copied with the executor hop taken out
    current = getattr(RTCRtpSender, "_next_encoded_frame", None)
    if current is None or not inspect.iscoroutinefunction(current):
        raise _fail("RTCRtpSender._next_encoded_frame is missing or not a coroutine")
    if list(inspect.signature(_STOCK_NEXT_ENCODED_FRAME).parameters) != ["self", "codec"]:
        raise _fail("RTCRtpSender._next_encoded_frame no longer takes (self, codec)")
    missing = sorted(set(_SENDER_NAMES) - _code_names(_STOCK_NEXT_ENCODED_FRAME))
    if missing:
        raise _fail(f"RTCRtpSender._next_encoded_frame no longer uses {missing}")
    for name in ("get_encoder", "RTCEncodedFrame", "Frame", "AudioFrame"):
        if not hasattr(_rtcrtpsender, name):
            raise _fail(f"aiortc.rtcrtpsender.{name} is missing")
    if not isinstance(inspect.getattr_static(RTCRtpSender, "kind", None), property):
        raise _fail("RTCRtpSender.kind is missing")

    # (d) the codec factories, and the receiver's decoder thread and the queue it reads, which
    # the inline decoder stands in for
    for module, name in ((_rtcrtpreceiver, "get_decoder"), (_rtcrtpsender, "get_encoder")):
        if not callable(getattr(module, name, None)):
            raise _fail(f"{module.__name__}.{name} is missing")
    params = list(inspect.signature(_STOCK_DECODER_WORKER).parameters)
    if params != ["loop", "input_q", "output_q", "decode_error"]:
        raise _fail(f"rtcrtpreceiver.decoder_worker takes {params}")
    if "decoder_worker" not in _code_names(RTCRtpReceiver.receive):
        raise _fail("RTCRtpReceiver.receive no longer starts decoder_worker")
    params = list(inspect.signature(_STOCK_RECEIVER_INIT).parameters)
    if params != ["self", "kind", "transport"]:
        raise _fail(f"RTCRtpReceiver.__init__ takes {params[1:]}, not (kind, transport)")
    remote_track = getattr(_rtcrtpreceiver, "RemoteStreamTrack", None)
    for label, method, names in (
        (
            "RTCRtpReceiver.__init__",
            _STOCK_RECEIVER_INIT,
            {_RECEIVER_QUEUE, _RECEIVER_ERROR, _RECEIVER_JITTER, _RECEIVER_TIMESTAMPS},
        ),
        (
            "RTCRtpReceiver._handle_rtp_packet",
            getattr(RTCRtpReceiver, "_handle_rtp_packet", None),
            {_RECEIVER_QUEUE, "put"},
        ),
        (
            "RTCRtpReceiver.__stop_decoder",
            getattr(RTCRtpReceiver, "_RTCRtpReceiver__stop_decoder", None),
            {"put", "join"},
        ),
        ("RemoteStreamTrack.__init__", getattr(remote_track, "__init__", None), {"_queue"}),
    ):
        missing = sorted(names - _code_names(method))
        if missing:
            raise _fail(f"{label} no longer uses {missing}")

    # (e) asyncio's datagram read and the protocol aioice reads its sockets with
    if not isinstance(getattr(_aioice, "StunProtocol", None), type):
        raise _fail("aioice.ice.StunProtocol is missing")
    missing = sorted(
        {"_conn_lost", "_sock", "recvfrom", "max_size", "_protocol", "datagram_received"}
        - _code_names(_STOCK_DATAGRAM_READ)
    )
    if missing:
        raise _fail(f"asyncio's datagram transport no longer reads with {missing}")


def apply(
    audio_prefetch: int = 1,
    opus: str = "opuslib",
    udp_reads_per_wake: int = 32,
    decode_on_loop: bool = True,
) -> None:
    """Install the patches (idempotent); a second call only changes the settings.

    The prefetch, codec and decoding place apply to peer connections created afterwards, the
    UDP reads to sockets created afterwards. Call once at start-up, before any
    RTCPeerConnection exists. `decode_on_loop=False` decodes audio on a thread per receiver
    as aiortc does (for comparisons).
    """
    if audio_prefetch < 0:
        raise ValueError(f"audio_prefetch must be >= 0, got {audio_prefetch}")
    if udp_reads_per_wake < 1:
        raise ValueError(f"udp_reads_per_wake must be >= 1, got {udp_reads_per_wake}")
    if opus not in OPUS_CODECS:
        raise ValueError(f"opus must be one of {OPUS_CODECS}, not {opus!r}")
    if opus == "opuslib":
        opuslib()  # OpusUnavailable now, naming what to install, rather than at the first call
    _state["audio_prefetch"] = int(audio_prefetch)
    _state["udp_reads_per_wake"] = int(udp_reads_per_wake)
    _state["decode_on_loop"] = bool(decode_on_loop)
    if _state["applied"]:
        _set_opus(opus)
        return
    verify()
    # Patch every aiortc module that bound the level function by name, not just aiortc.rtp.
    sites = [
        m for m in _aiortc_modules() if vars(m).get("compute_audio_level_dbov") is _STOCK_LEVEL
    ]
    for module in sites:
        module.compute_audio_level_dbov = compute_audio_level_dbov  # type: ignore[attr-defined]
    _state["level_sites"] = sites
    _rtcrtpreceiver.JitterBuffer = _PrefetchJitterBuffer  # type: ignore[misc]
    RTCRtpSender._next_encoded_frame = _next_encoded_frame_inline  # type: ignore[method-assign]
    RTCRtpReceiver.__init__ = _receiver_init  # type: ignore[method-assign]
    _rtcrtpreceiver.decoder_worker = _decoder_worker
    _DatagramTransport._read_ready = _read_ready_drained
    _set_opus(opus)
    _state["applied"] = True


def restore() -> None:
    """Put stock aiortc back (for tests and comparisons); a no-op when nothing is applied."""
    if not _state["applied"]:
        return
    for module in _state["level_sites"]:
        module.compute_audio_level_dbov = _STOCK_LEVEL
    _state["level_sites"] = []
    _rtcrtpreceiver.JitterBuffer = _STOCK_JITTER_BUFFER  # type: ignore[misc]
    RTCRtpSender._next_encoded_frame = _STOCK_NEXT_ENCODED_FRAME  # type: ignore[method-assign]
    RTCRtpReceiver.__init__ = _STOCK_RECEIVER_INIT  # type: ignore[method-assign]
    _rtcrtpreceiver.decoder_worker = _STOCK_DECODER_WORKER
    _DatagramTransport._read_ready = _STOCK_DATAGRAM_READ
    _set_opus("aiortc")
    _state["applied"] = False


def applied() -> bool:
    """Whether the patches are installed now."""
    return bool(_state["applied"])


def opus_codec() -> str:
    """Which Opus implementation peer connections created now get."""
    return str(_state["opus"]) if _state["applied"] else "aiortc"


def udp_reads_per_wake() -> int:
    """How many queued datagrams an ICE socket reads per wake-up while the patches are in."""
    return int(_state["udp_reads_per_wake"]) if _state["applied"] else 1


def decode_on_loop() -> bool:
    """Whether audio receivers made now decode on the event loop (else on a thread each)."""
    return bool(_state["decode_on_loop"]) and applied()


def audio_prefetch() -> int:
    """The prefetch that audio jitter buffers get while the patches are installed."""
    return int(_state["audio_prefetch"])
