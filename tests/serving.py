"""Serving apps to tests on 127.0.0.1 with an ephemeral port; the gateway as the end-to-end
tests serve it: `build_app` (signaling, health, metrics, the demo page) next to a running
supervisor, or alone on rings no stage reads; and reading its /metrics."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway import aiortc_tuning
from gateway.app import build_app
from gateway.config import OmniConfig, load_config
from gateway.ice import restrict_host_addresses
from gateway.media import prepare_media
from gateway.server import vocoder_rate
from stages.rings import RingNames, RingSet
from stages.supervisor import Supervisor

TINY = Path(__file__).parents[1] / "configs" / "tiny.yaml"


def tiny_call_config(gateway: dict[str, Any]) -> OmniConfig:
    """configs/tiny.yaml as the end-to-end call modules run it: the same stages for all of
    them, so that they share one start (conftest's SHARING_STAGES), with the module's own
    gateway settings. The random-weight model ignores its end-of-sequence token, so every
    reply is exactly its session's max_output_tokens long (`gateway.max_output_tokens`, 160
    if unset): a module sets the length its calls need there, not in the stages."""
    if others := [key for key in gateway if not key.startswith("gateway.")]:
        raise ValueError(
            f"{others}: not gateway settings; they would give the module stages of its own"
        )
    return load_config(
        TINY,
        {
            "reasoning.sampling": {"max_tokens": 160, "ignore_eos": True},
            "max_sessions": 16,
            "gateway.port": 0,
            **gateway,
        },
    )


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """Serve `app` on 127.0.0.1; yield its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def serving_gateway(
    config: OmniConfig, supervisor: Supervisor
) -> AsyncIterator[tuple[str, web.Application]]:
    """Yield (base URL, app); afterwards the process-wide media settings are restored."""
    prepare_media(config)
    app = build_app(config, supervisor.names, vocoder_rate(supervisor), lambda: supervisor.healthy)
    try:
        async with serving(app) as base:
            yield base, app
    finally:
        aiortc_tuning.restore()
        restrict_host_addresses(None)


@asynccontextmanager
async def serving_gateway_alone(
    config: OmniConfig, **process: Any
) -> AsyncIterator[tuple[str, web.Application]]:
    """The gateway's app with no stages, on rings of its own: for what its HTTP endpoints
    answer (headers, auth, admission) without the seconds the stages take to start. A call
    it takes connects, but nothing answers it. `process`: build_app's."""
    names = RingNames.fresh(wake_yield=config.experiments.wake_yield)
    rings = RingSet(names, config)
    try:
        prepare_media(config)
        app = build_app(config, names, 22050, lambda: True, page=False, **process)
        async with serving(app) as base:
            yield base, app
    finally:
        aiortc_tuning.restore()
        restrict_host_addresses(None)
        rings.close()


async def metric(base: str, name: str) -> float:
    """A sample without labels from the gateway's /metrics at `base`."""
    async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as r:
        text = await r.text()
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))
