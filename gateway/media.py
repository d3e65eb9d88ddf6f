"""Process-wide media settings: aiortc's runtime tuning and the ICE host addresses, made once
in each gateway process before its first peer connection."""

from __future__ import annotations

from gateway import aiortc_tuning
from gateway.config import OmniConfig
from gateway.ice import restrict_host_addresses


def prepare_media(config: OmniConfig) -> None:
    """Process-wide aiortc/aioice settings; before the first peer connection."""
    media, experiments = config.gateway.media, config.experiments
    aiortc_tuning.apply(
        media.audio_prefetch,
        experiments.opus,
        media.udp_reads_per_wake,
        decode_on_loop=experiments.audio_decode == "loop",
    )
    restrict_host_addresses(config.gateway.ice_host_addresses)
