"""The offline profile (configs/offline.yaml) with its real models, end to end: a caller asks
questions aloud over WebRTC (real aiortc peers on 127.0.0.1, real Opus) and hears correct
spoken answers, Whisper tiny.en hearing them, SmolLM2 on vLLM answering, the Piper voice
speaking; and a question paused mid-sentence stays one turn under semantic_vad."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from gateway.client import RealtimeCall
from gateway.config import load_config
from gateway.turns.smart_turn import SmartTurnModel
from loadtest.offline_quality import speak
from stages.audio import resample, write_wav
from stages.backends import bundled
from stages.backends.asr_ctranslate2 import load_ctranslate2_whisper
from stages.backends.tts_piper import load_piper

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

OFFLINE = Path(__file__).parents[2] / "configs" / "offline.yaml"
# (question, a word the right answer holds)
QUESTIONS = [
    ("What is the capital of France?", "paris"),
    ("How many days are there in a week?", "seven"),
]


@pytest.fixture(scope="module")
def config():
    return load_config(OFFLINE, {"gateway.port": 0, "max_sessions": 8})


@pytest.fixture(scope="module")
def ear():
    """A recognizer of the test's own, for what the caller heard."""
    return load_ctranslate2_whisper(bundled.resolve("bundled:whisper-tiny.en"), cpu_threads=1)


def words(text: str) -> str:
    # Whisper writes a spoken number as digits, and may run it into the word before ("S7")
    text = re.sub(r"(?<![0-9])7(?![0-9])", " seven ", text.lower())
    return " ".join(re.sub(r"[^a-z' ]", " ", text).split())


async def test_spoken_questions_get_correct_spoken_answers(server, ear, tmp_path) -> None:
    base, _ = server
    voice = load_piper(bundled.resolve("bundled:piper-en_US-joe-medium"))
    call = await RealtimeCall.connect(base)
    try:
        for question, answer in QUESTIONS:
            pcm = np.concatenate(list(voice.synthesize(question)))
            silence = np.zeros(voice.sample_rate // 2, np.int16)
            wav = tmp_path / "question.wav"
            write_wav(wav, np.concatenate([silence, pcm, silence]), voice.sample_rate)
            heard_from = len(call.speaker.pcm())
            call.send_file(str(wav))
            heard = await call.next_event(
                "conversation.item.input_audio_transcription.completed", timeout=60
            )
            assert words(question) in words(heard["transcript"]), heard["transcript"]
            done = await call.next_event("response.done", timeout=90)
            (item,) = done["response"]["output"]
            said = item["content"][0]["transcript"]
            assert done["response"]["status"] == "completed", done
            assert answer in words(said), said
            await call.next_event("output_audio_buffer.stopped", timeout=60)
            spoken = call.speaker.pcm()[heard_from:]
            assert answer in words(ear.transcribe(resample(spoken, 48000, 16000))), said
    finally:
        await call.close()


async def test_semantic_vad_holds_a_turn_whose_words_stop_mid_sentence(server) -> None:
    """semantic_vad weighs the words at the pause (the profile's encoder.end_of_turn_words):
    "Can you tell me the weather", a pause of 350 ms, "in Paris today?" in espeak's voice. The
    first half sounds finished to the end-of-turn model (checked here), but its words do not
    end a sentence, so the turn waits the silence window and the caller goes on inside it: one
    turn, the whole question."""
    base, _ = server
    first, rest = (
        speak([text], "espeak:en-us")[0]
        for text in ("Can you tell me the weather", "in Paris today?")
    )
    first = first[: np.flatnonzero(np.abs(first) > 500)[-1] + 1]  # its silence after, cut
    rest = rest[np.flatnonzero(np.abs(rest) > 500)[0] :]
    pause = np.zeros(48 * 350, np.int16)
    sounds = SmartTurnModel(bundled.resolve("bundled:smart-turn-v3.2"))
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
