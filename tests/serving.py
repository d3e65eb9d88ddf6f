"""The gateway as the end-to-end tests serve it: `build_app` (signaling, health, metrics, the
demo page) next to a running supervisor, on 127.0.0.1 with an ephemeral port."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from gateway import aiortc_tuning
from gateway.config import OmniConfig
from gateway.ice import restrict_host_addresses
from gateway.server import build_app, prepare_media
from stages.supervisor import Supervisor


@asynccontextmanager
async def serving_gateway(
    config: OmniConfig, supervisor: Supervisor
) -> AsyncIterator[tuple[str, web.Application]]:
    """Yield (base URL, app); afterwards the process-wide media settings are restored."""
    prepare_media(config)
    runner = web.AppRunner(build_app(config, supervisor))
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}", runner.app
    finally:
        await runner.cleanup()
        aiortc_tuning.restore()
        restrict_host_addresses(None)
