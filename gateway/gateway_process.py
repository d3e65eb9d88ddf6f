"""The entry point of a gateway process after the first (`gateway.processes`): serve the
public port beside the first process, on its own rings, until SIGTERM or until
`omni-gateway start` is gone. gateway.pool starts and watches these processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from aiohttp import web

from gateway.app import GATEWAY_KEY, build_app
from gateway.config import OmniConfig
from gateway.hosts import ClusterMember
from gateway.media import prepare_media
from gateway.siblings import socket_path
from stages.rings import RingNames

PARENT_CHECK_S = 0.5  # how often a gateway process checks that `omni-gateway start` lives


@dataclass(frozen=True)
class GatewayProcessSpec:
    """What a gateway process is started with (picklable for spawn)."""

    instance: str  # 'gateway.1', ...
    config: dict[str, Any]  # OmniConfig, dumped; gateway.port is the port actually bound
    names: RingNames
    vocoder_rate: int
    socket_dir: str
    signing_key: bytes
    log_level: int
    member: ClusterMember | None = None  # one of a cluster's gateway hosts


def gateway_process_main(spec: GatewayProcessSpec, ready: Any, conn: Connection) -> None:
    """Entry point of a gateway process after the first: serve until SIGTERM (or until
    `omni-gateway start` is gone)."""
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s {spec.instance} %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    # Ctrl-C reaches the whole process group; the first process stops this one with SIGTERM
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = OmniConfig.model_validate(spec.config)
    asyncio.run(_serve_process(spec, config, lambda: bool(ready.value), conn))


async def _serve_process(
    spec: GatewayProcessSpec, config: OmniConfig, is_ready: Callable[[], bool], conn: Connection
) -> None:
    prepare_media(config)
    app = build_app(
        config,
        spec.names,
        spec.vocoder_rate,
        is_ready,
        instance=spec.instance,
        socket_dir=spec.socket_dir,
        signing_key=spec.signing_key,
        member=spec.member,
    )
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    parent = os.getppid()
    try:
        host, port = config.gateway.host, config.gateway.port
        await web.TCPSite(runner, host, port, reuse_port=True).start()
        if spec.member is not None:
            app[GATEWAY_KEY].public_url = f"http://{spec.member.address}:{port}"
        await web.UnixSite(runner, str(socket_path(spec.socket_dir, spec.instance))).start()
        conn.send({"pid": os.getpid()})
        conn.close()
        # killed outright, `omni-gateway start` cannot stop us: notice being re-parented
        while not stop.is_set() and os.getppid() == parent:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PARENT_CHECK_S)
    finally:
        await runner.cleanup()
