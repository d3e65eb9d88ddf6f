"""One-way latency and throughput of the shm ring against the usual Python IPC peers.

Run: python -m loadtest.ring_bench [--latency-count N] [--rounds R] [--json FILE]

Every transport runs in the same invocation with the same two processes: a producer and a
consumer that blocks in its receive call (never spins). Latency: the producer sends one record
every --interval-us and stamps CLOCK_MONOTONIC into the payload; the consumer subtracts it
from its own clock on receipt. Throughput: the producer sends as fast as the transport takes.
Idle CPU: the consumer waits one second with nothing sent. The transports take turns
(--rounds), and each one's percentiles are over all its rounds' samples: a noisy spell of a
small VM falls on all of them rather than on whichever ran then. Prints a table, then JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import platform
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import numpy as np

STAMP = struct.Struct("<Q")
SIZES = {"chunk_6400B": 6400, "token_16B": 16}
RECV_TIMEOUT_S = 10.0

Send = Callable[[bytes], None]
Recv = Callable[[float], bytes | None]


# ---- transports: each gives (send, recv) in the child processes, from a picklable spec ----


@dataclass
class Channel:
    """One of the compared transports, as the child processes rebuild it from `spec`."""

    name: str
    spec: Any
    cleanup: Callable[[], None] = lambda: None


def make_transport(name: str, tmpdir: str) -> Channel:
    if name in ("omni_ring", "omni_ring_yield"):
        from shm import Control, Ring, segment_name

        control = Control.create(segment_name("bench-ctl"), 4)
        ring = Ring.create(segment_name("bench"), 1 << 21, control=control)

        def close() -> None:
            ring.close()
            control.close()

        return Channel(name, (ring.name, control.name), close)
    if name == "mp_queue":
        return Channel(name, mp.get_context("spawn").Queue())
    if name == "mp_pipe":
        return Channel(name, mp.get_context("spawn").Pipe(duplex=False))
    if name == "faster_fifo":
        from faster_fifo import Queue

        return Channel(name, Queue(max_size_bytes=1 << 24))
    if name == "zmq_ipc":
        return Channel(name, f"ipc://{tempfile.mkdtemp(dir=tmpdir)}/bench.sock")
    if name == "zmq_tcp":
        return Channel(name, f"tcp://{FAR_HOST}:{_free_port(FAR_HOST)}")
    if name == "omni_bridged":
        return _bridged()
    raise ValueError(f"unknown transport {name!r}")


FAR_HOST = "127.0.0.2"  # a crossing link's far end: another address of the loopback


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _bridged() -> Channel:
    """A crossing link as stages.bridge makes one: the producer's ring on this "host", a
    RingToWire process popping it, TCP to 127.0.0.2, a WireToRing process pushing into the
    consumer's ring with a mirror control. Four processes, as on two hosts."""
    from shm import Control, Ring, segment_name

    ctx = mp.get_context("spawn")
    control = Control.create(segment_name("bench-ctl"), 4)
    mirror = Control.create(segment_name("bench-mirror"), 4)
    near = Ring.create(segment_name("bench-near"), 1 << 21, control=control)
    far = Ring.create(segment_name("bench-far"), 1 << 21, control=mirror)
    endpoint_r, endpoint_w = ctx.Pipe(duplex=False)
    receiver = ctx.Process(
        target=_wire_to_ring, args=(far.name, mirror.name, endpoint_w), name="wire-to-ring"
    )
    receiver.start()
    if not endpoint_r.poll(30):
        receiver.kill()
        raise RuntimeError("the WireToRing process did not come up")
    endpoint = endpoint_r.recv()
    sender = ctx.Process(
        target=_ring_to_wire, args=(near.name, control.name, endpoint), name="ring-to-wire"
    )
    sender.start()

    def close() -> None:
        for p in (sender, receiver):
            p.terminate()
            p.join(10)
            if p.is_alive():
                p.kill()
        for segment in (near, far, control, mirror):
            segment.close()

    return Channel("omni_bridged", (near.name, far.name, control.name, mirror.name), close)


def _ring_to_wire(ring_name: str, control_name: str, endpoint: str) -> None:
    import signal
    import threading

    from shm import Control, Ring
    from stages.bridge import RingToWire

    ring = Ring.attach(ring_name, Control.attach(control_name), role="consumer")
    sender = RingToWire(ring, endpoint, link="bench", incarnation="bench", hwm=0)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    sender.start()
    stop.wait()
    sender.stop()


def _wire_to_ring(ring_name: str, mirror_name: str, endpoint_w: Any) -> None:
    import signal
    import threading

    from shm import Control, Ring
    from stages.bridge import WireToRing

    mirror = Control.attach(mirror_name)
    ring = Ring.attach(ring_name, mirror, role="producer")
    receiver = WireToRing(
        ring, FAR_HOST, link="bench", control=mirror, hwm=0, on_down=lambda reason: None
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    receiver.start()
    endpoint_w.send(receiver.endpoint)
    stop.wait()
    receiver.stop()


def open_end(name: str, spec: Any, role: str) -> tuple[Send | None, Recv | None, Callable]:
    """The sending or receiving end of a transport, opened inside a worker process."""
    if name in ("omni_ring", "omni_ring_yield", "omni_bridged"):
        from shm import Control, Ring

        if name == "omni_bridged":  # the producer's ring near, the consumer's far
            near, far, control_name, mirror_name = spec
            spec = (near, control_name) if role == "producer" else (far, mirror_name)
        control = Control.attach(spec[1])
        ring = Ring.attach(spec[0], control, role=role)
        ring.wake_yield = name == "omni_ring_yield"  # the producer's end is the one it changes

        def send(b: bytes) -> None:
            ring.push(b, session=0, kind=1, timeout=RECV_TIMEOUT_S)

        def recv(timeout: float) -> bytes | None:
            rec = ring.pop(timeout)
            return None if rec is None else rec.payload

        return send, recv, lambda: (ring.close(), control.close())
    if name in ("mp_queue", "faster_fifo"):
        import queue

        q = spec

        def recv_q(timeout: float) -> bytes | None:
            try:
                return q.get(timeout=timeout)
            except queue.Empty:
                return None

        return q.put, recv_q, lambda: None
    if name == "mp_pipe":
        reader, writer = spec

        def recv_p(timeout: float) -> bytes | None:
            return reader.recv_bytes() if reader.poll(timeout) else None

        return writer.send_bytes, recv_p, lambda: None
    if name in ("zmq_ipc", "zmq_tcp"):
        import zmq

        zctx = zmq.Context()
        # unbounded queues: at the default high-water mark of 1,000, libzmq 4.3.5 was seen
        # here dropping thousands of 16-byte records between this PUSH/PULL pair
        zctx.setsockopt(zmq.SNDHWM, 0)
        zctx.setsockopt(zmq.RCVHWM, 0)
        if role == "consumer":
            sock = zctx.socket(zmq.PULL)
            sock.bind(spec)
        else:
            sock = zctx.socket(zmq.PUSH)
            sock.connect(spec)

        def recv_z(timeout: float) -> bytes | None:
            ms = int(timeout * 1000)
            if sock.getsockopt(zmq.RCVTIMEO) != ms:
                sock.setsockopt(zmq.RCVTIMEO, ms)
            try:
                return sock.recv()
            except zmq.Again:
                return None

        # linger -1: a PUSH socket closed early would otherwise drop what is still queued
        return sock.send, recv_z, lambda: (sock.close(linger=-1), zctx.term())
    raise ValueError(name)


# ---- the two worker processes ----


def consumer(name: str, spec: Any, plan: dict, ready: Any, results: Any) -> None:
    _, recv, close = open_end(name, spec, "consumer")
    ready.set()
    out: dict[str, Any] = {}
    t0 = time.process_time()
    assert recv(1.0) is None  # idle: nothing is sent for this second
    out["idle_cpu_ms"] = (time.process_time() - t0) * 1e3
    latencies = np.empty(plan["latency_count"], dtype=np.int64)
    for i in range(plan["latency_count"]):
        b = recv(RECV_TIMEOUT_S)
        latencies[i] = time.monotonic_ns() - STAMP.unpack_from(b)[0]
    out["latency_ns"] = latencies.tolist()
    n = plan["throughput_count"]
    first = recv(RECV_TIMEOUT_S)
    t_start = STAMP.unpack_from(first)[0]
    received = len(first)
    for _ in range(n - 1):
        received += len(recv(RECV_TIMEOUT_S))
    elapsed = (time.monotonic_ns() - t_start) / 1e9
    out["throughput"] = {"records": n, "seconds": elapsed, "bytes": received}
    results.send(out)
    close()


def producer(name: str, spec: Any, plan: dict, ready: Any) -> None:
    send, _, close = open_end(name, spec, "producer")
    assert ready.wait(30)
    time.sleep(1.2)  # the consumer's idle second
    filler = b"\0" * (plan["size"] - STAMP.size)
    interval = plan["interval_us"] / 1e6
    for _ in range(plan["latency_count"]):
        send(STAMP.pack(time.monotonic_ns()) + filler)
        time.sleep(interval)
    payload = STAMP.pack(time.monotonic_ns()) + filler
    for _ in range(plan["throughput_count"]):
        send(payload)
    close()


def run_case(
    name: str, size: int, latency_count: int, args: argparse.Namespace, tmpdir: str
) -> dict[str, Any]:
    """One producer and one consumer over transport `name`: their raw figures."""
    ctx = mp.get_context("spawn")
    transport = make_transport(name, tmpdir)
    tput = args.throughput_count if size > 1000 else args.throughput_count * 5
    plan = {
        "size": size,
        "latency_count": latency_count,
        "throughput_count": tput,
        "interval_us": args.interval_us,
    }
    ready = ctx.Event()
    results_r, results_w = ctx.Pipe(duplex=False)
    cons = ctx.Process(
        target=consumer,
        args=(name, transport.spec, plan, ready, results_w),
        name=f"{name}-consumer",
    )
    prod = ctx.Process(
        target=producer, args=(name, transport.spec, plan, ready), name=f"{name}-producer"
    )
    cons.start()
    prod.start()
    try:
        deadline = latency_count * args.interval_us / 1e6 + 120
        mp.connection.wait([results_r, cons.sentinel], timeout=deadline)
        if not results_r.poll():
            raise RuntimeError(
                f"{name} {size} B: the consumer ended without a result (exit code {cons.exitcode})"
            )
        return results_r.recv()
    finally:
        for p in (prod, cons):
            p.join(10)
            if p.is_alive():
                p.kill()
        transport.cleanup()


def summarize(name: str, size: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One transport's rounds as one result: latency percentiles over every sample of every
    round (and each round's p99, to show the spread), the median round's throughput, the
    worst round's idle CPU."""
    rounds_us = [np.asarray(r["latency_ns"]) / 1e3 for r in runs]
    lat_us = np.concatenate(rounds_us)
    rates = [r["throughput"]["records"] / r["throughput"]["seconds"] for r in runs]
    gbs = [r["throughput"]["bytes"] / r["throughput"]["seconds"] / 1e9 for r in runs]
    return {
        "transport": name,
        "payload_bytes": size,
        "latency_us": {
            "p50": float(np.percentile(lat_us, 50)),
            "p99": float(np.percentile(lat_us, 99)),
            "p99_9": float(np.percentile(lat_us, 99.9)),
            "max": float(lat_us.max()),
            "samples": int(lat_us.size),
            "p99_by_round": [float(np.percentile(r, 99)) for r in rounds_us],
        },
        "records_per_s": float(np.median(rates)),
        "gb_per_s": float(np.median(gbs)),
        "idle_consumer_cpu_ms_per_s": max(r["idle_cpu_ms"] for r in runs),
    }


def machine() -> dict[str, Any]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass

    def ver(pkg: str) -> str | None:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": {p: ver(p) for p in ("omni-gateway", "numpy", "faster-fifo", "pyzmq")},
    }


# omni_ring_yield: the ring whose producer yields its CPU to the consumer it wakes (wake_yield);
# zmq_tcp and omni_bridged: a crossing link between hosts (docs/scaling.md), the wire alone and
# ring to ring through stages.bridge, to 127.0.0.2
TRANSPORTS = ["omni_ring", "omni_ring_yield", "mp_queue", "mp_pipe", "faster_fifo", "zmq_ipc"]
CROSSING = ["zmq_tcp", "omni_bridged"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-count", type=int, default=3000)
    parser.add_argument(
        "--throughput-count",
        type=int,
        default=20000,
        help="records for 6,400-byte chunks (5x as many 16-byte records)",
    )
    parser.add_argument(
        "--interval-us",
        type=int,
        default=500,
        help="gap between latency samples, so the consumer is asleep for each",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="the transports take turns this many times, each with its share of the latency"
        " records, so that a noisy spell of the machine falls on all of them alike",
    )
    parser.add_argument(
        "--transports",
        default=",".join(TRANSPORTS),
        help=f"of {', '.join(TRANSPORTS + CROSSING)}",
    )
    parser.add_argument("--json", help="also write the JSON report to this file")
    # The workers import numpy, whose OpenBLAS starts a thread that spins for about a second:
    # in a consumer it read as 40-70 ms of "idle" CPU a second. Nothing here needs BLAS.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    args = parser.parse_args(argv)
    names = [t for t in args.transports.split(",") if t]
    if unknown := set(names) - set(TRANSPORTS + CROSSING):
        parser.error(f"unknown transports {sorted(unknown)}; choose from {TRANSPORTS + CROSSING}")
    if not 1 <= args.rounds <= args.latency_count:
        parser.error(f"--rounds must be between 1 and --latency-count, not {args.rounds}")

    share, extra = divmod(args.latency_count, args.rounds)
    per_round = [share + (k < extra) for k in range(args.rounds)]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="ring-bench-") as tmpdir:
        for k, count in enumerate(per_round, 1):
            for label, size in SIZES.items():
                for name in names:
                    print(
                        f"round {k}/{args.rounds}: {name} {label} ...", file=sys.stderr, flush=True
                    )
                    run = run_case(name, size, count, args, tmpdir)
                    runs.setdefault((name, size), []).append(run)
    results = [summarize(name, size, r) for (name, size), r in runs.items()]

    report = {
        "benchmark": "ring_bench",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "args": vars(args),
        "results": results,
    }
    for size in SIZES.values():
        rows = [r for r in results if r["payload_bytes"] == size]
        ring = next((r for r in rows if r["transport"] == "omni_ring"), None)
        print(f"\n{size}-byte records")
        print(
            f"{'transport':<15} {'p50 us':>8} {'p99 us':>8} {'p99.9 us':>9} {'rec/s':>11}"
            f" {'GB/s':>7} {'idle CPU ms/s':>13} {'p99 vs ring':>11}"
        )
        for r in rows:
            lat = r["latency_us"]
            ratio = lat["p99"] / ring["latency_us"]["p99"] if ring else float("nan")
            print(
                f"{r['transport']:<15} {lat['p50']:8.1f} {lat['p99']:8.1f} {lat['p99_9']:9.1f}"
                f" {r['records_per_s']:11,.0f} {r['gb_per_s']:7.3f}"
                f" {r['idle_consumer_cpu_ms_per_s']:13.2f} {ratio:10.1f}x"
            )
    print(
        f"\nmachine: {report['machine']['cpu']}, {report['machine']['cores']} cores, "
        f"Linux {report['machine']['kernel']}, Python {report['machine']['python']}"
    )
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
