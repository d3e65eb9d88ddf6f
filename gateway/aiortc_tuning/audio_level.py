"""The RFC 6465 level of every sent audio frame, in numpy.

`aiortc.rtp.compute_audio_level_dbov` is a pure-Python loop of about 175 µs per stereo frame
on the event loop; this computes the same integer in a few µs. Retire it once aiortc computes
the level with numpy (or in C) itself.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from types import ModuleType

import aiortc.rtcrtpsender as _rtcrtpsender
import aiortc.rtp as _rtp
import numpy as np
from av import AudioFrame

from gateway.aiortc_tuning.common import fail

# RFC 6465 bounds, as aiortc spells them.
_MAX_SAMPLE_VALUE = 32767
_MIN_AUDIO_LEVEL = -127

STOCK: Callable[[AudioFrame], int] = _rtp.compute_audio_level_dbov
_sites: list[ModuleType] = []


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


def verify() -> None:
    level = getattr(_rtp, "compute_audio_level_dbov", None)
    if not callable(level):
        raise fail("aiortc.rtp.compute_audio_level_dbov is missing")
    if list(inspect.signature(STOCK).parameters) != ["frame"]:
        raise fail("aiortc.rtp.compute_audio_level_dbov no longer takes (frame)")
    if getattr(_rtcrtpsender, "rtp", None) is not _rtp:
        raise fail("aiortc.rtcrtpsender no longer reaches the level function as rtp.<name>")


def install() -> None:
    """Patch every aiortc module that bound the level function by name, not just aiortc.rtp."""
    modules = [
        m
        for name, m in list(sys.modules.items())
        if m is not None and (name == "aiortc" or name.startswith("aiortc."))
    ]
    _sites[:] = [m for m in modules if vars(m).get("compute_audio_level_dbov") is STOCK]
    for module in _sites:
        module.compute_audio_level_dbov = compute_audio_level_dbov  # type: ignore[attr-defined]


def remove() -> None:
    for module in _sites:
        module.compute_audio_level_dbov = STOCK  # type: ignore[attr-defined]
    _sites.clear()
