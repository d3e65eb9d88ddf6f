"""Serving the gateway next to a running supervisor (what `omni-gateway start` runs)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from aiohttp import web

from gateway import aiortc_tuning
from gateway.app import create_app
from gateway.config import OmniConfig
from gateway.ice import restrict_host_addresses
from gateway.page import add_page_routes
from stages.supervisor import Supervisor


def prepare_media(config: OmniConfig) -> None:
    """Process-wide aiortc/aioice settings; before the first peer connection."""
    aiortc_tuning.apply(config.gateway.audio_prefetch, config.gateway.opus)
    restrict_host_addresses(config.gateway.ice_host_addresses)


def build_app(config: OmniConfig, supervisor: Supervisor) -> web.Application:
    rate = int(supervisor.stages["vocoder"].info["sample_rate"])
    app = create_app(config, supervisor.names, rate, lambda: supervisor.healthy)
    add_page_routes(app)  # the demo page at /
    return app


async def serve(
    config: OmniConfig, supervisor: Supervisor, progress: Callable[[str], None]
) -> None:
    """Serve until SIGINT or SIGTERM, then close every call."""
    prepare_media(config)
    runner = web.AppRunner(build_app(config, supervisor), handle_signals=False)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        site = web.TCPSite(runner, config.gateway.host, config.gateway.port)
        await site.start()
        progress(
            f"gateway listening on http://{config.gateway.host}:{config.gateway.port}"
            " (Ctrl-C stops)"
        )
        await stop.wait()
        progress("stopping")
    finally:
        await runner.cleanup()
