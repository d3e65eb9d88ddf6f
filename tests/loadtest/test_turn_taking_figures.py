"""loadtest.turn_taking's figures from its trials: premature turns are left out of the latency,
and the turn's end is reported beside the first audio."""

from __future__ import annotations

from loadtest.turn_taking import figures, table


def question(kind: str, first: float | None, end: float | None, premature: bool = False) -> dict:
    return {
        "kind": kind,
        "premature": premature,
        "first_audio_ms": first,
        "turn_end_ms": end,
    }


def test_first_audio_and_turn_end_leave_out_premature_and_unanswered_turns() -> None:
    trials = [
        question("question", 300.0, 220.0),
        question("paused_300", 500.0, 480.0),
        question("paused_700", 100.0, -600.0, premature=True),
        question("question", None, 210.0),  # never answered
        {"kind": "interruption", "cancelled": True, "paused": True, "stop_ms": 90.0},
    ]
    out = figures(trials)
    assert out["first_audio_ms"]["n"] == 2 and out["first_audio_ms"]["max"] == 500.0
    assert out["turn_end_ms"]["n"] == 2 and out["turn_end_ms"]["max"] == 480.0
    assert out["unanswered"] == 1 and out["premature_paused_700"] == "1/1"
    assert out["missed_barge_ins"] == "0/1" and out["barge_in_ms"]["n"] == 1
    results = {
        "machine": {"cpus": 2, "gpus": []},
        "config": "configs/offline.yaml",
        "callers": [1],
        "policies": {
            "provisional:webrtc": {"semantic_vad 1": {"figures": out, "loop_lag_p99_ms": 5}}
        },
    }
    row = table(results).splitlines()[-1]
    assert f"| {out['turn_end_ms']['p50']} / {out['turn_end_ms']['p95']} |" in row
