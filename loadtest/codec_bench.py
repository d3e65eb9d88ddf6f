"""The talker voice's SNAC decoder: a streamed block of every caller decoded in one pass, eager
against CUDA graphs (on a GPU), by batch size, in one run; prints JSON and a table.

A block is the steady one of a phrase (4 frames emitted, 1 of context, 1 of lookahead: 6
frames, 341 ms of 24 kHz audio emitted). SNAC 24 kHz's shape with random weights (the timing
does not depend on them); the figure is a pass's wall time, host copies included, and the
audio it makes per second of decoding.

    python -m loadtest.codec_bench [--device cuda] [--batches 1,8,32,64] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.bench import describe_machine, ms_summary, publish
from stages.backends.snac_codec import TOKENS_PER_FRAME, Window, load_snac
from stages.backends.tiny_talker import ensure_snac

FRAMES, LEFT, EMIT = 6, 1, 4


def measure(decoder: Any, batch: int, passes: int) -> dict[str, Any]:
    import torch

    rng = np.random.default_rng(batch)
    windows = [
        Window(rng.integers(0, 4096, (FRAMES, TOKENS_PER_FRAME)), LEFT, EMIT) for _ in range(batch)
    ]
    decoder.decode(windows)  # a first pass of this shape (a graph recorded, if graphs are on)
    times = []
    for _ in range(passes):
        if decoder.device.type == "cuda":
            torch.cuda.synchronize(decoder.device)
        t0 = time.perf_counter()
        decoder.decode(windows)
        times.append(time.perf_counter() - t0)
    audio_s = batch * EMIT * decoder.frame_samples / decoder.sample_rate
    return {"pass_ms": ms_summary(times), "audio_s_per_s": round(audio_s / np.median(times), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--root", type=Path, default=Path(".cache/gpu-models"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch

    batches = [int(b) for b in args.batches.split(",") if b]
    folder = ensure_snac(args.root / "snac-24khz", args.device)
    modes = ("eager", "cuda_graphs") if args.device.startswith("cuda") else ("eager",)
    results: dict[str, Any] = {}
    for mode in modes:
        decoder = load_snac(str(folder), torch.device(args.device), cuda_graphs=mode != "eager")
        results[mode] = {str(b): measure(decoder, b, args.passes) for b in batches}
        del decoder
    report = {
        "benchmark": "codec_bench",
        "date": datetime.date.today().isoformat(),
        "machine": describe_machine(),
        "block": {"frames": FRAMES, "context": LEFT, "emitted": EMIT},
        "results": results,
    }
    lines = [
        "| decoder | batch | pass p50 / p95 ms | audio s per s |",
        "|---|---:|---:|---:|",
    ]
    for mode, by_batch in results.items():
        for b, r in by_batch.items():
            p = r["pass_ms"]
            lines.append(f"| {mode} | {b} | {p['p50']} / {p['p95']} | {r['audio_s_per_s']} |")
    publish(report, "\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
