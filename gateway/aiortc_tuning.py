"""Runtime adjustments to aiortc for a many-call voice gateway; installed files are never edited.

Four changes, all applied by `apply()` and undone by `restore()`:

- `aiortc.rtp.compute_audio_level_dbov` (RFC 6465 level of every sent audio frame) is a pure-Python
  loop of about 175 µs per stereo frame on the event loop; a numpy version computes the same integer
  in a few µs.
- The audio jitter buffer that `RTCRtpReceiver` builds holds `prefetch=4` frames (about 80 ms per
  receiving hop) before it releases one; the gateway wants a low, configurable prefetch.
- `RTCRtpSender._next_encoded_frame` hands every encode to the default executor; for Opus (tens
  of µs per 20 ms frame) the thread hop costs more than the encode and makes many calls queue
  behind a few executor threads, so audio is encoded inline. Video keeps aiortc's executor path.
- With `opus="opuslib"`, Opus goes through libopus at the pipeline's rates (gateway.opus): every
  audio sender encodes 20 ms mono frames at an Opus rate as they are (no resampling to 48 kHz
  stereo), and receivers marked with `decode_at(receiver, rate)` decode straight to that rate,
  mono. Receivers not marked (a client in the same process) keep aiortc's 48 kHz stereo.

`verify()` checks that the aiortc internals these patches rely on are still there, so an aiortc
upgrade that moves them fails loudly at start-up instead of silently running stock.
"""

from __future__ import annotations

import inspect
import math
import sys
import threading
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any

import aiortc.rtcrtpreceiver as _rtcrtpreceiver
import aiortc.rtcrtpsender as _rtcrtpsender
import aiortc.rtp as _rtp
import numpy as np
from aiortc.jitterbuffer import JitterBuffer
from aiortc.rtcrtpparameters import RTCRtpCodecParameters
from aiortc.rtcrtpreceiver import RTCRtpReceiver
from aiortc.rtcrtpsender import RTCRtpSender
from av import AudioFrame

from gateway.opus import OpuslibDecoder, OpuslibEncoder, opuslib

__all__ = [
    "OPUS_CODECS",
    "AiortcTuningError",
    "applied",
    "apply",
    "audio_prefetch",
    "compute_audio_level_dbov",
    "decode_at",
    "opus_codec",
    "restore",
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
_STOCK_GET_DECODER: Callable[..., Any] = _rtcrtpreceiver.get_decoder
_STOCK_GET_ENCODER: Callable[..., Any] = _rtcrtpsender.get_encoder
_STOCK_DECODER_WORKER: Callable[..., None] = _rtcrtpreceiver.decoder_worker
_DECODE_RATE = "omni_decode_rate"  # set on a receiver's decoder queue by decode_at()
_decoder_thread = threading.local()  # the rate the current decoder thread decodes at

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
    """aiortc's JitterBuffer with the audio prefetch taken from `apply(audio_prefetch=...)`.

    Installed only as the name `JitterBuffer` inside aiortc.rtcrtpreceiver, the one place that
    builds receive buffers; video buffers pass through unchanged. Prefetch 0 and 1 behave the
    same: a frame is released when the first packet of the next frame arrives.
    """

    def __init__(self, capacity: int, prefetch: int = 0, is_video: bool = False) -> None:
        if not is_video:
            prefetch = _state["audio_prefetch"]
        super().__init__(capacity, prefetch=prefetch, is_video=is_video)


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


def decode_at(receiver: RTCRtpReceiver, rate: int) -> None:
    """Have `receiver` decode Opus straight to `rate` mono (with opus="opuslib"); call it
    before the connection starts receiving (right after setRemoteDescription)."""
    setattr(receiver._RTCRtpReceiver__decoder_queue, _DECODE_RATE, rate)  # type: ignore[attr-defined]


def _decoder_worker(loop: Any, input_q: Any, output_q: Any, decode_error: Any) -> None:
    """aiortc's decoder thread, told which rate its receiver asked for."""
    _decoder_thread.rate = getattr(input_q, _DECODE_RATE, None)
    _STOCK_DECODER_WORKER(loop, input_q, output_q, decode_error)


def _get_decoder(codec: RTCRtpCodecParameters) -> Any:
    rate = getattr(_decoder_thread, "rate", None)
    if rate and codec.mimeType.lower() == "audio/opus":
        return OpuslibDecoder(rate)
    return _STOCK_GET_DECODER(codec)


def _get_encoder(codec: RTCRtpCodecParameters) -> Any:
    if codec.mimeType.lower() == "audio/opus":
        return OpuslibEncoder()
    return _STOCK_GET_ENCODER(codec)


def _set_opus(codec: str) -> None:
    libopus = codec == "opuslib"
    _rtcrtpreceiver.decoder_worker = _decoder_worker if libopus else _STOCK_DECODER_WORKER  # type: ignore[assignment]
    _rtcrtpreceiver.get_decoder = _get_decoder if libopus else _STOCK_GET_DECODER  # type: ignore[assignment]
    _rtcrtpsender.get_encoder = _get_encoder if libopus else _STOCK_GET_ENCODER  # type: ignore[assignment]
    _state["opus"] = codec


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

    # (d) the codec factories and the receiver's decoder thread, for opus="opuslib"
    for module, name in ((_rtcrtpreceiver, "get_decoder"), (_rtcrtpsender, "get_encoder")):
        if not callable(getattr(module, name, None)):
            raise _fail(f"{module.__name__}.{name} is missing")
    params = list(inspect.signature(_STOCK_DECODER_WORKER).parameters)
    if params != ["loop", "input_q", "output_q", "decode_error"]:
        raise _fail(f"rtcrtpreceiver.decoder_worker takes {params}")
    if "get_decoder" not in _code_names(_STOCK_DECODER_WORKER):
        raise _fail("rtcrtpreceiver.decoder_worker no longer calls get_decoder")
    if "decoder_worker" not in _code_names(RTCRtpReceiver.receive):
        raise _fail("RTCRtpReceiver.receive no longer starts decoder_worker")
    if "_RTCRtpReceiver__decoder_queue" not in _code_names(RTCRtpReceiver.__init__):
        raise _fail("RTCRtpReceiver no longer has a decoder queue")


def apply(audio_prefetch: int = 1, opus: str = "opuslib") -> None:
    """Install the patches (idempotent); a second call only changes the prefetch and codec.

    Both apply to peer connections created afterwards. Call once at start-up, before any
    RTCPeerConnection exists.
    """
    if audio_prefetch < 0:
        raise ValueError(f"audio_prefetch must be >= 0, got {audio_prefetch}")
    if opus not in OPUS_CODECS:
        raise ValueError(f"opus must be one of {OPUS_CODECS}, not {opus!r}")
    if opus == "opuslib":
        opuslib()  # OpusUnavailable now, naming what to install, rather than at the first call
    _state["audio_prefetch"] = int(audio_prefetch)
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
    _set_opus("aiortc")
    _state["applied"] = False


def applied() -> bool:
    """Whether the patches are installed now."""
    return bool(_state["applied"])


def opus_codec() -> str:
    """Which Opus implementation peer connections created now get."""
    return str(_state["opus"]) if _state["applied"] else "aiortc"


def audio_prefetch() -> int:
    """The prefetch that audio jitter buffers get while the patches are installed."""
    return int(_state["audio_prefetch"])
