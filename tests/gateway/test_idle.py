"""gateway.turns.idle: the idle timeout of server_vad, armed, fired and disarmed."""

from __future__ import annotations

import asyncio

from gateway.protocol import TurnDetection
from gateway.turns.idle import IdleTimer


def detection(type: str = "server_vad", idle_timeout_ms: int | None = 1) -> TurnDetection:
    return TurnDetection(type=type, idle_timeout_ms=idle_timeout_ms)


async def test_it_fires_once_counting_from_when_the_reply_was_heard() -> None:
    fired: asyncio.Queue[int] = asyncio.Queue()
    timer = IdleTimer(fired.put_nowait)
    timer.arm(detection(), audio_ms=4000, after_s=0.5)  # the reply plays 0.5 s more
    assert timer.armed
    assert await asyncio.wait_for(fired.get(), 5) == 4500
    assert not timer.armed and fired.empty()


async def test_only_server_vad_with_a_timeout_arms_it_and_disarming_stops_it() -> None:
    fired: list[int] = []
    timer = IdleTimer(fired.append)
    for none in (None, detection(type="semantic_vad"), detection(idle_timeout_ms=None)):
        timer.arm(none, audio_ms=0)
        assert not timer.armed
    timer.arm(detection(idle_timeout_ms=60_000), audio_ms=0)
    assert timer.armed
    timer.disarm()
    assert not timer.armed and not fired
