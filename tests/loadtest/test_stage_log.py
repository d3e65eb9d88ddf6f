"""loadtest.stage_log reads back what the stages log, in the formats their classes write."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.stage_log import gather, table
from stages.backends.vllm_stats import AbortWaits, StepLog
from stages.passlog import CancelHops, CountLog, LatencyLog, PassLog

ROOT = Path(__file__).parents[2]


def _stage_lines(caplog: pytest.LogCaptureFixture) -> dict[str, str]:
    """One line of each kind, made by the classes that write them."""
    steps = StepLog(every_s=3600)
    steps.add(0.000, busy=True, prompt_tokens=0, usage=0.2)
    steps.add(0.005, busy=True, prompt_tokens=0, usage=0.2)
    steps.add(0.017, busy=True, prompt_tokens=120, usage=0.4)
    steps.every_s = 0
    hops = CancelHops()
    for log in hops.logs:
        log.every_s = 0
    waits = AbortWaits(every_s=3600)
    waits.add("freed_first_step")
    waits.add("hidden")
    waits.every_s = 0
    prepared = CountLog("replies made at the pause", "how they ended", every_s=3600)
    prepared.add("released")
    prepared.every_s = 0
    passes = PassLog("vocoder", "replies", every_s=0)
    first_audio = LatencyLog("vocoder: first audio after the first phrase, other replies", 0)
    with caplog.at_level(logging.INFO):
        steps.add(0.022, busy=False, prompt_tokens=0)
        hops.add([0, 1_000_000, 3_000_000])  # pushed, read 1 ms later, abort sent 2 ms after
        waits.add("freed_later_step")
        prepared.add("caller_went_on")
        passes.add(4, 0.060)
        first_audio.add(0.250)
    lines = {"reasoning": [], "vocoder": []}
    for record in caplog.records:
        stage = "vocoder" if record.getMessage().startswith("vocoder") else "reasoning"
        lines[stage].append(record.getMessage())
    return lines


def _run_log(caplog: pytest.LogCaptureFixture) -> list[str]:
    made = _stage_lines(caplog)

    def stage(clock: str, name: str, text: str) -> str:
        return f"2026-12-01 {clock},123 {name}[42] INFO {text}"

    log = ["[12:00:00] layout one vocoder.batch=8: gpu-one.yaml"]
    log.append(stage("12:00:01", "reasoning", made["reasoning"][0]))  # warm-up: no load yet
    log.append("[12:00:05] 8 caller(s) over webrtc, 10 turns each")
    log += [stage("12:00:15", "reasoning", text) for text in made["reasoning"]]
    log += [stage("12:00:15", "vocoder.1", text) for text in made["vocoder"]]  # a replica
    log.append('[12:00:40] 8 callers: {"callers": 8}')
    log.append(stage("12:00:45", "reasoning", made["reasoning"][0]))  # between loads
    return log


def test_a_runs_stage_lines_are_gathered_by_variant_and_load(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs = gather(_run_log(caplog))
    assert list(runs) == ["one vocoder.batch=8"]
    assert list(runs["one vocoder.batch=8"]) == ["8 callers over webrtc"]
    report = runs["one vocoder.batch=8"]["8 callers over webrtc"].report()
    decoding = report["vLLM step, decoding only"]
    assert decoding["events"] == 2 and decoding["max_ms"] == pytest.approx(5.0)
    assert report["vLLM step, finishing a prefill"]["max_ms"] == pytest.approx(12.0)
    held = report["vLLM KV cache held, %"]  # the three busy steps'
    assert held["events"] == 3 and held["max_ms"] == pytest.approx(40.0)
    hop = report["cancel of a reply being made: read to vLLM's abort sent"]
    assert hop == {"events": 1, "p50_ms": [2.0, 2.0], "p99_ms": [2.0, 2.0], "max_ms": 2.0}
    assert report["vLLM aborts, how their freed blocks were seen"] == {
        "freed_first_step": 1,
        "freed_later_step": 1,
        "hidden": 1,
    }
    prepared = report["replies made at the pause, how they ended"]
    assert prepared == {"caller_went_on": 1, "released": 1}
    assert report["vocoder passes"] == {"passes": 1, "items_a_pass": 4.0, "ms_a_pass": 60.0}
    assert report["first audio after the first phrase, other replies"]["p99_ms"] == [250.0] * 2
    row = table({"v": {"8 callers": report}}).splitlines()[-1]
    assert row.startswith("| v | 8 callers | 5.0 / 12.0 | 1.0 / 2.0 / ")
    assert row.endswith("| 1 / 1 / 1 |  / 250.0 | 4.0, 60.0 |")  # no reply made at a pause


def test_a_turn_taking_runs_stage_lines_are_gathered_by_turn_detection() -> None:
    def stage(clock: str, text: str) -> str:
        return f"2026-12-04 {clock},123 reasoning[42] INFO {text}"

    counts = "replies made at the pause in 10 s, how they ended: "
    log = [
        "[12:00:00] provisional:webrtc: warm-up, 8 caller(s), one question each",
        stage("12:00:04", counts + "released 8"),  # the warm-up: no load
        "[12:00:05] provisional:webrtc / server_vad: 8 caller(s), 27 clips each",
        stage("12:00:15", counts + "released 5, caller_went_on 2"),
        '[12:02:40] provisional:webrtc / server_vad 8 callers: {"first_audio_ms": {}}',
        "[12:02:40] provisional:webrtc / semantic_vad: 8 caller(s), 27 clips each",
        stage("12:02:50", counts + "released 1, turn_answered_without_one 4"),
    ]
    runs = gather(log)
    assert {v: list(loads) for v, loads in runs.items()} == {
        "provisional:webrtc / server_vad": ["8 callers"],
        "provisional:webrtc / semantic_vad": ["8 callers"],
    }
    key = "replies made at the pause, how they ended"
    assert runs["provisional:webrtc / server_vad"]["8 callers"].report()[key] == {
        "caller_went_on": 2,
        "released": 5,
    }
    semantic = runs["provisional:webrtc / semantic_vad"]["8 callers"].report()[key]
    assert semantic == {"released": 1, "turn_answered_without_one": 4}


def test_the_command_names_a_log_without_a_run_in_it(tmp_path: Path) -> None:
    empty = tmp_path / "run.log"
    empty.write_text("nothing of gpu_run here\n")
    for path, says in ((tmp_path / "missing.log", "no such log file"), (empty, "no load")):
        done = subprocess.run(
            [sys.executable, "-m", "loadtest.stage_log", str(path)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert done.returncode == 2 and says in done.stderr and str(path) in done.stderr


def test_gpu_runs_results_carry_the_stages_account_of_their_own_variants(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    from loadtest.gpu_run import stages_account

    run_log = tmp_path / "run.log"
    assert stages_account(run_log, {}) == {}  # run without device-run.sh: no log of its own
    run_log.write_text("\n".join(_run_log(caplog)) + "\n")
    assert list(stages_account(run_log, {"one vocoder.batch=8": {}})) == ["one vocoder.batch=8"]
    assert stages_account(run_log, {"one vocoder.batch=16": {}}) == {}  # another run's log
