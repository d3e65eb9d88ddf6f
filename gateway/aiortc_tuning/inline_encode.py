"""Audio encoded on the event loop, not in the default executor.

`RTCRtpSender._next_encoded_frame` hands every encode to the default executor; for Opus (tens
of µs per 20 ms frame) the thread hop costs more than the encode and makes many calls queue
behind a few executor threads. Video keeps aiortc's executor path. Retire this once aiortc
encodes audio inline (or lets a codec say it is cheap enough to).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from typing import Any

import aiortc.rtcrtpsender as _rtcrtpsender
import aiortc.rtp as _rtp
from aiortc.rtcrtpparameters import RTCRtpCodecParameters
from aiortc.rtcrtpsender import RTCRtpSender

from gateway.aiortc_tuning.common import code_names, fail

STOCK: Callable[..., Coroutine[Any, Any, Any]] = RTCRtpSender._next_encoded_frame

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


async def next_encoded_frame_inline(
    self: RTCRtpSender, codec: RTCRtpCodecParameters
) -> _rtcrtpsender.RTCEncodedFrame | None:
    """aiortc 1.16's `_next_encoded_frame` line for line, with the audio encode run inline.

    Non-audio senders go to the stock method (video encodes take milliseconds and belong off
    the loop). The private attributes are reached by their mangled names.
    """
    if self.kind != "audio":
        return await STOCK(self, codec)

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


def verify() -> None:
    """The sender's encode step, copied above with the executor hop taken out."""
    current = getattr(RTCRtpSender, "_next_encoded_frame", None)
    if current is None or not inspect.iscoroutinefunction(current):
        raise fail("RTCRtpSender._next_encoded_frame is missing or not a coroutine")
    if list(inspect.signature(STOCK).parameters) != ["self", "codec"]:
        raise fail("RTCRtpSender._next_encoded_frame no longer takes (self, codec)")
    missing = sorted(set(_SENDER_NAMES) - code_names(STOCK))
    if missing:
        raise fail(f"RTCRtpSender._next_encoded_frame no longer uses {missing}")
    for name in ("get_encoder", "RTCEncodedFrame", "Frame", "AudioFrame"):
        if not hasattr(_rtcrtpsender, name):
            raise fail(f"aiortc.rtcrtpsender.{name} is missing")
    if not isinstance(inspect.getattr_static(RTCRtpSender, "kind", None), property):
        raise fail("RTCRtpSender.kind is missing")


def install() -> None:
    RTCRtpSender._next_encoded_frame = next_encoded_frame_inline  # type: ignore[method-assign]


def remove() -> None:
    RTCRtpSender._next_encoded_frame = STOCK  # type: ignore[method-assign]
