"""SpeechT5 replies stepped one at a time against all in one batched pass, side by side in one
run on this machine (stages.backends.speecht5_batch).

    python -m loadtest.vocoder_bench [--device cuda] [--replies 1,2,4,8,16] [--blocks 12]

For each number of replies N, N phrases are spoken for `--blocks` blocks (`stream_steps`
decoder steps each) two ways: each reply advanced on its own in turn, as one vocoder process
did before batching, and all N advanced together in one pass. It reports the wall time of a
round (every reply one block further) and the real-time factor: seconds of speech made per
second, in all (JSON) and for each reply (table; under 1, callers wait for speech). The
model is SpeechT5 + HiFi-GAN of the real checkpoints' shapes with RANDOM weights (built once
under --models-root; timings, not quality). Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

#: A phrase as the vocoder gets it: 12 words (vocoder.max_phrase_words in the GPU layouts).
PHRASE = "the weather today is mild with a light breeze and some sun later"


def measure(voice: Any, replies: int, blocks: int, together: bool, sync: Any) -> dict[str, Any]:
    """Speak `replies` phrases for `blocks` rounds; round times and speech made."""
    streams = [voice.begin(PHRASE) for _ in range(replies)]
    voice.advance(streams)  # every phrase's first block (its encoder and first step) untimed
    rounds, samples = [], 0
    for _ in range(blocks):
        if any(s.done for s in streams):
            break
        t0 = time.perf_counter()
        made = voice.advance(streams) if together else [voice.advance([s])[0] for s in streams]
        sync()
        rounds.append(time.perf_counter() - t0)
        samples += sum(len(block) for block in made)
    for stream in streams:
        stream.close()
    seconds = sum(rounds)
    return {
        "round_ms_p50": round(1000 * statistics.median(rounds), 2),
        "round_ms_max": round(1000 * max(rounds), 2),
        "rounds": len(rounds),
        "speech_s": round(samples / voice.sample_rate, 3),
        "real_time_factor": round(samples / voice.sample_rate / seconds, 2),
    }


def describe_machine(device: str) -> dict[str, Any]:
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else None
    return {
        "device": device,
        "gpu": gpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def table(results: dict[str, Any]) -> str:
    """Per reply: how many times real time each reply's speech is made (under 1: it falls
    behind its playback)."""
    lines = [
        "| replies | one at a time: round ms p50 | x real time a reply | together: round ms p50 "
        "| x real time a reply | speed-up |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in results["replies"].items():
        alone, batch = r["one_at_a_time"], r["together"]
        speedup = alone["round_ms_p50"] / batch["round_ms_p50"]
        lines.append(
            f"| {n} | {alone['round_ms_p50']:.1f} | {alone['real_time_factor'] / int(n):.2f} "
            f"| {batch['round_ms_p50']:.1f} | {batch['real_time_factor'] / int(n):.2f} "
            f"| {speedup:.1f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--replies", type=lambda s: [int(x) for x in s.split(",") if x], default=[1, 2, 4, 8]
    )
    parser.add_argument("--blocks", type=int, default=12, help="timed rounds per measurement")
    parser.add_argument("--stream-steps", type=int, default=4)
    parser.add_argument("--models-root", type=Path, default=Path(".cache/gpu-models"))
    parser.add_argument("--tiny", action="store_true", help="the test-sized model (try-outs)")
    args = parser.parse_args(argv)
    if not args.replies or min(args.replies) < 1 or args.blocks < 1:
        parser.error("--replies needs numbers of at least 1, --blocks at least 1")

    import torch

    from stages.backends.tiny_speech_models import ensure_speecht5, ensure_tiny_speecht5
    from stages.backends.tts_speecht5 import load_speecht5

    if args.tiny:
        built = ensure_tiny_speecht5(args.models_root / "speecht5-tiny")
    else:  # the real checkpoints' shapes: {} keeps transformers' defaults
        built = ensure_speecht5(args.models_root / "speecht5-real", {}, {}, args.device)
    # the GPU layouts' options: 5 frames (80 ms) a character, so no phrase ends mid-run
    voice = load_speecht5(
        str(built.model),
        str(built.vocoder),
        device=args.device,
        maxlenratio=5.0,
        stream_steps=args.stream_steps,
    )
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else lambda: None
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": describe_machine(args.device),
        "model": "SpeechT5 + HiFi-GAN, real shapes, RANDOM weights"
        if not args.tiny
        else "tiny SpeechT5 (tests), RANDOM weights",
        "stream_steps": args.stream_steps,
        "replies": {},
    }
    for n in args.replies:
        results["replies"][str(n)] = {
            "one_at_a_time": measure(voice, n, args.blocks, together=False, sync=sync),
            "together": measure(voice, n, args.blocks, together=True, sync=sync),
        }
        print(f"{n} replies: {json.dumps(results['replies'][str(n)])}", flush=True)
    print(f"machine: {results['machine']}")
    print(table(results))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
