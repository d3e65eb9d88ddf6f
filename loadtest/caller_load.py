"""A load of conversing callers (loadtest.conversation over WebRTC, loadtest.ws_callers over
the WebSocket Realtime API) in spawned processes of their own, so that the gateway under test
does not share their event loop."""

from __future__ import annotations

import asyncio
import math
import multiprocessing as mp
import time
from typing import Any

import numpy as np

from loadtest.bench import log

CALLERS_PER_PROCESS = 8
#: how callers reach the gateway: WebRTC (/v1/realtime/calls), or the WebSocket Realtime API
TRANSPORTS = ("webrtc", "websocket")


def _callers_process(
    base: str, n: int, speech: Any, turns: int, seed: int, opus: str, transport: str, conn
) -> None:
    if transport == "websocket":
        from loadtest.ws_callers import run_ws_conversations

        conn.send(run_ws_conversations(base, n, speech, turns, seed=seed))
        return
    from loadtest.conversation import run_conversations

    conn.send(run_conversations(base, n, speech, turns, seed=seed, opus=opus))


async def run_callers(
    base: str,
    n: int,
    speech: np.ndarray | list[np.ndarray],
    turns: int,
    opus: str = "opuslib",
    per_process: int = CALLERS_PER_PROCESS,
    transport: str = "webrtc",
) -> list[dict[str, Any]]:
    """`n` conversations from processes of `per_process` callers each, over `transport`
    (TRANSPORTS), WebRTC's coding Opus with `opus` (the gateway's codec setting)."""
    ctx = mp.get_context("spawn")
    procs = []
    for i in range(math.ceil(n / per_process)):
        k = min(per_process, n - i * per_process)
        parent, child = ctx.Pipe(duplex=False)
        caller_args = (base, k, speech, turns, i, opus, transport, child)
        proc = ctx.Process(target=_callers_process, args=caller_args)
        proc.start()
        child.close()
        procs.append((proc, parent))
    reports: list[dict[str, Any]] = []
    budget = 60 + turns * 45
    deadline = time.monotonic() + budget  # one deadline for all: the processes run at once
    try:
        for _, parent in procs:
            if await asyncio.to_thread(parent.poll, max(0.0, deadline - time.monotonic())):
                reports.extend(parent.recv())
            else:
                log(f"a callers' process sent no report within {budget} s")
    finally:
        for proc, _ in procs:
            await asyncio.to_thread(proc.join, 30)
            if proc.is_alive():
                proc.kill()
    return reports
