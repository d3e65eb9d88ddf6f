"""aiortc's Opus (48 kHz stereo, resampled both ways) against libopus at the pipeline's rates
(experiments.opus), side by side in one run:

1. per 20 ms frame, on this machine: the receive path (decode, then get 16 kHz mono) and the
   send path (the vocoder's 22,050 Hz to Opus packets), CPU time and the delay the resampling
   filters add (an impulse's shift);
2. with the load generator: N conversing WebRTC callers (in their own process) against the
   gateway (stages from configs/tiny.yaml) once per codec: the gateway process's CPU per
   session and the callers' turn latency.

    python -m loadtest.opus_bench [--callers 6] [--turns 3]

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import fractions
import json
import multiprocessing
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web
from aiortc.codecs.opus import OpusDecoder, OpusEncoder
from av import AudioFrame

from gateway import aiortc_tuning
from gateway.app import build_app
from gateway.config import load_config
from gateway.media import prepare_media
from gateway.opus import OpuslibDecoder, OpuslibEncoder, opus_rate_for
from gateway.resample import Downmixer, Upsampler
from gateway.server import vocoder_rate
from loadtest.voices import spoken
from stages.messages import CALLER_RATE
from stages.supervisor import Supervisor

VOCODER_RATE = 22_050  # espeak-ng's


class Packet:  # what aiortc's jitter buffer hands a decoder
    def __init__(self, data: bytes, timestamp: int) -> None:
        self.data, self.timestamp = data, timestamp


def _frame(pcm: np.ndarray, rate: int, layout: str = "mono") -> AudioFrame:
    f = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout=layout)
    f.sample_rate, f.pts, f.time_base = rate, 0, fractions.Fraction(1, rate)
    return f


def _speechlike(rate: int, seconds: float) -> np.ndarray:
    rng = np.random.default_rng(0)
    t = np.arange(int(rate * seconds)) / rate
    return (np.sin(2 * np.pi * 180 * t) * 6000 + rng.normal(0, 800, len(t))).astype(np.int16)


def _delay_ms(convert: Any, rate_in: int) -> float:
    """How much input a streaming converter holds back: feed 1 ms pieces and see how far past
    an impulse the input has to go before the impulse comes out."""
    step = rate_in // 1000
    pcm = np.zeros(rate_in // 2, np.int16)
    at = rate_in // 10
    pcm[at] = 30000
    for start in range(0, len(pcm), step):
        out = convert(pcm[start : start + step])
        if len(out) and np.max(np.abs(out)) > 3000:
            return (start + step - at) / rate_in * 1000
    return float("nan")


def micro(seconds: float = 5.0) -> dict[str, Any]:
    """Per-frame CPU of both paths with each codec; the resamplers' added delay."""
    frames = int(seconds * 50)
    caller48 = _speechlike(48_000, seconds)
    stereo = np.repeat(caller48, 2)
    sender = OpusEncoder()  # packets as a browser would send them
    packets = []
    for i in range(frames):
        payloads, ts = sender.encode(_frame(stereo[i * 1920 : (i + 1) * 1920], 48_000, "stereo"))
        packets += [Packet(p, ts) for p in payloads]
    voice = _speechlike(VOCODER_RATE, seconds)
    chunk = VOCODER_RATE // 10  # the vocoder's 100 ms chunks

    def receive_aiortc() -> None:
        decoder, down = OpusDecoder(), Downmixer()
        for p in packets:
            for f in decoder.decode(p):
                down.convert(f)

    def receive_libopus() -> None:
        decoder, down = OpuslibDecoder(CALLER_RATE), Downmixer()
        for p in packets:
            for f in decoder.decode(p):
                down.convert(f)

    def send(rate: int, encoder: Any) -> None:
        up, n = Upsampler(VOCODER_RATE, rate), rate // 50
        pending = np.zeros(0, np.int16)
        for i in range(0, len(voice), chunk):
            pending = np.concatenate([pending, up.convert(voice[i : i + chunk])])
            while len(pending) >= n:
                encoder.encode(_frame(pending[:n], rate))
                pending = pending[n:]

    out_rate = opus_rate_for(VOCODER_RATE)
    paths = {
        "receive, aiortc (48 kHz stereo, then resampled)": receive_aiortc,
        "receive, libopus (16 kHz mono)": receive_libopus,
        "send, aiortc (22.05 -> 48 kHz, stereo encode)": lambda: send(48_000, OpusEncoder()),
        f"send, libopus (22.05 -> {out_rate // 1000} kHz, mono encode)": lambda: send(
            out_rate, OpuslibEncoder()
        ),
    }
    rows = {}
    for name, run in paths.items():
        times = []
        for _ in range(5):
            t0 = time.process_time()
            run()
            times.append((time.process_time() - t0) / frames * 1e6)
        rows[name] = round(statistics.median(times), 1)
    down = Downmixer()
    delays = {
        "downmix+resample 48k stereo -> 16k": _delay_ms(
            lambda pcm: down.convert(_frame(np.repeat(pcm, 2), 48_000, "stereo")), 48_000
        ),
        "upsample 22.05k -> 48k": _delay_ms(Upsampler(VOCODER_RATE, 48_000).convert, VOCODER_RATE),
        f"upsample 22.05k -> {out_rate // 1000}k": _delay_ms(
            Upsampler(VOCODER_RATE, out_rate).convert, VOCODER_RATE
        ),
    }
    return {"us_per_frame": rows, "filter_delay_ms": {k: round(v, 2) for k, v in delays.items()}}


async def _load_run(
    config: Any, supervisor: Supervisor, codec: str, n: int, turns: int, speech: np.ndarray
) -> dict:
    from loadtest.conversation import run_conversations

    prepare_media(config)
    aiortc_tuning.apply(config.gateway.media.audio_prefetch, codec)  # for the calls made now
    runner = web.AppRunner(
        build_app(config, supervisor.names, vocoder_rate(supervisor), lambda: supervisor.healthy)
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        base = f"http://{host}:{port}"
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(1) as pool:
            t0, c0 = time.monotonic(), time.process_time()
            pending = pool.apply_async(run_conversations, (base, n, speech, turns))
            while not pending.ready():  # keep serving the calls on this loop meanwhile
                await asyncio.sleep(0.05)
            wall, cpu = time.monotonic() - t0, time.process_time() - c0
            reports = pending.get()
    finally:
        await runner.cleanup()
    latencies = [
        (t["first_audio"] - t["end_of_speech"]) * 1000
        for r in reports
        for t in r["turns"]
        if t.get("first_audio")
    ]
    errors = [r["error"] for r in reports if r["error"]]
    return {
        "codec": codec,
        "callers": n,
        "turns_answered": len(latencies),
        "errors": errors,
        "gateway_cpu_per_session_pct": round(100 * cpu / wall / n, 2),
        "turn_latency_ms_p50": round(statistics.median(latencies), 1) if latencies else None,
        "turn_latency_ms_p95": round(float(np.percentile(latencies, 95)), 1) if latencies else None,
    }


async def load(n: int, turns: int) -> list[dict]:
    config = load_config(
        Path("configs/tiny.yaml"),
        {"gateway.port": 0, "gateway.max_calls": n + 2, "max_sessions": max(16, n + 4)},
    )
    speech = spoken("what is the weather like")
    with Supervisor(config) as supervisor:
        supervisor.start()
        return [
            await _load_run(config, supervisor, codec, n, turns, speech)
            for codec in ("aiortc", "opuslib")
        ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    result = {
        "benchmark": "opus_codec_path",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "micro": micro(),
        "load": asyncio.run(load(args.callers, args.turns)),
    }
    print(f"{'path (per 20 ms frame)':58} {'µs':>8}")
    for name, us in result["micro"]["us_per_frame"].items():
        print(f"{name:58} {us:8.1f}")
    for name, ms in result["micro"]["filter_delay_ms"].items():
        print(f"{'delay: ' + name:58} {ms:7.2f} ms")
    print(
        f"\n{'codec':10} {'callers':>7} {'answered':>8} {'CPU/session %':>14} "
        f"{'turn p50 ms':>12} {'turn p95 ms':>12}"
    )
    for r in result["load"]:
        print(
            f"{r['codec']:10} {r['callers']:7d} {r['turns_answered']:8d} "
            f"{r['gateway_cpu_per_session_pct']:14.2f} {r['turn_latency_ms_p50']!s:>12} "
            f"{r['turn_latency_ms_p95']!s:>12}"
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
