"""espeak-ng voice (libespeak-ng from the espeakng-loader wheel) speaking for real."""

from __future__ import annotations

import subprocess
import threading
import time

import numpy as np
import pytest

from stages.backends.asr_pocketsphinx import load_pocketsphinx
from stages.backends.speech import SpeechOptionError
from stages.backends.tts_espeak import EspeakVoice, load_espeak

pytestmark = pytest.mark.timeout(60)

LONG_TEXT = "This sentence is spoken again and again to make a long reply. " * 30


@pytest.fixture(scope="module")
def voice() -> EspeakVoice:
    return load_espeak()


def rms(pcm16: np.ndarray) -> float:
    return float(np.sqrt(np.mean(pcm16.astype(np.float64) ** 2)))


def test_speaks_a_sentence_quickly_in_small_chunks(voice):
    started = time.perf_counter()
    chunks = list(voice.synthesize("Hello world, this is the gateway speaking."))
    elapsed = time.perf_counter() - started

    assert voice.sample_rate == 22050
    assert all(c.dtype == np.int16 and c.ndim == 1 and 0 < len(c) <= 2205 for c in chunks)
    audio = np.concatenate(chunks)
    assert len(audio) / voice.sample_rate > 0.5
    assert rms(audio) > 500, "synthesized audio is silent"
    assert elapsed < 1.0, f"synthesis took {elapsed:.2f} s"


def test_first_chunk_comes_before_synthesis_is_complete(voice):
    started = time.perf_counter()
    first_at = None
    samples = 0
    for chunk in voice.synthesize(LONG_TEXT):
        if first_at is None:
            first_at = time.perf_counter() - started
        samples += len(chunk)
    total = time.perf_counter() - started

    assert samples / voice.sample_rate > 60, "the long text should be over a minute of speech"
    assert first_at is not None and first_at < total / 4, f"first {first_at:.3f} s of {total:.3f} s"


def test_closing_the_stream_aborts_synthesis_and_the_voice_stays_usable(voice):
    started = time.perf_counter()
    full = sum(len(c) for c in voice.synthesize(LONG_TEXT))
    full_time = time.perf_counter() - started

    started = time.perf_counter()
    speech = voice.synthesize(LONG_TEXT)
    next(speech)
    speech.close()  # what a CANCEL does: the synth thread is joined before close() returns
    cancel_time = time.perf_counter() - started

    assert cancel_time < full_time / 2, f"cancel {cancel_time:.3f} s, full {full_time:.3f} s"
    again = sum(len(c) for c in voice.synthesize(LONG_TEXT))
    # espeak-ng's output length varies by a few samples from run to run (seen: under 0.1%).
    assert again == pytest.approx(full, rel=0.01)


def test_concurrent_syntheses_do_not_mix(voice):
    texts = ["The first caller hears this.", "The second caller hears something else entirely."]
    alone = [sum(len(c) for c in voice.synthesize(t)) for t in texts]
    together: list[int | None] = [None, None]

    def speak(i: int) -> None:
        together[i] = sum(len(c) for c in voice.synthesize(texts[i]))

    threads = [threading.Thread(target=speak, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    # Interleaved callbacks would move audio between the two; lengths differ by 2x.
    assert together == [pytest.approx(n, rel=0.01) for n in alone]


def test_empty_text_yields_nothing(voice):
    assert list(voice.synthesize("  ")) == []


def test_speech_is_recognizable_by_pocketsphinx():
    """espeak backend -> sox resampling to 16 kHz -> PocketSphinx: most words survive the trip."""
    voice = load_espeak(voice="en-us+klatt", rate_wpm=140)
    pause = np.zeros(voice.sample_rate // 2, np.int16)
    speech = voice.synthesize("this is a test of the speech recognizer")
    audio = np.concatenate([pause, *speech, pause])
    resampled = subprocess.run(
        ["sox", "-t", "raw", "-r", "22050", "-e", "signed", "-b", "16", "-c", "1", "-",
         "-t", "raw", "-r", "16000", "-"],
        input=audio.tobytes(),
        capture_output=True,
        check=True,
    ).stdout  # fmt: skip
    stream = load_pocketsphinx().open_stream()
    stream.feed(np.frombuffer(resampled, dtype=np.int16))
    heard = set(stream.finish().split())
    assert len(heard & {"this", "is", "test", "of", "speech", "recognizer"}) >= 3, heard


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"voice": "xx-nonexistent"}, "voice='xx-nonexistent'"),
        ({"rate_wpm": 20}, "rate_wpm=20"),
        ({"pitch": 101}, "pitch=101"),
        ({"chunk_ms": 500}, "chunk_ms=500"),
        ({"speed": 200}, "'speed'"),
    ],
)
def test_bad_options_are_named(options, named):
    with pytest.raises(SpeechOptionError, match=named):
        load_espeak(**options)


def test_stop_aborts_synthesis_at_the_next_buffer(voice):
    full = sum(len(c) for c in voice.synthesize(LONG_TEXT))
    stopped = threading.Event()
    got = 0
    for chunk in voice.synthesize(LONG_TEXT, stop=stopped.is_set):
        got += len(chunk)
        stopped.set()  # asked before the next buffer goes out
    assert 0 < got < full / 10
