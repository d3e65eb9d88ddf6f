"""Each stage process, and vLLM's engine core, SIGKILLed under a live reply of a served
gateway (the real stages on the tiny models): the call gets an `error` and a `response.done`
that failed, /health says not ready until the stage is back, nothing of the dead process is
left running, and the same call's next turn succeeds. Killing `omni-gateway start` itself is
tests/test_cli.py's."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from gateway.config import load_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def config():
    # long replies, so that one is always in flight when its stage is killed
    return load_config(
        TINY,
        {"reasoning.sampling": {"max_tokens": 160, "ignore_eos": True}, "gateway.port": 0},
    )


class Session:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws

    async def send(self, event: dict[str, Any]) -> None:
        await self.ws.send_str(json.dumps(event))

    async def next(self, *types: str, timeout: float = 60) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                msg = await self.ws.receive()
                assert msg.type is aiohttp.WSMsgType.TEXT, f"connection dropped: {msg}"
                event = json.loads(msg.data)
                if event["type"] in types:
                    return event


async def health_until(http: aiohttp.ClientSession, base: str, status: int, within_s: float):
    """When /health first answers `status`, polling it (a probe, as a load balancer does)."""
    deadline = time.monotonic() + within_s
    while True:
        async with http.get(f"{base}/health") as r:
            if r.status == status:
                return time.monotonic()
        assert time.monotonic() < deadline, f"/health never answered {status}"
        await asyncio.sleep(0.02)


def processes_of(pid: int) -> list[psutil.Process]:
    stage = psutil.Process(pid)
    return [stage, *stage.children(recursive=True)]


async def kill_under_a_live_reply(server, supervisor, restarted, role: str, victim) -> None:
    base, _ = server
    stage = supervisor.stages[role]
    restarts = stage.restarts
    async with aiohttp.ClientSession() as http:
        ws = await http.ws_connect(f"{base.replace('http', 'ws')}/v1/realtime?model=m")
        session = Session(ws)
        await session.next("session.created")
        await session.send({"type": "response.create"})
        await session.next("response.output_audio.delta")
        old = processes_of(stage.process.pid)
        restarted.clear()
        victim(old).kill()
        killed = time.monotonic()

        error = (await session.next("error"))["error"]
        assert error["code"] in ("stage_restarted", "engine_dead"), error
        done = (await session.next("response.done"))["response"]
        assert done["status"] == "failed", done
        unready = await health_until(http, base, 503, 10)
        ready = await health_until(http, base, 200, 120)
        assert restarted.wait(5) and stage.restarts == restarts + 1
        _, alive = psutil.wait_procs(old, timeout=30)
        assert not alive, f"left running: {[(p.pid, p.name()) for p in alive]}"

        # the same call goes on: a spoken reply, start to end
        await session.send({"type": "response.create"})
        done = (await session.next("response.done", timeout=120))["response"]
        assert done["status"] == "completed", done
        await ws.close()
    print(
        f"\n{role}: /health unready {unready - killed:.2f} s after the kill, ready again "
        f"after {ready - killed:.1f} s"
    )


async def test_the_vocoder_killed(server, supervisor, restarted) -> None:
    await kill_under_a_live_reply(server, supervisor, restarted, "vocoder", lambda ps: ps[0])


async def test_the_encoder_killed(server, supervisor, restarted) -> None:
    await kill_under_a_live_reply(server, supervisor, restarted, "encoder", lambda ps: ps[0])


def engine_core(processes: list[psutil.Process]) -> psutil.Process:
    (core,) = [p for p in processes[1:] if "EngineCore" in " ".join(p.cmdline())]
    return core


async def test_vllms_engine_core_killed(server, supervisor, restarted) -> None:
    await kill_under_a_live_reply(server, supervisor, restarted, "reasoning", engine_core)


async def test_the_reasoning_stage_killed(server, supervisor, restarted) -> None:
    """Its engine core and worker outlive it, in its process group: the supervisor ends them."""
    await kill_under_a_live_reply(server, supervisor, restarted, "reasoning", lambda ps: ps[0])
