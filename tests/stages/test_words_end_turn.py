"""The end-of-turn words model, for real: the bundled SmolLM2-135M-Instruct tells words that
stop mid-sentence from words that end one (stages.backends.words_end_turn)."""

from __future__ import annotations

import time

import pytest

from stages.backends import bundled
from stages.backends.speech import SpeechModelNotFoundError
from stages.backends.words_end_turn import WordsEndTurn, load_words_end_turn

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

# (cut where the labelled set's pauses cut them, the whole question): Whisper's punctuation
# on the cut half is what a recognizer adds at a pause, and is taken off before judging
SENTENCES = [
    ("How many legs.", "How many legs does a spider have?"),
    ("What time does the train", "What time does the train to Berlin leave?"),
    ("Which season comes?", "Which season comes after winter?"),
    ("Can you tell me the weather", "Can you tell me the weather in Paris today?"),
]


@pytest.fixture(scope="module")
def words() -> WordsEndTurn:
    return load_words_end_turn(bundled.resolve("bundled:smollm2-135m-instruct"))


@pytest.mark.parametrize(("cut", "whole"), SENTENCES)
def test_cut_off_words_read_unfinished_and_whole_ones_finished(
    words: WordsEndTurn, cut: str, whole: str
) -> None:
    started = time.perf_counter()
    p_cut, p_whole = words.probability(cut), words.probability(whole)
    took_ms = (time.perf_counter() - started) * 500
    print(f"\n{cut!r} {p_cut:.4f}, {whole!r} {p_whole:.3f} ({took_ms:.0f} ms a judgement)")
    assert p_cut is not None and p_whole is not None
    assert p_cut < 0.05 <= 0.2 <= p_whole  # gateway.session.turns' WORDS_CUT_OFF, _FINISHED


def test_punctuation_the_recognizer_added_does_not_decide(words: WordsEndTurn) -> None:
    assert words.probability("How many legs?") == pytest.approx(words.probability("How many legs"))


def test_no_words_is_no_judgement(words: WordsEndTurn) -> None:
    assert words.probability("") is None
    assert words.probability("  ... ") is None


def test_the_end_of_a_message_counts_as_a_sentence_end(words: WordsEndTurn) -> None:
    tokenizer = words.tokenizer
    ends = set(words.end_ids.tolist())
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ends
    assert {tokenizer.convert_tokens_to_ids(t) for t in ("?", ".", "!")} <= ends
    assert tokenizer.convert_tokens_to_ids("the") not in ends


def test_a_missing_model_is_named(tmp_path) -> None:
    with pytest.raises(SpeechModelNotFoundError, match="end-of-turn words model"):
        load_words_end_turn(str(tmp_path / "nothing-here"))
