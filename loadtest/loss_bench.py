"""One-way audio latency through two aiortc peers on 127.0.0.1 when the link loses packets:
aiortc's jitter buffer against the gateway's, in one run.

    python -m loadtest.loss_bench --loss 0,0.01,0.05 --bursts 40

A sender plays a 100 ms 1 kHz tone burst every 400 ms; on its way out each RTP packet is
dropped with the given probability (a seeded generator, so every variant loses the same
packets: a lossy link, not the network's). The receiver notes when each burst's first loud
frame comes out of its track; one-way latency is that less the burst's send time (one process,
one clock). Variants, all with aiortc's own Opus so only the receive buffer differs:
- `aiortc`: stock, a 4-frame prefetch, and a lost packet waited for until 16 more came, after
  which the frames queued behind it stay queued;
- `prefetch 1`: a one-frame prefetch with aiortc's wait for a lost packet;
- `gateway`: `gateway.aiortc_tuning` as the gateway runs it (`gateway.media.audio_prefetch`'s
  default: 0, each frame handed on as it arrives), a lost packet given up after two more.
Prints JSON and a table, and states the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import fractions
import json
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame

from gateway import aiortc_tuning
from gateway.config import MediaConfig
from gateway.ice import restrict_host_addresses
from loadtest.bench import log, summary
from loadtest.report import machine

RATE = 48_000
FRAME = 960  # 20 ms
BURST_FRAMES, PERIOD_FRAMES = 5, 20  # 100 ms of tone every 400 ms
LOUD_RMS = 1000.0
VARIANTS = ("aiortc", "prefetch 1", "gateway")


class ToneBursts(MediaStreamTrack):
    """48 kHz mono, paced at 20 ms on the loop's clock; a 100 ms 1 kHz burst every 400 ms, the
    send time of each burst's first frame recorded in `sent_at`."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self.sent_at: list[float] = []
        self._index = 0
        self._start = 0.0
        t = np.arange(FRAME * BURST_FRAMES) / RATE
        self._burst = (8000 * np.sin(2 * np.pi * 1000 * t)).astype(np.int16)

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        loop = asyncio.get_running_loop()
        if self._index == 0:
            self._start = loop.time()
        else:
            await asyncio.sleep(self._start + self._index * FRAME / RATE - loop.time())
        slot = self._index % PERIOD_FRAMES
        if slot < BURST_FRAMES:
            pcm = self._burst[slot * FRAME : (slot + 1) * FRAME]
        else:
            pcm = np.zeros(FRAME, np.int16)
        if slot == 0:
            self.sent_at.append(loop.time())
        frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts = RATE, self._index * FRAME
        frame.time_base = fractions.Fraction(1, RATE)
        self._index += 1
        return frame


def drop_rtp(pc: RTCPeerConnection, loss: float, rng: random.Random) -> list[int]:
    """Make `pc`'s RTP leave through a link that loses `loss` of it; returns the count of
    packets offered and dropped as [sent, dropped]."""
    counts = [0, 0]
    for sender in pc.getSenders():
        transport = sender.transport
        send = transport._send_rtp

        async def lossy(data: bytes, send: Any = send) -> None:
            counts[0] += 1
            if rng.random() < loss:
                counts[1] += 1
                return
            await send(data)

        transport._send_rtp = lossy  # this benchmark's link, on this connection only
    return counts


async def one_way_ms(bursts: int, loss: float, seed: int) -> dict[str, Any]:
    """Send `bursts` bursts over a link losing `loss` of the packets; the latencies heard."""
    sender = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    receiver = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    source = ToneBursts()
    sender.addTrack(source)
    heard_at: list[float] = []
    done = asyncio.Event()
    listeners: list[asyncio.Task[None]] = []

    async def listen(track: MediaStreamTrack) -> None:
        loud = False
        with contextlib.suppress(MediaStreamError):  # the track ended: report what was heard
            while len(heard_at) < bursts:
                frame = await track.recv()
                pcm = frame.to_ndarray().astype(np.float64)  # type: ignore[union-attr]
                now_loud = float(np.sqrt((pcm * pcm).mean())) > LOUD_RMS
                if now_loud and not loud:
                    heard_at.append(asyncio.get_running_loop().time())
                loud = now_loud
        done.set()

    receiver.on(
        "track", lambda track: listeners.append(asyncio.create_task(listen(track), name="listen"))
    )
    try:
        await sender.setLocalDescription(await sender.createOffer())
        await receiver.setRemoteDescription(sender.localDescription)
        await receiver.setLocalDescription(await receiver.createAnswer())
        await sender.setRemoteDescription(receiver.localDescription)
        counts = drop_rtp(sender, loss, random.Random(seed))
        # bounded: every burst is 400 ms apart; a lost onset is heard a frame later
        await asyncio.wait_for(done.wait(), timeout=bursts * 0.4 + 20)
    finally:
        for task in listeners:
            task.cancel()
        await asyncio.gather(*listeners, return_exceptions=True)
        await sender.close()
        await receiver.close()
    # bursts are 400 ms apart and the link is faster: pair each with the last one sent before
    latencies = [(t - max(s for s in source.sent_at if s < t)) * 1000 for t in heard_at]
    return {
        "packets_sent": counts[0],
        "packets_dropped": counts[1],
        "one_way_ms": summary(latencies, 50, 95),
        "last_10_bursts_ms": summary(latencies[-10:], 50),
    }


@contextmanager
def variant(name: str) -> Iterator[None]:
    """The receive buffer of `name`, put back afterwards."""
    buffer = aiortc_tuning.jitter.PrefetchJitterBuffer
    late = buffer.LATE_PACKETS
    try:
        if name == "aiortc":
            aiortc_tuning.restore()
        else:
            gateway = MediaConfig.model_fields["audio_prefetch"].default
            aiortc_tuning.apply(1 if name == "prefetch 1" else gateway, opus="aiortc")
            if name == "prefetch 1":
                buffer.LATE_PACKETS = 1 << 16  # never give up before the buffer is full
        yield
    finally:
        buffer.LATE_PACKETS = late
        aiortc_tuning.restore()


def table(results: dict[str, Any]) -> str:
    rows = [
        "| loss | receive buffer | packets dropped | one-way p50 / p95 / max ms "
        "| last 10 bursts p50 ms |",
        "|---:|---|---:|---:|---:|",
    ]
    for run in results["runs"]:
        w = run["one_way_ms"]
        rows.append(
            f"| {run['loss']:.0%} | {run['variant']} | {run['packets_dropped']} of "
            f"{run['packets_sent']} | {w['p50']:.0f} / {w['p95']:.0f} / {w['max']:.0f} | "
            f"{run['last_10_bursts_ms']['p50']:.0f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--loss", type=floats, default=[0.0, 0.01, 0.05], help="per packet")
    parser.add_argument("--bursts", type=int, default=40, help="per run, 400 ms apart")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if any(not 0.0 <= p < 1.0 for p in args.loss):
        parser.error(f"--loss: each value must be in [0, 1), got {args.loss}")
    if args.bursts < 10:
        parser.error("--bursts: at least 10")
    restrict_host_addresses(["127.0.0.1"])  # the two peers never leave this machine
    results: dict[str, Any] = {
        "benchmark": "loss_bench",
        "date": datetime.date.today().isoformat(),
        "command": "python -m loadtest.loss_bench " + " ".join(argv or sys.argv[1:]),
        "machine": machine(),
        "runs": [],
    }
    log(f"machine: {results['machine']['summary']}")
    for loss in args.loss:
        for name in VARIANTS:
            started = time.monotonic()
            with variant(name):
                run = asyncio.run(one_way_ms(args.bursts, loss, args.seed))
            results["runs"].append({"loss": loss, "variant": name, **run})
            log(
                f"loss {loss:.0%}, {name}: one-way {run['one_way_ms']} "
                f"({time.monotonic() - started:.0f} s)"
            )
    print(json.dumps(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    print(f"machine: {results['machine']['summary']}")
    print(table(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
