"""A call's signaling taken on the host it reached against forwarded to another gateway host.

Run: python -m loadtest.routing_bench [--config configs/tiny.yaml] [--calls 20] [--json FILE]

A real multi-node Ray cluster on this machine (stages.loopback_cluster): this process is gateway
host 0 and the driver; Ray places gateway host 1, a whole pipeline of its own, on a raylet on
127.0.0.2 (gateway.cluster). Each host takes one call (`gateway.max_calls: 1`), so where a new
call goes is decided by the load table (gateway.hosts), and the two kinds alternate, `--calls`
of each, in one run:
- `here`: host 0 is free: the offer (`POST /v1/realtime/calls`, an aiortc peer's SDP) is
  answered by host 0 itself, and the hang-up (`DELETE`) too;
- `forwarded`: host 0 holds a call: the same offer sent to host 0 is forwarded, signed, to
  host 1, which answers it; the hang-up sent to host 0 follows the call id to host 1.
Also timed: how long host 0's table takes to hear that host 1 took a call (from the answer) and
that it is free again (from the hang-up): host 1's load is published on change, looked at every
50 ms, through the exchange.
Times are the client's, from sending the request to reading the whole answer. Prints a table,
then JSON; one machine, its loopback for the network: what forwarding adds on a LAN is the same
path plus the LAN's round trip.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.cluster_bench import log, summary
from loadtest.ring_bench import machine

ROOT = Path(__file__).parents[1]
NODE = "127.0.0.2"


async def offer_sdp() -> tuple[Any, str]:
    """A caller's peer connection and its SDP offer (made before the clock starts)."""
    from aiortc import RTCPeerConnection

    from gateway.client import Microphone

    pc = RTCPeerConnection()
    pc.createDataChannel("oai-events")
    pc.addTrack(Microphone())
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


async def offer(http: aiohttp.ClientSession, base: str) -> tuple[str, float, Any]:
    """(call id, ms to the answer, the caller's peer connection)."""
    pc, sdp = await offer_sdp()
    t0 = time.perf_counter()
    async with http.post(
        f"{base}/v1/realtime/calls", data=sdp, headers={"Content-Type": "application/sdp"}
    ) as r:
        await r.read()
        ms = (time.perf_counter() - t0) * 1e3
        if r.status != 201:
            await pc.close()
            raise RuntimeError(f"the offer got {r.status}: {await r.text()}")
        return r.headers["Location"].rsplit("/", 1)[-1], ms, pc


async def hang_up(http: aiohttp.ClientSession, base: str, call_id: str, pc: Any) -> float:
    t0 = time.perf_counter()
    async with http.delete(f"{base}/v1/realtime/calls/{call_id}") as r:
        await r.read()
        ms = (time.perf_counter() - t0) * 1e3
        if r.status != 204:
            raise RuntimeError(f"the hang-up of {call_id} got {r.status}: {await r.text()}")
    await pc.close()
    return ms


async def host_1_has(
    http: aiohttp.ClientSession, base: str, free: int, timeout: float = 10
) -> float:
    """ms until host 0's table says host 1 has `free` slots, ready (polled every 2 ms)."""
    t0 = time.perf_counter()
    while True:
        async with http.get(f"{base}/health") as r:
            hosts = {h["host"]: h for h in (await r.json()).get("hosts", [])}
        if hosts.get(1, {}).get("free") == free and hosts[1]["ready"]:
            return (time.perf_counter() - t0) * 1e3
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"host 0 does not hear host 1 with {free} free: {hosts}")
        await asyncio.sleep(0.002)  # polling the gateway's /health


async def measure(base: str, calls: int) -> dict[str, Any]:
    raw: dict[str, list[float]] = {
        "offer_here": [], "offer_forwarded": [], "hang_up_here": [], "hang_up_forwarded": [],
        "table_hears_taken": [], "table_hears_free": [],
    }  # fmt: skip
    async with aiohttp.ClientSession() as http:
        await host_1_has(http, base, 1, timeout=60)
        for i in range(calls):
            call, ms, pc = await offer(http, base)
            if not call.startswith("rtc_h0"):
                raise RuntimeError(f"host 0 is free, yet {call} went elsewhere")
            raw["offer_here"].append(ms)
            holder = (call, pc)  # keeps host 0 full for the forwarded one
            call, ms, pc = await offer(http, base)
            if not call.startswith("rtc_h1"):
                raise RuntimeError(f"host 0 is full, yet {call} stayed")
            raw["offer_forwarded"].append(ms)
            raw["table_hears_taken"].append(await host_1_has(http, base, 0))
            raw["hang_up_forwarded"].append(await hang_up(http, base, call, pc))
            raw["table_hears_free"].append(await host_1_has(http, base, 1))
            raw["hang_up_here"].append(await hang_up(http, base, *holder))
            log(f"call {i + 1}/{calls}")
    return {name: summary(values) for name, values in raw.items()}


def table(figures: dict[str, Any]) -> str:
    rows = [
        ("offer to answer, taken by the host it reached", "offer_here"),
        ("offer to answer, forwarded to the other host", "offer_forwarded"),
        ("hang-up, the host it reached", "hang_up_here"),
        ("hang-up, forwarded to the call's host", "hang_up_forwarded"),
        ("host 1's call answered -> host 0's table says it is full", "table_hears_taken"),
        ("host 1's call hung up -> host 0's table says it is free", "table_hears_free"),
    ]
    lines = ["| ms | p50 | p95 | max | n |", "|---|---:|---:|---:|---:|"]
    for label, key in rows:
        f = figures[key]
        lines.append(f"| {label} | {f.get('p50')} | {f.get('p95')} | {f.get('max')} | {f['n']} |")
    return "\n".join(lines)


async def serve_and_measure(config: Any, calls: int) -> dict[str, Any]:
    from gateway.cluster import GatewayHosts
    from gateway.server import gateway_processes
    from stages.cluster import ClusterSupervisor

    hosts = GatewayHosts(config, config.cluster)
    supervisor = ClusterSupervisor(config, config.cluster, place_also=hosts.place)
    loop = asyncio.get_running_loop()
    with supervisor:
        try:
            await loop.run_in_executor(None, supervisor.start, log)
            await loop.run_in_executor(None, hosts.wait, log)
            async with gateway_processes(config, supervisor, log, member=hosts.member) as (
                base,
                _,
            ):
                return await measure(base, calls)
        finally:
            await loop.run_in_executor(None, hosts.stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny.yaml")
    parser.add_argument("--calls", type=int, default=20, help="of each kind")
    parser.add_argument("--json", type=Path, help="also write the JSON report here")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error("--calls: at least 1")

    from gateway.config import load_config
    from stages.config import ClusterConfig
    from stages.loopback_cluster import LoopbackCluster

    with LoopbackCluster() as cluster:
        cluster.add_node(NODE, {"gateway": 1})
        log(f"Ray cluster at {cluster.address}: nodes {', '.join(cluster.alive_nodes())}")
        config = load_config(args.config, {"gateway.port": 0, "gateway.max_calls": 1})
        config = config.model_copy(
            update={"cluster": ClusterConfig(address=cluster.address, gateway_hosts=2)}
        )
        figures = asyncio.run(serve_and_measure(config, args.calls))
    report = {
        "benchmark": "routing_bench",
        "command": "python -m loadtest.routing_bench " + " ".join(argv or sys.argv[1:]),
        "machine": machine(),
        "config": str(args.config.resolve().relative_to(ROOT))
        if args.config.resolve().is_relative_to(ROOT)
        else args.config.name,
        "calls": args.calls,
        "ms": figures,
    }
    print(table(figures))
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
