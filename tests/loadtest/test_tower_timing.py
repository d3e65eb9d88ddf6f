"""`python -m loadtest.tower_timing` on the CPU with the tiny models, before GPU time is spent
on it: every variant times its passes, and decodes run beside the tower where asked."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.tower_timing import parse_beside

ROOT = Path(__file__).parents[2]


def test_beside_takes_none_threads_and_processes_and_names_a_bad_one() -> None:
    assert parse_beside("none,thread:16,process:2") == [
        ("none", 0),
        ("thread", 16),
        ("process", 2),
    ]
    for bad in ("thread", "thread:0", "gpu:2", "none:1"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            parse_beside(bad)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_tower_is_timed_alone_and_beside_decodes_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "loadtest.tower_timing",
        "--device=cpu",
        "--windows=1,2",
        "--beside=none,thread:1",
        "--switch-ms=5,1",
        "--passes=2",
        f"--out={out}",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    assert report["tower"]["family"] == "qwen2_5_omni"
    rows = report["rows"]
    assert [(r["beside"], r["switch_ms"], r["windows"]) for r in rows] == [
        (beside, switch, windows)
        for beside in ("none", "thread:1")
        for switch in (5.0, 1.0)
        for windows in (1, 2)
    ]
    assert all(r["wall_ms"]["n"] == 2 and r["wall_ms"]["p50"] > 0 for r in rows)
    assert all(r["gpu_ms"] is None for r in rows)  # no CUDA events on the CPU
    assert all(r["decodes_ms"]["n"] == 0 for r in rows if r["beside"] == "none")
    # the decoding thread ran through the passes (each variant's turns, once it stopped)
    assert all(r["decodes_ms"]["n"] >= 1 for r in rows if r["beside"] == "thread:1")
    assert "| thread:1 | 1.0 | 2 |" in (out / "table.md").read_text()
