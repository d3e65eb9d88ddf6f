"""semantic_vad weighing the caller's words with their sound, end to end: the encoder's words
model (the bundled SmolLM2-135M-Instruct) judges the turn so far at the caller's pause, over an
aiortc call on 127.0.0.1 with real Opus, the three stages on real rings (Whisper tiny.en on
CTranslate2, vLLM on the tiny chat model, espeak-ng) and the real end-of-turn model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gateway.client import RealtimeCall
from gateway.config import load_config
from gateway.end_of_turn import EndOfTurnModel
from loadtest.offline_quality import speak
from stages.audio import resample
from stages.backends import bundled
from tests.serving import WHISPER_TINY_EN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def config():
    return load_config(
        TINY,
        {
            **WHISPER_TINY_EN,
            "encoder.end_of_turn_words": "bundled:smollm2-135m-instruct",
            "gateway.prepare_reply_ms": 150,
            "gateway.port": 0,
        },
    )


async def test_semantic_vad_holds_a_turn_whose_words_stop_mid_sentence(server) -> None:
    """ "Can you tell me the weather", a pause of 350 ms, "in Paris today?" in espeak's voice:
    the first half sounds finished to the end-of-turn model (checked here), but its words do
    not end a sentence, so the turn waits the silence window and the caller goes on inside
    it: one turn, the whole question."""
    base, _ = server
    first, rest = (
        speak([text], "espeak:en-us")[0]
        for text in ("Can you tell me the weather", "in Paris today?")
    )
    first = first[: np.flatnonzero(np.abs(first) > 500)[-1] + 1]  # its silence after, cut
    rest = rest[np.flatnonzero(np.abs(rest) > 500)[0] :]
    pause = np.zeros(48 * 350, np.int16)
    sounds = EndOfTurnModel(bundled.resolve("bundled:smart-turn-v3.2"))
    heard = resample(first[14400:], 48000, 16000)
    assert sounds.probability(np.concatenate([heard, np.zeros(3200, np.int16)])) >= 0.5
    call = await RealtimeCall.connect(base)
    try:
        await call.next_event("session.created")
        td = {"type": "semantic_vad", "eagerness": "high"}  # ends at 0.5: this sound would
        call.send(
            {"type": "session.update", "session": {"audio": {"input": {"turn_detection": td}}}}
        )
        await call.next_event("session.updated")
        call.microphone.play(np.concatenate([first, pause, rest]))
        done = await call.next_event(
            "conversation.item.input_audio_transcription.completed", timeout=30
        )
        stopped = [e for _, e in call.history if e["type"] == "input_audio_buffer.speech_stopped"]
        assert len(stopped) == 1, "the turn ended inside the pause"
        assert "paris" in done["transcript"].lower(), done["transcript"]
        assert "weather" in done["transcript"].lower(), done["transcript"]
    finally:
        await call.close()
