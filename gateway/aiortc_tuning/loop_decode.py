"""Audio decoded on the event loop as each frame completes, not on a thread per receiver.

Each `RTCRtpReceiver` decodes on a thread of its own, and every 20 ms packet crosses to it and
back (a queue.Queue, a GIL hand-off, `run_coroutine_threadsafe` writing to the loop's
self-pipe), which costs more than the decode. The receiver's thread still starts but ends at
once; video keeps its decoder thread. A receiver marked with `decode_at(receiver, rate)`
decodes Opus straight to that rate, mono, through libopus (gateway.aiortc_tuning.opus_rates).
Retire this once aiortc decodes audio on the loop (or in its own worker, without the hops).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
from collections.abc import Callable
from typing import Any

import aiortc.rtcrtpreceiver as _rtcrtpreceiver
from aiortc.rtcrtpparameters import RTCRtpCodecParameters
from aiortc.rtcrtpreceiver import RTCRtpReceiver

from gateway.aiortc_tuning.common import AiortcTuningError, code_names, fail, settings
from gateway.opus import OpuslibDecoder

logger = logging.getLogger(__name__)

STOCK_DECODER_WORKER: Callable[..., None] = _rtcrtpreceiver.decoder_worker
STOCK_RECEIVER_INIT: Callable[..., None] = RTCRtpReceiver.__init__
_RECEIVER_QUEUE = "_RTCRtpReceiver__decoder_queue"  # the decoder thread's queue, name-mangled
_RECEIVER_JITTER = "_RTCRtpReceiver__jitter_buffer"
_RECEIVER_TIMESTAMPS = "_RTCRtpReceiver__timestamp_mapper"
_RECEIVER_ERROR = "_RTCRtpReceiver__decoder_error"  # set when a frame fails to decode


class AudioDecoder:
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
        if self.rate and settings.opus == "opuslib" and codec.mimeType.lower() == "audio/opus":
            return OpuslibDecoder(self.rate)
        return _rtcrtpreceiver.get_decoder(codec)


def _receiver_init(self: RTCRtpReceiver, kind: str, transport: Any) -> None:
    STOCK_RECEIVER_INIT(self, kind, transport)
    if kind == "audio":
        setattr(self, _RECEIVER_QUEUE, AudioDecoder(self, settings.decode_on_loop))


def _decoder_worker(loop: Any, input_q: Any, output_q: Any, decode_error: Any) -> None:
    """aiortc's decoder thread; an audio receiver's that decodes on the loop ends at once."""
    if not isinstance(input_q, AudioDecoder):
        STOCK_DECODER_WORKER(loop, input_q, output_q, decode_error)
    elif not input_q.on_loop:
        input_q.run_thread(loop, output_q)


def decode_at(receiver: RTCRtpReceiver, rate: int) -> None:
    """Have `receiver` decode Opus straight to `rate` mono (with opus="opuslib"); call it
    before the connection starts receiving (right after setRemoteDescription)."""
    decoder = getattr(receiver, _RECEIVER_QUEUE)
    if not isinstance(decoder, AudioDecoder):
        raise AiortcTuningError("decode_at() needs an audio receiver made after apply()")
    decoder.rate = rate


def verify() -> None:
    """The receiver's decoder thread and the queue it reads, which AudioDecoder stands in for."""
    if not callable(getattr(_rtcrtpreceiver, "get_decoder", None)):
        raise fail("aiortc.rtcrtpreceiver.get_decoder is missing")
    params = list(inspect.signature(STOCK_DECODER_WORKER).parameters)
    if params != ["loop", "input_q", "output_q", "decode_error"]:
        raise fail(f"rtcrtpreceiver.decoder_worker takes {params}")
    if "decoder_worker" not in code_names(RTCRtpReceiver.receive):
        raise fail("RTCRtpReceiver.receive no longer starts decoder_worker")
    params = list(inspect.signature(STOCK_RECEIVER_INIT).parameters)
    if params != ["self", "kind", "transport"]:
        raise fail(f"RTCRtpReceiver.__init__ takes {params[1:]}, not (kind, transport)")
    remote_track = getattr(_rtcrtpreceiver, "RemoteStreamTrack", None)
    for label, method, names in (
        (
            "RTCRtpReceiver.__init__",
            STOCK_RECEIVER_INIT,
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
        missing = sorted(names - code_names(method))
        if missing:
            raise fail(f"{label} no longer uses {missing}")


def install() -> None:
    RTCRtpReceiver.__init__ = _receiver_init  # type: ignore[method-assign]
    _rtcrtpreceiver.decoder_worker = _decoder_worker


def remove() -> None:
    RTCRtpReceiver.__init__ = STOCK_RECEIVER_INIT  # type: ignore[method-assign]
    _rtcrtpreceiver.decoder_worker = STOCK_DECODER_WORKER
