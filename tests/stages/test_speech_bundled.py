"""The offline profile's real speech models, for real: Whisper tiny.en through CTranslate2
(stages.backends.asr_ctranslate2) hears what the Piper voice (stages.backends.tts_piper) says,
and an espeak-ng recording, word for word."""

from __future__ import annotations

import re

import numpy as np
import pytest

from stages.audio import resample
from stages.backends import bundled
from stages.backends.asr_ctranslate2 import CTranslate2Whisper, load_ctranslate2_whisper
from stages.backends.speech import SpeechModelNotFoundError, SpeechOptionError
from stages.backends.tts_piper import PiperVoice, load_piper

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def whisper() -> CTranslate2Whisper:
    return load_ctranslate2_whisper(
        bundled.resolve("bundled:whisper-tiny.en"), partial_interval_ms=1000
    )


@pytest.fixture(scope="module")
def piper() -> PiperVoice:
    # no sampling noise: the same sentence is said the same way every run (with it, "Paris"
    # was heard as "pairs" once in three suites)
    return load_piper(
        bundled.resolve("bundled:piper-en_US-joe-medium"), noise_scale=0.0, noise_w=0.0
    )


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower().replace("dr.", "doctor")).split()


@pytest.mark.parametrize(
    "text",
    [
        "It is 42 degrees in Paris today.",
        "Would you like to book a table for two people tonight?",
        "Hello, my name is Doctor Elizabeth Johnson. How can I help?",
    ],
)
def test_whisper_hears_every_word_the_piper_voice_says(whisper, piper, text) -> None:
    chunks = list(piper.synthesize(text))
    assert chunks and all(0 < len(c) <= piper.sample_rate // 10 for c in chunks)  # <= 100 ms
    audio = np.concatenate(chunks)
    assert np.sqrt(np.mean(audio.astype(np.float64) ** 2)) > 1000, "the voice is silent"
    heard = whisper.transcribe(resample(audio, piper.sample_rate, 16000))
    assert words(heard) == words(text), heard


def test_a_turn_streams_partials_and_its_final_transcript(whisper, make_speech) -> None:
    speech = make_speech("what is the weather like today in paris")
    stream = whisper.open_stream()
    partials = [
        partial
        for start in range(0, len(speech.pcm16), 3200)
        if (partial := stream.feed(speech.pcm16[start : start + 3200]))
    ]
    assert partials, "a partial every second of audio"
    assert words(partials[0])[:1] == ["what"]
    peeked = stream.peek()  # the transcript at a pause; the turn goes on
    final = stream.finish()
    assert peeked == final and words(final) == words(speech.text), final


def test_an_initial_prompt_is_read_before_the_turn_not_heard_in_it(piper) -> None:
    text = "Would you like to book a table for two people tonight?"
    prompted = load_ctranslate2_whisper(
        bundled.resolve("bundled:whisper-tiny.en"),
        initial_prompt="A caller asks the agent a short question.",
        warmup=False,
    )
    audio = resample(np.concatenate(list(piper.synthesize(text))), piper.sample_rate, 16000)
    heard = prompted.transcribe(audio)
    assert words(heard) == words(text), heard


def test_a_turn_decodes_as_faster_whisper_does_and_hears_it_padded_to_less(whisper, piper):
    text = "Hello, my name is Doctor Elizabeth Johnson. How can I help?"
    audio = resample(np.concatenate(list(piper.synthesize(text))), piper.sample_rate, 16000)
    segments, _ = whisper._model.transcribe(
        audio.astype(np.float32) / 32768,
        temperature=0.0,
        beam_size=1,
        without_timestamps=True,
        condition_on_previous_text=False,
        vad_filter=False,
    )
    assert whisper.transcribe(audio) == " ".join(s.text.strip() for s in segments).strip()
    padded = load_ctranslate2_whisper(
        bundled.resolve("bundled:whisper-tiny.en"), pad_to_s=10, warmup=False
    )
    assert words(padded.transcribe(audio)) == words(text)
    assert padded.transcribe(np.zeros(16000, np.int16)) == ""  # silence is no words


def test_the_piper_voice_stops_between_sentences_when_asked(piper) -> None:
    text = "One sentence here. Another one there. And a third to end with."
    asked = []

    def stop() -> bool:
        asked.append(True)
        return len(asked) > 1

    audio = np.concatenate(list(piper.synthesize(text, stop=stop)))
    whole = np.concatenate(list(piper.synthesize(text)))
    assert 0 < len(audio) < len(whole) / 2  # the first sentence only


def test_bad_options_and_paths_are_named(tmp_path) -> None:
    with pytest.raises(SpeechOptionError, match="cpu_threads"):
        load_ctranslate2_whisper(bundled.resolve("bundled:whisper-tiny.en"), cpu_threads=0)
    with pytest.raises(SpeechOptionError, match=r"pad_to_s=0.5 must be 1..30"):
        load_ctranslate2_whisper(bundled.resolve("bundled:whisper-tiny.en"), pad_to_s=0.5)
    with pytest.raises(SpeechOptionError, match="initial_prompt=3 must be text"):
        load_ctranslate2_whisper(bundled.resolve("bundled:whisper-tiny.en"), initial_prompt=3)
    with pytest.raises(SpeechOptionError, match="unknown piper option 'speed'"):
        load_piper(bundled.resolve("bundled:piper-en_US-joe-medium"), speed=2)
    with pytest.raises(SpeechModelNotFoundError, match=r"no voice\.onnx\.json beside it"):
        (tmp_path / "voice.onnx").write_bytes(b"")
        load_piper(str(tmp_path / "voice.onnx"))
    with pytest.raises(SpeechModelNotFoundError, match="does not exist"):
        load_piper(str(tmp_path / "missing.onnx"))
