"""Serving the gateway next to a running supervisor (what `omni-gateway start` runs): in this
process, and with `gateway.processes` > 1 in more processes on the same port (gateway.pool,
gateway.gateway_process)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from gateway.app import GATEWAY_KEY, build_app
from gateway.config import OmniConfig
from gateway.gateway_process import GatewayProcessSpec
from gateway.hosts import ClusterMember
from gateway.media import prepare_media
from gateway.pool import GatewayPool
from gateway.siblings import socket_path
from stages.rings import GATEWAY
from stages.rundir import owned_temporary
from stages.supervisor import Supervisor

logger = logging.getLogger(__name__)


def vocoder_rate(supervisor: Supervisor) -> int:
    return int(supervisor.stage_info("vocoder")["sample_rate"])


async def serve(
    config: OmniConfig,
    supervisor: Supervisor,
    progress: Callable[[str], None],
    member: ClusterMember | None = None,
) -> None:
    """Serve until SIGINT or SIGTERM, then close every call (and stop the other gateway
    processes). `member`: this host's place among a cluster's gateway hosts."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with gateway_processes(config, supervisor, progress, member=member) as (base, _):
        processes = config.gateway.processes
        progress(
            f"gateway listening on {base}"
            + (f" ({processes} processes)" if processes > 1 else "")
            + " (Ctrl-C stops)"
        )
        await stop.wait()
        progress("stopping")


@contextlib.asynccontextmanager
async def gateway_processes(
    config: OmniConfig,
    supervisor: Supervisor,
    progress: Callable[[str], None],
    on_app: Callable[[web.Application], None] | None = None,
    member: ClusterMember | None = None,
) -> AsyncIterator[tuple[str, web.Application]]:
    """The gateway served in this process and, with `gateway.processes` > 1, in that many
    processes in all on the same port; yields (base URL, this process's app). `on_app` sees
    the app before it starts (loadtest.tap taps it); `member` makes every process one of
    a cluster's gateway hosts (gateway.hosts). Afterwards every call is closed and the other
    processes are stopped."""
    processes = config.gateway.processes
    if len(supervisor.names.gateways) != processes:
        raise ValueError(
            f"gateway.processes is {processes} but the supervisor made rings for "
            f"{len(supervisor.names.gateways)} (Supervisor(config, gateways=...))"
        )
    prepare_media(config)
    signing_key = secrets.token_bytes(32)
    with owned_temporary("omni-gateway-") as socket_dir:
        app = build_app(
            config,
            supervisor.names,
            vocoder_rate(supervisor),
            lambda: supervisor.healthy,
            instance=GATEWAY,
            socket_dir=socket_dir,
            signing_key=signing_key,
            member=member,
        )
        if on_app is not None:
            on_app(app)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        loop = asyncio.get_running_loop()
        pool = None
        try:
            host = config.gateway.host
            await web.TCPSite(runner, host, config.gateway.port, reuse_port=processes > 1).start()
            port = runner.addresses[0][1]  # the one bound, when the config says 0
            if member is not None:
                app[GATEWAY_KEY].public_url = f"http://{member.address}:{port}"
            if processes > 1:
                await web.UnixSite(runner, str(socket_path(socket_dir, GATEWAY))).start()
                bound = config.model_copy(
                    update={"gateway": config.gateway.model_copy(update={"port": port})}
                )

                def spec_for(instance: str) -> GatewayProcessSpec:
                    return GatewayProcessSpec(
                        instance,
                        bound.model_dump(),
                        supervisor.names,
                        vocoder_rate(supervisor),
                        str(socket_dir),
                        signing_key,
                        logging.getLogger().level,
                        member,
                    )

                pool = GatewayPool(supervisor, spec_for, progress)
                await loop.run_in_executor(None, pool.start)
            yield f"http://{host}:{port}", app
        finally:
            if pool is not None:
                await loop.run_in_executor(None, pool.stop)
            await runner.cleanup()
