"""What the patches share: their settings, and how one says that aiortc has moved on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The versions the patches were written against (pyproject.toml pins them).
AIORTC_VERSION = "1.16.0"
AIOICE_VERSION = "0.13.0"
OPUS_CODECS = ("opuslib", "aiortc")


class AiortcTuningError(RuntimeError):
    """The installed aiortc no longer has an internal that a tuning patch replaces."""


@dataclass
class Settings:
    """The patches' settings, read by them as peer connections and sockets are made."""

    applied: bool = False
    audio_prefetch: int = 0  # as gateway.media.audio_prefetch's default
    opus: str = "aiortc"
    udp_reads_per_wake: int = 32
    decode_on_loop: bool = True


settings = Settings()


def fail(what: str) -> AiortcTuningError:
    import aiortc

    version = getattr(aiortc, "__version__", "?")
    return AiortcTuningError(
        f"aiortc {version}: {what}; gateway.aiortc_tuning was written against aiortc "
        f"{AIORTC_VERSION} and must be updated before it can tune this version"
    )


def code_names(func: Any) -> set[str]:
    """The names a function's code uses (what a patch relies on it doing)."""
    code = getattr(func, "__code__", None)
    return set(code.co_names) if code is not None else set()
