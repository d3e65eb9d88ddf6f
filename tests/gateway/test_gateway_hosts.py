"""Calls routed across gateway hosts: a real multi-node Ray cluster on this machine (a head and
two raylets on their own loopback addresses, each advertising `gateway`). This process is
gateway host 0 and the driver; Ray places host 1, a whole pipeline of its own, on a raylet.
Each host takes one call. A call offered to host 0 when it is full is carried by host 1 (its
signaling forwarded, signed; its media straight to host 1's address), heard and answered
there; a hang-up sent to host 0 reaches it; with both full a call is refused. Host 1's node
lost: host 0's call goes on, host 1 leaves the table, Ray brings it up on the other raylet and
the next call offered to host 0 is answered there."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import ray

from gateway.client import RealtimeCall
from gateway.cluster import GatewayHosts
from gateway.config import OmniConfig
from gateway.hosts import STALE_S
from gateway.server import gateway_processes
from shm import list_segments
from stages.cluster import ClusterSupervisor
from stages.config import ClusterConfig
from stages.loopback_cluster import LoopbackCluster
from tests.gateway.test_call_e2e import speech48k
from tests.stages.conftest import tiny_with_long_replies

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

NODES = ("127.0.0.2", "127.0.0.3")
SENTENCE = "what is the weather like today in paris"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    with LoopbackCluster() as cluster:
        for address in NODES:
            cluster.add_node(address, {"gateway": 1})
        yield cluster


@pytest.fixture(scope="module")
def config(cluster: LoopbackCluster) -> OmniConfig:
    base = tiny_with_long_replies()
    gateway = base.gateway.model_copy(update={"port": 0, "max_calls": 1})
    placement = ClusterConfig(address=cluster.address, gateway_hosts=2)
    return base.model_copy(update={"gateway": gateway, "cluster": placement})


@pytest.fixture(scope="module")
def driver(config: OmniConfig) -> Iterator[tuple[ClusterSupervisor, GatewayHosts]]:
    assert config.cluster is not None
    hosts = GatewayHosts(config, config.cluster)
    supervisor = ClusterSupervisor(config, config.cluster, place_also=hosts.place)
    prefixes = {supervisor.names.prefix}
    with supervisor:
        try:
            supervisor.start()  # host 1 starts on its node meanwhile
            hosts.wait(print)
            yield supervisor, hosts
        finally:
            prefixes |= {p.ready["prefix"] for p in hosts.placed if "prefix" in p.ready}
            hosts.stop()
    left = [s for s in list_segments() if any(p in s for p in prefixes)]
    assert not left, f"segments left behind: {left}"


async def table(base: str) -> dict[int, dict[str, Any]]:
    """The other hosts host 0 hears from, by index."""
    async with aiohttp.ClientSession() as http, http.get(f"{base}/health") as r:
        return {h["host"]: h for h in (await r.json())["hosts"]}


async def until_heard(base: str, want: dict[int, int], timeout: float) -> float:
    """Wait until host 0's table is `want` (host -> free slots); the seconds it took."""
    t0 = time.monotonic()
    while {h: v["free"] for h, v in (await table(base)).items() if v["ready"]} != want:
        assert time.monotonic() - t0 < timeout, f"host 0 hears {await table(base)}, not {want}"
        await asyncio.sleep(0.05)  # polling the gateway's /health
    return time.monotonic() - t0


async def answered(call: RealtimeCall, make_speech) -> None:
    """The call hears the caller and the agent's reply starts playing."""
    call.microphone.play(speech48k(make_speech(SENTENCE)))
    heard = await call.next_event(
        "conversation.item.input_audio_transcription.completed", timeout=60
    )
    assert heard["transcript"]
    await call.next_event("output_audio_buffer.started", timeout=60)


@pytest.mark.asyncio(loop_scope="module")
async def test_calls_go_to_the_host_with_room_and_outlive_another_host(
    cluster: LoopbackCluster,
    config: OmniConfig,
    driver: tuple[ClusterSupervisor, GatewayHosts],
    make_speech,
) -> None:
    supervisor, hosts = driver
    calls: list[RealtimeCall] = []
    async with gateway_processes(config, supervisor, print, member=hosts.member) as (base, _):
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

            lost = ray.get(hosts.placed[0].actor.ready.remote())["address"]
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
            moved = ray.get(hosts.placed[0].actor.ready.remote())
            assert moved["address"] != lost and moved["address"] in NODES
            hosts.placed[0].ready = moved  # its segments are checked at the end
            again = await RealtimeCall.connect(base)
            calls.append(again)
            assert again.call_id and again.call_id.startswith("rtc_h1g0_")
            await again.next_event("session.created")
            await answered(again, make_speech)
        finally:
            for call in calls:
                await call.close()
