"""Turn-taking end to end: semantic_vad with the real end-of-turn model (Smart Turn v3.2),
Silero VAD, provisional interruptions and idle_timeout_ms, over aiortc calls on 127.0.0.1 with
real Opus, and the three stages on real rings (Whisper tiny.en on CTranslate2, vLLM on the
tiny chat model, espeak-ng)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from gateway.app import gateway_of
from gateway.client import RealtimeCall
from gateway.config import load_config
from loadtest.offline_quality import speak
from loadtest.sounds import cough, noise_burst
from stages.audio import resample

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"
SILENT_RMS = 30.0  # Opus silence decodes to a few LSBs
LEAD_S = 0.3  # the silence before a clip's speech (loadtest.offline_quality.speak)


@pytest.fixture(scope="module")
def config():
    return load_config(
        TINY,
        {
            "encoder.backend": "ctranslate2",
            "encoder.model": "bundled:whisper-tiny.en",
            "encoder.options": {"cpu_threads": 2, "beam_size": 5},
            "encoder.partial_interval_ms": 0,
            "reasoning.sampling": {"max_tokens": 160, "ignore_eos": True},
            "gateway.turns.interruptions.policy": "provisional",
            "gateway.turns.vad.classifier": "silero",
            # semantic_vad asks after 100 ms of pause, not 200: on a 2-core machine the sound
            # model takes 50-300 ms of a core, contended by Whisper transcribing at that pause,
            # and the finished question must be ended inside the 500 ms window with room to spare
            "gateway.turns.end_of_turn.ask_after_ms": 100,
            "gateway.port": 0,
        },
    )


@pytest.fixture(scope="module")
def piper():
    """Sentences in the bundled Piper voice (a human one: espeak's robotic prosody rarely
    sounds finished to the end-of-turn model), 48 kHz, with silence around them."""
    return lambda text: speak([text], "piper")[0]


def at48k(pcm16k: np.ndarray) -> np.ndarray:
    return resample(pcm16k, 16000, 48000)


def speech48k(recording) -> np.ndarray:
    pcm = recording.pcm16
    return at48k(pcm[int(np.argmax(np.abs(pcm) > 500)) :])


def voiced_since(call: RealtimeCall, since: float) -> list[float]:
    """Arrival times of the agent's voiced frames after `since`."""
    return [
        t
        for t, level in zip(call.speaker.arrivals, call.speaker.levels, strict=True)
        if t >= since and level > SILENT_RMS
    ]


async def agent_speaking(call: RealtimeCall) -> None:
    """Until the agent's voice reaches the caller."""
    await call.next_event("output_audio_buffer.started", timeout=60)
    deadline = time.monotonic() + 20
    while len(voiced_since(call, time.monotonic() - 0.1)) < 3:
        assert time.monotonic() < deadline, "the agent's audio never came"
        await asyncio.sleep(0.02)  # polling the receiver's frame log


def end_silence(app, kind: str) -> tuple[float, float]:
    """(count, sum) of the silences that ended turns under `kind`."""
    registry = gateway_of(app).metrics.registry
    labels = {"type": kind}
    count = registry.get_sample_value("omni_turn_end_silence_seconds_count", labels) or 0.0
    total = registry.get_sample_value("omni_turn_end_silence_seconds_sum", labels) or 0.0
    return count, total


def decided(app, decision: str) -> float:
    """How many pauses semantic_vad decided as `decision` (gateway metrics)."""
    registry = gateway_of(app).metrics.registry
    labels = {"decision": decision}
    return registry.get_sample_value("omni_end_of_turn_decisions_total", labels) or 0.0


async def test_semantic_vad_ends_a_finished_question_before_the_silence_window(
    server, piper
) -> None:
    """The same finished question, once under server_vad and once under semantic_vad: the
    end-of-turn model ends the turn after a short pause, where server_vad waits its 500 ms."""
    base, app = server
    question = piper("What is the capital of France?")
    silences = {}
    for kind in ("server_vad", "semantic_vad"):
        call = await RealtimeCall.connect(base)
        try:
            await call.next_event("session.created")
            td = {"type": kind} if kind == "server_vad" else {"type": kind, "eagerness": "high"}
            call.send(
                {"type": "session.update", "session": {"audio": {"input": {"turn_detection": td}}}}
            )
            updated = await call.next_event("session.updated")
            assert updated["session"]["audio"]["input"]["turn_detection"]["type"] == kind
            before = end_silence(app, kind)
            ended_before = decided(app, "ended")
            call.microphone.play(question)
            await call.next_event("input_audio_buffer.speech_stopped", timeout=20)
            count, total = end_silence(app, kind)
            assert count == before[0] + 1
            silences[kind] = total - before[1]
            # the end-of-turn model's say is counted for semantic_vad only, once a pause
            assert decided(app, "ended") - ended_before == (kind == "semantic_vad")
            await call.next_event("response.created", timeout=30)
        finally:
            await call.close()
    print(f"\nsilence that ended the turn: {silences}")
    assert silences["server_vad"] == pytest.approx(0.5, abs=0.021)
    assert silences["semantic_vad"] < 0.45


async def test_semantic_vad_is_refused_with_a_bad_eagerness(server) -> None:
    base, _ = server
    call = await RealtimeCall.connect(base)
    try:
        await call.next_event("session.created")
        td = {"type": "semantic_vad", "eagerness": "eager"}
        call.send(
            {"type": "session.update", "session": {"audio": {"input": {"turn_detection": td}}}}
        )
        error = await call.next_event("error")
        assert "eagerness" in error["error"]["param"]
    finally:
        await call.close()


@pytest.mark.parametrize("sound", ["cough", "noise", "mm hmm"])
async def test_a_sound_over_the_agent_does_not_stop_it(server, piper, sound) -> None:
    """A cough, a noise burst or a backchannel over the agent: either the VAD never calls it
    speech, or it pauses the agent, whose audio then goes on from where it paused; the reply
    is never cancelled and the sound never becomes a turn."""
    base, app = server
    clips = {
        "cough": at48k(cough(seed=1)),
        "noise": at48k(noise_burst(250, -20.0, seed=2)),
        "mm hmm": piper("Mm hmm."),
    }
    call = await RealtimeCall.connect(base)
    try:
        await call.next_event("session.created")
        # long enough to speak over and play on after the sound (about 8 s), not the module's
        # 160 tokens, which this test would hear to the end
        call.send({"type": "response.create", "response": {"max_output_tokens": 32}})
        await agent_speaking(call)
        onset = time.monotonic()
        call.microphone.play(clips[sound])
        clip_s = len(clips[sound]) / 48000
        done = await call.next_event("response.done", timeout=60)
        types = [e["type"] for _, e in call.history]
        assert done["response"]["status"] == "completed", str(
            [(e["type"], e.get("transcript")) for _, e in call.history if "delta" not in e["type"]]
        )
        assert "output_audio_buffer.cleared" not in types
        assert "omni.response.cancelled" not in types
        assert "input_audio_buffer.committed" not in types  # no turn of the conversation
        if "input_audio_buffer.speech_started" in types:
            (resumed,) = [e for _, e in call.history if e["type"] == "omni.interruption.resumed"]
            assert resumed["response_id"] == done["response"]["id"]
        # the agent was heard again after the sound
        await call.next_event("output_audio_buffer.stopped", timeout=60)
        assert voiced_since(call, onset + clip_s + 0.5), "the agent did not play on"
        session = gateway_of(app).calls[call.call_id]
        assert [item.role for item in session.items] == ["assistant"]
        print(f"\n{sound}: the VAD started a turn: {'input_audio_buffer.speech_started' in types}")
    finally:
        await call.close()


async def test_words_over_the_agent_interrupt_it_and_are_answered(server, piper) -> None:
    """Real words over the agent: it is silenced at once, the reply is cut where it paused,
    and the caller's words are committed and answered."""
    base, app = server
    words = piper("Stop please, what time is it?")
    call = await RealtimeCall.connect(base)
    try:
        await call.next_event("session.created")
        call.send({"type": "response.create"})
        first = await call.next_event("response.created", timeout=30)
        await agent_speaking(call)
        onset = time.monotonic()
        call.microphone.play(words)
        done = await call.next_event("response.done", timeout=30)
        assert done["response"]["id"] == first["response"]["id"]
        assert done["response"]["status"] == "cancelled"
        while True:  # the answer to their words is heard
            started = await call.next_event("output_audio_buffer.started", timeout=30)
            if started["response_id"] != first["response"]["id"]:
                break
        seen = [e for _, e in call.history]
        committed = [e for e in seen if e["type"] == "input_audio_buffer.committed"]
        assert len(committed) == 1
        heard = [
            e["transcript"].lower()
            for e in seen
            if e["type"] == "conversation.item.input_audio_transcription.completed"
        ]
        assert len(heard) == 1 and "time" in heard[0], heard
        created = [e["response"]["id"] for e in seen if e["type"] == "response.created"]
        assert created == [first["response"]["id"], started["response_id"]]
        # silent from soon after the onset until the answer began (a frame or two may slip
        # out while the VAD's first decisions flicker)
        answer_at = next(t for t, e in call.history if e is started)
        talked_over = [t for t in voiced_since(call, onset + LEAD_S + 0.15) if t < answer_at]
        assert len(talked_over) <= 2, f"the agent went on for {len(talked_over)} frames"
        session = gateway_of(app).calls[call.call_id]
        assert [item.role for item in session.items][:3] == ["assistant", "user", "assistant"]
    finally:
        await call.close()


async def test_idle_timeout_commits_an_empty_turn_and_answers_it(server) -> None:
    base, _ = server
    call = await RealtimeCall.connect(base)
    try:
        await call.next_event("session.created")
        td = {"type": "server_vad", "idle_timeout_ms": 1000}
        call.send(
            {"type": "session.update", "session": {"audio": {"input": {"turn_detection": td}}}}
        )
        await call.next_event("session.updated")
        call.send({"type": "response.create", "response": {"max_output_tokens": 8}})
        stopped = await call.next_event("output_audio_buffer.stopped", timeout=60)
        heard_at = time.monotonic()
        triggered = await call.next_event("input_audio_buffer.timeout_triggered", timeout=10)
        waited = time.monotonic() - heard_at
        assert 0.9 < waited < 3.0, waited
        assert triggered["audio_end_ms"] - triggered["audio_start_ms"] >= 900
        committed = await call.next_event("input_audio_buffer.committed", timeout=5)
        assert committed["item_id"] == triggered["item_id"]
        answer = await call.next_event("response.created", timeout=10)
        assert answer["response"]["id"] != stopped["response_id"]
    finally:
        await call.close()
