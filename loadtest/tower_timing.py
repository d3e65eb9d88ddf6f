"""The speech-in audio tower's passes timed alone, and beside Whisper's decodes: where a pass's
time goes when the encoder stage is busy.

    python -m loadtest.tower_timing [--layout speech-in] [--windows 1,4,8,16]
        [--beside none,thread:16,process:16] [--switch-ms 5,0.5] [--passes 20]
        [--set KEY=VALUE ...] [--models-root DIR] [--device cuda] [--out DIR]

In the GPU run the tower's passes took 57 ms for one 2 s window at 8 callers and 400-500 ms
for 3-7 windows at 32-64, where the arithmetic gives a millisecond or two a window. The
encoder stage runs them in the process whose 16 decode threads run Whisper. This benchmark
loads the layout's tower and recognizer as that stage does (loadtest.gpu_layouts; `--set` as
in loadtest.gpu_run) and times `--passes` passes of each number of `--windows` at once:
- the pass's wall time, and the GPU's own time for it (CUDA events on its stream), so that a
  wall time far over the GPU's is the host's: kernels launched late;
- `--beside`: alone (`none`), beside N threads of the same process decoding turns with the
  recognizer (`thread:N`, the stage as it is: one interpreter lock), or beside a process of
  its own with N such threads (`process:N`: the GPU shared, the lock not);
- `--switch-ms`: the interpreter's switch interval (`sys.setswitchinterval`; Python's default
  is 5 ms), how long a thread that wants the lock waits for another to give it up.
Prints JSON and a table; writes results.json and table.md under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import multiprocessing as mp
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.bench import describe_machine, log, publish, summary
from loadtest.gpu_layouts import SPEECH_IN_LAYOUTS, Variant, build_models, layout_config
from loadtest.settings import add_set_argument

TURN_S = 3.0  # each decode beside the tower: a 3 s turn fed in 200 ms chunks, then finished
CHUNK = 3200  # 200 ms at 16 kHz


def speech_like(seconds: float, seed: int) -> np.ndarray:
    """PCM16 noise at about -30 dBFS in syllable-long bursts: random weights hear nothing in
    it either way, but the recognizer's passes and the tower's take their usual shapes."""
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    envelope = (np.sin(np.arange(n) * 2 * np.pi * 4 / 16000) > -0.3).astype(np.float32)
    return (rng.normal(0, 1000, n) * envelope).astype(np.int16)


def decode_turns(recognizer: Any, stop: threading.Event, done: list[float]) -> None:
    """Turns decoded one after another until `stop` (at least one): each one's time in
    `done`."""
    audio = speech_like(TURN_S, seed=threading.get_ident() % 1000)
    while True:
        started = time.monotonic()
        stream = recognizer.open_stream()
        try:
            for at in range(0, len(audio), CHUNK):
                stream.feed(audio[at : at + CHUNK])
            stream.finish()
        finally:
            stream.close()
        done.append(time.monotonic() - started)
        if stop.is_set():
            return


@contextlib.contextmanager
def decoding(recognizer: Any, threads: int) -> Iterator[list[float]]:
    """`threads` threads decoding turns while the block runs; the turns' times."""
    stop, done = threading.Event(), []
    workers = [
        threading.Thread(target=decode_turns, args=(recognizer, stop, done), daemon=True)
        for _ in range(threads)
    ]
    for worker in workers:
        worker.start()
    try:
        yield done
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)


def decoding_process(config: Any, threads: int, ready: Any, stop: Any, times: Any) -> None:
    """`process:N`: the recognizer in a process of its own, decoding until `stop` is set."""
    from stages.encoder import load_recognizer

    recognizer = load_recognizer(config.encoder)
    with decoding(recognizer, threads) as done:
        ready.set()
        stop.wait()
    times.put(list(done))


@contextlib.contextmanager
def beside(kind: str, threads: int, config: Any, recognizer: Any) -> Iterator[list[float]]:
    """What runs beside the tower's passes; the times of the turns it decoded."""
    if kind == "none":
        yield []
    elif kind == "thread":
        with decoding(recognizer, threads) as done:
            yield done
    else:
        spawn = mp.get_context("spawn")
        ready, stop, times = spawn.Event(), spawn.Event(), spawn.Queue()
        child = spawn.Process(target=decoding_process, args=(config, threads, ready, stop, times))
        child.start()
        done: list[float] = []
        try:
            if not ready.wait(timeout=300):
                raise RuntimeError("the decoding process did not start within 300 s")
            yield done
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                done.extend(times.get(timeout=60))
            child.join(timeout=60)
            if child.is_alive():
                child.kill()


def time_passes(tower: Any, on_stream: Any, windows: int, passes: int) -> dict[str, Any]:
    """`passes` passes of `windows` full windows: wall and GPU ms (the GPU's on CUDA only)."""
    import torch

    audios = [speech_like(tower.window_samples / 16000, seed=i) for i in range(windows)]
    cuda = str(getattr(tower, "device", "cpu")).startswith("cuda")
    wall, gpu = [], []
    for _ in range(passes):
        with on_stream():
            stream = torch.cuda.current_stream() if cuda else None
            start = torch.cuda.Event(enable_timing=True) if cuda else None
            end = torch.cuda.Event(enable_timing=True) if cuda else None
            began = time.monotonic()
            if start is not None:
                start.record(stream)
            rows = tower.rows_of(audios)  # ends with the rows on the host: synchronised
            if end is not None:
                end.record(stream)
                end.synchronize()
                gpu.append(start.elapsed_time(end))
            wall.append((time.monotonic() - began) * 1000)
        if len(rows) != windows:
            raise RuntimeError(f"{len(rows)} windows' rows for {windows}")
    return {"wall_ms": summary(wall, 50, 95), "gpu_ms": summary(gpu, 50, 95) if gpu else None}


def parse_beside(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        kind, _, n = item.partition(":")
        if kind == "none" and not n:
            out.append(("none", 0))
        elif kind in ("thread", "process") and n.isdigit() and int(n) > 0:
            out.append((kind, int(n)))
        else:
            raise argparse.ArgumentTypeError(
                f"--beside {item!r}: none, thread:N or process:N (N > 0)"
            )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| beside the tower | switch ms | windows | pass wall p50 / p95 ms | GPU p50 / p95 ms "
        "| turns decoded beside, p50 ms (n) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        w, g, d = r["wall_ms"], r["gpu_ms"], r["decodes_ms"]
        gpu = f"{g['p50']} / {g['p95']}" if g else "-"
        decodes = f"{d['p50']} ({d['n']})" if d["n"] else "-"
        lines.append(
            f"| {r['beside']} | {r['switch_ms']} | {r['windows']} | {w['p50']} / {w['p95']} "
            f"| {gpu} | {decodes} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--layout", choices=sorted(SPEECH_IN_LAYOUTS), default="speech-in")
    parser.add_argument("--windows", type=ints, default=[1, 4, 8, 16])
    parser.add_argument("--beside", type=parse_beside, default=parse_beside("none,thread:16"))
    parser.add_argument(
        "--switch-ms", type=lambda s: [float(x) for x in s.split(",")], default=[5.0]
    )
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--preset", default=None, help="model sizes (default: real on cuda)")
    parser.add_argument("--models-root", type=Path, default=Path(".cache/gpu-models"))
    parser.add_argument("--out", type=Path)
    add_set_argument(parser, "encoder.options.max_new_tokens=64 (one value each)")
    args = parser.parse_args(argv)
    if not 1 <= args.passes <= 1000:
        parser.error(f"--passes {args.passes}: must be 1..1000")
    if any(not 0 < ms <= 100 for ms in args.switch_ms):
        parser.error(f"--switch-ms {args.switch_ms}: each must be over 0 and at most 100")
    if any(len(dimension) != 1 for dimension in args.set):
        parser.error("--set: one value a key here (this benchmark's variants are its own)")

    from loadtest.gpu_models import describe
    from stages.backends.speech import gpu_stream, torch_device
    from stages.encoder import load_recognizer
    from stages.placement import count_gpus
    from stages.speech_in import speech_in_model

    preset = args.preset or ("real" if args.device == "cuda" else "tiny")
    models = build_models(args.models_root, args.device, preset, [args.layout])
    gpus = count_gpus() if args.device == "cuda" else 0
    variant = Variant(settings=tuple(dimension[0] for dimension in args.set))
    config, notes = layout_config(args.layout, models, gpus, args.device, variant)
    speech_in = speech_in_model(config.reasoning)
    assert speech_in is not None and config.reasoning.speech_in is not None
    device = config.encoder.device
    log(f"loading {speech_in.family}'s tower and {config.encoder.model} on {device}")
    tower = speech_in.tower(device, config.reasoning.speech_in.dtype)
    on_stream = gpu_stream(
        torch_device(device, "audio tower"), config.reasoning.speech_in.stream_priority, "tower"
    )
    recognizer = load_recognizer(config.encoder)
    time_passes(tower, on_stream, max(args.windows), 2)  # warm-up: kernels chosen, caches made
    rows: list[dict[str, Any]] = []
    default_switch = sys.getswitchinterval()
    try:
        for (kind, threads), switch_ms in itertools.product(args.beside, args.switch_ms):
            sys.setswitchinterval(switch_ms / 1000)
            name = kind if kind == "none" else f"{kind}:{threads}"
            with beside(kind, threads, config, recognizer) as decodes:
                for windows in args.windows:
                    row = time_passes(tower, on_stream, windows, args.passes)
                    row |= {"beside": name, "switch_ms": switch_ms, "windows": windows}
                    rows.append(row)
                    log(f"{name}, switch {switch_ms} ms, {windows} windows: {row['wall_ms']}")
            for row in rows:
                if row["beside"] == name and row["switch_ms"] == switch_ms:
                    row["decodes_ms"] = summary([d * 1000 for d in decodes], 50, 95)
    finally:
        sys.setswitchinterval(default_switch)
    report = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m loadtest.tower_timing " + " ".join(argv or sys.argv[1:]),
        "machine": describe_machine(),
        "random_weights": "every model has random weights of a real shape: timings, not quality",
        "models": describe(models),
        "layout": args.layout,
        "notes": notes,
        "tower": {
            "family": speech_in.family,
            "window_ms": tower.window_samples * 1000 // 16000,
            "stream_priority": config.reasoning.speech_in.stream_priority,
        },
        "recognizer": {"model": config.encoder.model, "turn_s": TURN_S},
        "rows": rows,
    }
    publish(report, table(rows), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
