"""PocketSphinx recognizer on real speech (espeak-ng recordings), fed as the encoder feeds it.

PocketSphinx is weak on synthetic speech, so transcripts are compared loosely: some of the
sentence's words must come out, not all of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np
import pytest

from stages.backends.asr_pocketsphinx import PocketSphinxRecognizer, load_pocketsphinx
from stages.backends.speech import (
    SpeechModelNotFoundError,
    SpeechOptionError,
    StreamClosedError,
)

pytestmark = pytest.mark.timeout(60)

# Of the sentences tried, the one PocketSphinx gets most consistently ("this is a test of the city
# to recognize earth"); its output drifts from turn to turn as the decoder's live CMN adapts.
SENTENCE = "this is a test of the speech recognizer"
WORDS = {"this", "is", "test", "of", "speech", "recognizer"}


def chunks_of(pcm16: np.ndarray, samples: int = 3200) -> Iterator[np.ndarray]:
    """The gateway's 200 ms chunks."""
    for start in range(0, len(pcm16), samples):
        yield pcm16[start : start + samples]


def recognized(text: str) -> set[str]:
    return WORDS & set(text.lower().split())


@pytest.fixture(scope="module")
def recognizer() -> PocketSphinxRecognizer:
    return load_pocketsphinx()


def test_streams_partials_then_final_transcript(recognizer, make_speech):
    speech = make_speech(SENTENCE)
    stream = recognizer.open_stream()
    partials = [p for chunk in chunks_of(speech.pcm16) if (p := stream.feed(chunk)) is not None]
    final = stream.finish()

    assert partials, "no partial transcript while the sentence was fed"
    assert all(a != b for a, b in itertools.pairwise(partials)), partials
    assert len(recognized(final)) >= 3, f"heard {final!r} for {SENTENCE!r}"
    assert recognizer.sample_rate == 16000


def test_cancelled_turn_returns_its_decoder_and_the_next_turn_is_clean(recognizer, make_speech):
    speech = make_speech(SENTENCE)
    made = recognizer.decoders
    stream = recognizer.open_stream()
    for chunk in list(chunks_of(speech.pcm16))[:6]:
        stream.feed(chunk)
    stream.close()
    stream.close()  # idempotent

    assert recognizer.idle_decoders == made
    with pytest.raises(StreamClosedError):
        stream.feed(speech.pcm16[:3200])
    with pytest.raises(StreamClosedError):
        stream.finish()

    next_turn = recognizer.open_stream()
    for chunk in chunks_of(speech.pcm16):
        next_turn.feed(chunk)
    final = next_turn.finish()
    assert len(recognized(final)) >= 3, f"heard {final!r} for {SENTENCE!r}"
    assert recognizer.decoders == made, "a turn after a cancel made a new decoder"


def test_concurrent_turns_get_their_own_decoders(recognizer):
    first, second = recognizer.open_stream(), recognizer.open_stream()
    assert recognizer.decoders >= 2
    silence = np.zeros(3200, dtype=np.int16)
    first.feed(silence)
    second.feed(silence)
    assert first.finish() == ""
    second.close()
    assert recognizer.idle_decoders == recognizer.decoders


def test_feed_rejects_audio_that_is_not_int16_mono(recognizer):
    stream = recognizer.open_stream()
    try:
        with pytest.raises(TypeError, match="int16"):
            stream.feed(np.zeros(3200, dtype=np.float32))
        with pytest.raises(ValueError, match="mono"):
            stream.feed(np.zeros((1600, 2), dtype=np.int16))
    finally:
        stream.close()


def test_unknown_option_is_named():
    with pytest.raises(SpeechOptionError, match=r"'beem'.*'beam'"):
        load_pocketsphinx(beem=1e-40)


def test_missing_model_path_is_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SpeechModelNotFoundError, match=r"hmm.*no-such-model"):
        load_pocketsphinx(hmm=str(missing))


def test_sample_rate_other_than_16k_is_refused():
    with pytest.raises(SpeechOptionError, match="samprate=8000"):
        load_pocketsphinx(samprate=8000)
    with pytest.raises(SpeechOptionError, match="pool_size"):
        load_pocketsphinx(pool_size=0)


def test_peek_gives_the_final_so_far_and_the_turn_can_go_on(make_speech):
    first, second = make_speech("tell me something nice"), make_speech("about the weather")

    # a fresh decoder each time: pocketsphinx adapts to the audio a decoder heard before, and
    # even fresh decoders in different runs did not always agree word for word, so only one
    # stream's own results are compared exactly
    def fresh():
        return load_pocketsphinx().open_stream()

    # the turn ends at the peek: finish returns what peek said, with no second search
    stream = fresh()
    for chunk in chunks_of(first.pcm16):
        stream.feed(chunk)
    early = stream.peek()
    assert early and early == stream.peek()
    assert stream.finish() == early

    # the caller goes on after the peek: the whole turn is decoded, the second half included
    stream = fresh()
    for chunk in chunks_of(first.pcm16):
        stream.feed(chunk)
    first_half = stream.peek()
    for chunk in chunks_of(second.pcm16):
        stream.feed(chunk)
    whole = stream.finish()
    assert len(whole.split()) > len(first_half.split()), (first_half, whole)
    peeked = fresh()
    peeked.feed(first.pcm16)
    peeked.peek()
    peeked.close()  # a peeked turn closes without a second end of utterance
