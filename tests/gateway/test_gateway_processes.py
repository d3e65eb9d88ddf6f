"""Several gateway processes on one port (`gateway.processes: 2`), as `omni-gateway start` runs
them: real processes, aiortc callers over 127.0.0.1, the offline stages on real rings.

New calls spread over the processes, both are answered, the metrics add up over them, and a
gateway process killed outright takes only its own call: its session is closed in the stages,
it is restarted, and the other call goes on.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

import shm
from gateway.client import RealtimeCall
from gateway.ice import restrict_host_addresses
from gateway.siblings import gateway_of_call
from loadtest.service import Service
from tests.gateway.test_call_e2e import speech48k
from tests.serving import metric
from tests.test_cli import assert_session_gone, write_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    before = set(shm.list_segments())
    config = write_config(
        tmp_path,
        gateway__processes=2,
        # short replies: each of the four calls hears its reply to the end
        reasoning__sampling={"max_tokens": 16, "ignore_eos": True},
    )
    service = Service(config)
    try:
        yield service
    finally:
        stopped = service.proc.poll() is not None  # by the test's own Ctrl-C
        service.kill()
        assert_session_gone(service.proc.pid)  # stages and gateway processes included
        if not stopped:
            # a failed test's service is killed outright, a crash as far as its segments go:
            # reaped as the next start reaps them, and its log shown beside the failure
            shm.reap_stale()
            print(f"the service's log, its end:\n{service.log_tail()}")
    assert set(shm.list_segments()) == before


async def answered(call: RealtimeCall, speech) -> None:
    """The caller speaks; the agent's spoken reply is played to the end."""
    call.microphone.play(speech)
    await call.next_event("input_audio_buffer.speech_stopped", timeout=30)
    done = await call.next_event("response.done", timeout=90)
    assert done["response"]["status"] == "completed"
    await call.next_event("output_audio_buffer.stopped", timeout=90)


def test_calls_spread_over_processes_and_survive_one_dying(service, make_speech) -> None:
    base, pids = service.started(timeout=300)
    worker_pid = pids["gateway.1"]
    speech = speech48k(make_speech("what is the weather like today in paris"))
    restrict_host_addresses(["127.0.0.1"])
    try:
        asyncio.run(_spread_then_kill(service, base, worker_pid, speech))
    finally:
        restrict_host_addresses(None)
    assert service.stop() == 0


async def _spread_then_kill(service: Service, base: str, worker_pid: int, speech) -> None:
    # the second call goes to the process without one, wherever the kernel sent it
    first = await RealtimeCall.connect(base)
    second = await RealtimeCall.connect(base)
    calls = {gateway_of_call(c.call_id): c for c in (first, second)}
    try:
        assert set(calls) == {0, 1}
        await asyncio.gather(*(answered(c, speech) for c in calls.values()))
        assert await metric(base, "omni_sessions") == 2  # summed over both processes

        os.kill(worker_pid, signal.SIGKILL)
        closed = service.wait_for(r"gateway\.1 \(pid \d+\) died .* closed its (\d+) session", 30)
        assert closed[1] == "1"  # its call, in every stage; not the other process's
        service.wait_for(r"gateway\.1 listening", 60)
        await answered(calls[0], speech)  # the other call goes on
        assert await metric(base, "omni_sessions") == 1

        third = await RealtimeCall.connect(base)  # the restarted process has room
        try:
            assert gateway_of_call(third.call_id) == 1
            await answered(third, speech)
        finally:
            await third.close()
        # a hang-up reaches the call's process wherever the kernel sends it
        async with aiohttp.ClientSession() as http:
            for call_id in (calls[0].call_id, "rtc_g1_00000000"):
                async with http.delete(f"{base}/v1/realtime/calls/{call_id}") as resp:
                    assert resp.status == (204 if call_id == calls[0].call_id else 404)
    finally:
        for call in calls.values():
            await call.close()
