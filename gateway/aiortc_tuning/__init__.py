"""Runtime adjustments to aiortc for a many-call voice gateway; installed files are never edited.

One module a patch, each saying what it changes, why, and which upstream change would retire it:

- `audio_level`: the RFC 6465 level of each sent frame in numpy, not a pure-Python loop.
- `jitter`: the audio jitter buffer's prefetch, hand-on at arrival, and a bounded loss wait.
- `inline_encode`: audio encoded on the event loop, not in the default executor.
- `loop_decode`: audio decoded on the event loop, not on a thread per receiver.
- `opus_rates`: Opus through libopus at the pipeline's rates, mono.
- `udp_drain`: ICE sockets read all they have queued per wake-up, not one datagram.

`apply()` installs them all and `restore()` takes them out. `verify()` checks that the aiortc
internals they rely on are still there, so an aiortc upgrade that moves them fails loudly at
start-up instead of silently running stock; pyproject.toml pins aiortc and aioice to the
versions they were written against (`common.AIORTC_VERSION`, `common.AIOICE_VERSION`).
"""

from __future__ import annotations

from gateway.aiortc_tuning import (
    audio_level,
    inline_encode,
    jitter,
    loop_decode,
    opus_rates,
    udp_drain,
)
from gateway.aiortc_tuning.audio_level import compute_audio_level_dbov
from gateway.aiortc_tuning.common import OPUS_CODECS, AiortcTuningError, settings
from gateway.aiortc_tuning.loop_decode import decode_at
from gateway.opus import opuslib

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

PATCHES = (audio_level, jitter, inline_encode, loop_decode, udp_drain)


def verify() -> None:
    """Raise AiortcTuningError if an aiortc internal that `apply()` replaces has changed."""
    for patch in (*PATCHES, opus_rates):
        patch.verify()


def apply(
    audio_prefetch: int = 0,
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
    settings.audio_prefetch = int(audio_prefetch)
    settings.udp_reads_per_wake = int(udp_reads_per_wake)
    settings.decode_on_loop = bool(decode_on_loop)
    if not settings.applied:
        verify()
        for patch in PATCHES:
            patch.install()
        settings.applied = True
    opus_rates.use(opus)


def restore() -> None:
    """Put stock aiortc back (for tests and comparisons); a no-op when nothing is applied."""
    if not settings.applied:
        return
    for patch in PATCHES:
        patch.remove()
    opus_rates.use("aiortc")
    settings.applied = False


def applied() -> bool:
    """Whether the patches are installed now."""
    return settings.applied


def opus_codec() -> str:
    """Which Opus implementation peer connections created now get."""
    return settings.opus if settings.applied else "aiortc"


def udp_reads_per_wake() -> int:
    """How many queued datagrams an ICE socket reads per wake-up while the patches are in."""
    return settings.udp_reads_per_wake if settings.applied else 1


def decode_on_loop() -> bool:
    """Whether audio receivers made now decode on the event loop (else on a thread each)."""
    return settings.decode_on_loop and settings.applied


def audio_prefetch() -> int:
    """The prefetch that audio jitter buffers get while the patches are installed."""
    return settings.audio_prefetch
