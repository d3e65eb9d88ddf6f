"""The vocoder stage with a voice that batches (tiny random SpeechT5), in real processes on real
rings: replies of several sessions spoken together, one of them cancelled mid-phrase."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.config import load_config
from stages.link import EventQueues, PipelineLink
from stages.messages import Kind
from stages.supervisor import Supervisor
from tests.stages.stage_events import cancel_acks, wait_for

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"
SESSIONS = 3


@pytest.fixture(scope="module")
def config(tiny_speecht5):
    return load_config(
        TINY,
        {
            "reasoning.sampling": {"max_tokens": 24, "ignore_eos": True},
            "vocoder.backend": "speecht5",
            "vocoder.model": str(tiny_speecht5.model),
            "vocoder.vocoder": str(tiny_speecht5.vocoder),
            "vocoder.batch": SESSIONS,
            "vocoder.max_lead_ms": 600_000,
            "vocoder.options": {"maxlenratio": 4.0, "num_threads": 1},
        },
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_replies_of_several_sessions_are_spoken_together_and_one_cancelled_alone(
    supervisor: Supervisor, link: PipelineLink, events: EventQueues
) -> None:
    sessions = [link.open_session() for _ in range(SESSIONS)]
    victim, others = sessions[0], sessions[1:]
    try:
        for s in sessions:
            link.create_response(s, f"resp-{s}", text="say something")
        for s in sessions:
            assert wait_for(events, s, Kind.AUDIO_OUT, timeout=120).msg
        cancel_id, _ = link.cancel(victim, f"resp-{victim}")
        assert cancel_acks(events, victim, cancel_id) == {"encoder", "reasoning", "vocoder"}
        # the others' replies go on to their end
        for s in others:
            spoken, deadline = 0, time.monotonic() + 120
            while (ev := events.next(s, max(0.01, deadline - time.monotonic()))).kind not in (
                Kind.AUDIO_DONE,
                Kind.ERROR,
            ):
                if ev.kind is Kind.AUDIO_OUT:
                    spoken += len(ev.msg) // 2
            assert ev.kind is Kind.AUDIO_DONE, ev.msg
            assert (ev.msg.response_id, ev.msg.status) == (f"resp-{s}", "completed")
            assert spoken > 16000 * 0.5  # 24 tokens spoken at 16 ms a character
    finally:
        for s in sessions:
            link.close_session(s)
