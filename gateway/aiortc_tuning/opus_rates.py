"""Opus through libopus at the pipeline's rates (gateway.opus).

With `opus="opuslib"`, every audio sender encodes 20 ms mono frames at an Opus rate as they are
(no resampling to 48 kHz stereo), and receivers marked with `decode_at(receiver, rate)`
(gateway.aiortc_tuning.loop_decode) decode straight to that rate, mono. Receivers not marked (a
client in the same process) keep aiortc's 48 kHz stereo. Retire this once aiortc's Opus codec
takes a rate and channel count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiortc.rtcrtpsender as _rtcrtpsender
from aiortc.rtcrtpparameters import RTCRtpCodecParameters

from gateway.aiortc_tuning.common import fail, settings
from gateway.opus import OpuslibEncoder

STOCK_GET_ENCODER: Callable[..., Any] = _rtcrtpsender.get_encoder


def _get_encoder(codec: RTCRtpCodecParameters) -> Any:
    if codec.mimeType.lower() == "audio/opus":
        return OpuslibEncoder()
    return STOCK_GET_ENCODER(codec)


def use(codec: str) -> None:
    """Senders made from now on encode with libopus ("opuslib") or aiortc's codec."""
    libopus = codec == "opuslib"
    _rtcrtpsender.get_encoder = _get_encoder if libopus else STOCK_GET_ENCODER  # type: ignore[assignment]
    settings.opus = codec


def verify() -> None:
    if not callable(getattr(_rtcrtpsender, "get_encoder", None)):
        raise fail("aiortc.rtcrtpsender.get_encoder is missing")
