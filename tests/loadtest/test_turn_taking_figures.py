"""loadtest.turn_taking's figures from its trials: premature turns are left out of the latency,
and the turn's end is reported beside the first audio."""

from __future__ import annotations

import numpy as np
import pytest

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


def test_semantic_decisions_report_each_models_say_and_when_it_was_decided() -> None:
    from types import SimpleNamespace

    from gateway.metrics import GatewayMetrics
    from loadtest.turn_taking import _semantic_decisions

    metrics = GatewayMetrics()
    metrics.end_of_turn_decisions.labels("ended").inc()
    metrics.end_of_turn_decisions.labels("held").inc(2)
    metrics.end_of_turn.observe(0.040)
    metrics.end_of_turn.observe(0.060)
    metrics.end_of_turn_decided_after.labels("ended").observe(0.2)
    metrics.end_of_turn_probability.labels("sound", "ended").observe(0.93)
    metrics.end_of_turn_probability.labels("words", "held").observe(0.02)
    metrics.end_of_turn_words.labels("late").observe(0.3)
    out = _semantic_decisions(SimpleNamespace(metrics=metrics))
    assert out["ended"] == 1 and out["held"] == 2
    assert out["sound_model_mean_ms"] == 50.0
    assert out["decided_after_ended_mean_ms"] == 200.0
    assert out["words_late"] == 1 and out["words_late_mean_ms"] == 300.0
    # cumulative buckets: 0.93 is under 0.97 and 1.0, not under 0.9
    assert out["p_sound_ended"] == {"0.97": 1, "1.0": 1, "+Inf": 1}
    assert out["p_words_held"]["0.05"] == 1 and "0.01" not in out["p_words_held"]


def _heard(arrivals: list[float], levels: list[float]) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(speaker=SimpleNamespace(arrivals=arrivals, levels=levels))


def test_the_frame_log_is_read_from_the_time_asked_for() -> None:
    from loadtest.turn_taking import SILENT_RUN, _stopped_at, _voiced_frames

    loud, quiet = 1000.0, 0.0
    arrivals = [i * 0.02 for i in range(40)]
    # voiced 0-0.18 s, silent 0.2-0.38 s, voiced 0.4-0.58 s, silent from 0.6 s
    levels = [loud if (i // 10) % 2 == 0 and i < 30 else quiet for i in range(40)]
    call = _heard(arrivals, levels)
    assert _voiced_frames(call, 0.39) == arrivals[20:30]
    assert _voiced_frames(call, 0.7) == []
    assert _stopped_at(call, 0.0) == arrivals[10]  # the first run of SILENT_RUN silent frames
    assert _stopped_at(call, 0.21) == arrivals[30]
    assert _stopped_at(call, arrivals[-SILENT_RUN + 1]) is None  # too few frames after it


async def test_a_microphone_nobody_reads_is_a_call_whose_media_is_down(monkeypatch) -> None:
    from types import SimpleNamespace

    import numpy as np

    import loadtest.turn_taking as tt
    from gateway.client import Microphone

    monkeypatch.setattr(tt, "MEDIA_STALL_S", 0.05)
    microphone = Microphone()  # its track never started: no frame goes out
    call = SimpleNamespace(microphone=microphone)
    microphone.play(np.ones(4800, np.int16))
    assert microphone.queued_s == 0.1
    with pytest.raises(tt.MediaDown):
        await tt._clip_start(call, 0)
    with pytest.raises(tt.MediaDown):
        await tt._quiet(call)


async def test_callers_are_spread_over_processes_and_a_failed_one_counts_for_each() -> None:
    """Three callers in processes of two; nothing listens at the address, so each process
    fails, and every one of its callers gets one trial that says why."""
    import numpy as np

    from loadtest.turn_taking import Clip, _run_callers

    clip = Clip("question", "piper", "hello", np.zeros(4800, np.int16), 0.0, 0.1)
    trials = await _run_callers("http://127.0.0.1:9", 3, [clip], "server_vad", per_process=2)
    assert len(trials) == 3
    assert all(len(t) == 1 and t[0]["kind"] == "callers_process" for t in trials)
    assert all("Error" in t[0]["error"] for t in trials)  # the process's own traceback
    assert figures([t for caller in trials for t in caller])["errors"] == 3


def test_callers_play_the_set_in_orders_of_their_own_unless_in_step() -> None:
    from loadtest.turn_taking import START_SPREAD_S, Clip, caller_order

    clips = [Clip("question", "v", f"q{i}", np.zeros(1, np.int16), 0.0, 0.0) for i in range(12)]
    orders = [caller_order(clips, caller, in_step=False) for caller in range(8)]
    texts = [tuple(c.text for c in order) for order, _ in orders]
    assert all(sorted(t) == sorted(c.text for c in clips) for t in texts)  # the whole set
    assert len(set(texts)) == 8  # each its own order
    assert len({wait for _, wait in orders}) == 8
    assert all(0 <= wait <= START_SPREAD_S for _, wait in orders)
    assert caller_order(clips, 3, in_step=False)[0] == orders[3][0]  # the same next run
    assert caller_order(clips, 3, in_step=True) == (clips, 0.0)


async def test_an_ask_refused_for_a_reply_still_running_is_made_again() -> None:
    """The answer to the caller's last turn can start after the benchmark stopped waiting for
    it: the server refuses the next response.create, and the benchmark cancels that answer and
    asks again rather than counting an error."""
    import asyncio
    from types import SimpleNamespace

    from gateway.client import RealtimeCall
    from loadtest.turn_taking import _reply_started

    class Server:
        """Answers like the gateway: one reply still running, then none."""

        microphone = SimpleNamespace(busy=False, queued_s=0.0)
        next_event = RealtimeCall.next_event

        def __init__(self) -> None:
            self.events: asyncio.Queue = asyncio.Queue()
            self.running, self.sent = True, []

        def send(self, event: dict) -> None:
            self.sent.append(event["type"])
            if event["type"] == "response.cancel":
                if self.running:  # the benchmark then waits 1.5 s for another to start
                    done = {"id": "r1", "status": "cancelled"}
                    self.events.put_nowait({"type": "response.done", "response": done})
                else:
                    code = "response_cancel_not_active"
                    self.events.put_nowait({"type": "error", "error": {"code": code}})
                self.running = False
            elif self.running:
                code = "conversation_already_has_active_response"
                self.events.put_nowait({"type": "error", "error": {"code": code}})
            else:
                self.events.put_nowait({"type": "response.created", "response": {"id": "r2"}})

    server = Server()
    assert await _reply_started(server) == "r2"
    assert server.sent == ["response.create", "response.cancel", "response.create"]
