"""Calls routed across gateway hosts, through `omni-gateway start` on a real multi-node Ray cluster
on this machine (a head and two raylets on their own loopback addresses, each advertising
`gateway`). The command is gateway host 0 and the driver (`cluster.gateway_hosts: 2`); Ray places
host 1, a whole pipeline of its own, on a raylet. Each host takes one call. A call offered to
host 0 when it is full is carried by host 1 (its signaling forwarded, signed; its media straight
to host 1's address), heard and answered there; a hang-up sent to host 0 reaches it; with both
full a call is refused. Host 1's node lost: host 0's call goes on, host 1 leaves the table, Ray
brings it up on the other raylet and the next call offered to host 0 is answered there. Ctrl-C
stops it all, leaving no process of the command and no segment behind."""

from __future__ import annotations

import asyncio
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gateway.client import RealtimeCall
from gateway.hosts import STALE_S
from gateway.ice import restrict_host_addresses
from shm import list_segments
from stages.loopback_cluster import LoopbackCluster
from stages.process_groups import kill_session
from tests.gateway.test_call_e2e import speech48k
from tests.test_cli import assert_session_gone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).parents[2]
NODES = ("127.0.0.2", "127.0.0.3")
SENTENCE = "what is the weather like today in paris"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    with LoopbackCluster() as cluster:
        for address in NODES:
            cluster.add_node(address, {"gateway": 1})
        yield cluster


def config_file(folder: Path, cluster: LoopbackCluster) -> Path:
    """configs/tiny.yaml, one call a host, and two gateway hosts on the cluster."""
    data = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    data["gateway"]["max_calls"] = 1
    data["cluster"] = {"address": cluster.address, "gateway_hosts": 2}
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def listening(proc: subprocess.Popen[str], seen: list[str]) -> tuple[str, threading.Thread]:
    """The command's base URL once it serves, and the thread that reads its output to the end
    (into `seen`): a pipe nobody reads fills, and the command's next log line blocks it."""
    served: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if "gateway listening on " in line:
                served.put(line.split("gateway listening on ", 1)[1].split()[0])
        served.put("")  # the command ended

    reader = threading.Thread(target=read, name="start-output", daemon=True)
    reader.start()
    try:
        base = served.get(timeout=300)
    except queue.Empty:
        base = ""
    assert base, "start never served:\n" + "".join(seen[-40:])
    return base, reader


async def table(base: str) -> dict[int, dict[str, Any]]:
    """The other hosts host 0 hears from, by index."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as http, http.get(f"{base}/health") as r:
        return {h["host"]: h for h in (await r.json())["hosts"]}


async def until_heard(base: str, want: dict[int, int], timeout: float) -> float:
    """Wait until host 0's table is `want` (host -> free slots); the seconds it took."""
    t0 = time.monotonic()
    while {h: v["free"] for h, v in (await table(base)).items() if v["ready"]} != want:
        assert time.monotonic() - t0 < timeout, f"host 0 hears {await table(base)}, not {want}"
        await asyncio.sleep(0.05)  # polling the gateway's /health
    return time.monotonic() - t0


async def host_1_address(base: str) -> str:
    return urllib.parse.urlsplit((await table(base))[1]["url"]).hostname or ""


async def answered(call: RealtimeCall, make_speech) -> None:
    """The call hears the caller and the agent's reply starts playing."""
    call.microphone.play(speech48k(make_speech(SENTENCE)))
    heard = await call.next_event(
        "conversation.item.input_audio_transcription.completed", timeout=60
    )
    assert heard["transcript"]
    await call.next_event("output_audio_buffer.started", timeout=60)


async def route_and_lose_host_1(base: str, cluster: LoopbackCluster, make_speech) -> None:
    calls: list[RealtimeCall] = []
    try:
        await until_heard(base, {1: 1}, timeout=30)
        here = await RealtimeCall.connect(base)  # equal room: taken here
        calls.append(here)
        assert here.call_id and here.call_id.startswith("rtc_h0g0_")
        there = await RealtimeCall.connect(base)  # full here: host 1 carries it
        calls.append(there)
        assert there.call_id and there.call_id.startswith("rtc_h1g0_")
        await there.next_event("session.created")
        await answered(there, make_speech)

        await until_heard(base, {1: 0}, timeout=10)
        with pytest.raises(ConnectionError, match="503"):
            await RealtimeCall.connect(base)

        async with (
            aiohttp.ClientSession() as http,
            http.delete(f"{base}/v1/realtime/calls/{there.call_id}") as r,
        ):
            assert r.status == 204, await r.text()  # sent to host 0, carried out by host 1
        await until_heard(base, {1: 1}, timeout=10)
        there = await RealtimeCall.connect(base)
        calls.append(there)
        assert there.call_id and there.call_id.startswith("rtc_h1g0_")

        lost = await host_1_address(base)
        assert lost in NODES
        cluster.kill_node(lost)  # raylet, actor, its stages and gateway: at once
        t0 = time.monotonic()
        await here.next_event("session.created")
        await answered(here, make_speech)  # host 0's call goes on
        forgotten = await until_heard(base, {}, timeout=STALE_S + 2)
        print(f"\nhost 1 out of host 0's table {time.monotonic() - t0:.1f} s after its loss")
        assert forgotten <= STALE_S + 2
        with pytest.raises(ConnectionError, match="503"):
            await RealtimeCall.connect(base)  # host 0 full, host 1 gone

        await until_heard(base, {1: 1}, timeout=240)
        print(f"host 1 back in the table {time.monotonic() - t0:.1f} s after its loss")
        moved = await host_1_address(base)
        assert moved != lost and moved in NODES
        again = await RealtimeCall.connect(base)
        calls.append(again)
        assert again.call_id and again.call_id.startswith("rtc_h1g0_")
        await again.next_event("session.created")
        await answered(again, make_speech)
    finally:
        for call in calls:
            await call.close()


def test_calls_go_to_the_host_with_room_and_outlive_another_host(
    cluster: LoopbackCluster, tmp_path: Path, make_speech
) -> None:
    before = set(list_segments())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "gateway.cli", "start", "--config"]
    proc = subprocess.Popen(
        [*command, str(config_file(tmp_path, cluster)), "--port", str(port)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    restrict_host_addresses(["127.0.0.1"])  # the callers' candidates
    seen: list[str] = []
    reader = None
    try:
        base, reader = listening(proc, seen)
        asyncio.run(route_and_lose_host_1(base, cluster, make_speech))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0
    finally:
        restrict_host_addresses(None)
        if proc.poll() is None:
            kill_session(proc.pid)
        proc.wait()
        if reader is not None:
            reader.join(10)  # at the end of the output
        assert proc.stderr is not None
        proc.stderr.close()
    assert_session_gone(proc.pid)
    assert set(list_segments()) == before  # the lost host's too: reaped by its successor
