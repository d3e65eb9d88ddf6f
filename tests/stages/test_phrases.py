"""The phrase splitter: where a stream of text deltas is cut into phrases to speak."""

from __future__ import annotations

from stages.phrases import CHARS_PER_WORD, EarlyPhrase, PhraseSplitter


def spoken(splitter: PhraseSplitter, deltas: list[str]) -> list[str]:
    phrases = [p for d in deltas for p in splitter.feed(d)]
    if rest := splitter.flush():
        phrases.append(rest)
    return phrases


def test_the_first_phrase_goes_after_a_few_words_and_later_ones_at_punctuation() -> None:
    text = "Well I think the weather today is sunny, with a light breeze. Enjoy it!"
    phrases = spoken(PhraseSplitter(first_words=3, max_words=20), [w + " " for w in text.split()])
    assert phrases == [
        "Well I think",
        "the weather today is sunny,",
        "with a light breeze.",
        "Enjoy it!",
    ]


def test_a_word_still_growing_is_not_cut() -> None:
    splitter = PhraseSplitter(first_words=2)
    assert splitter.feed("Hello wor") == []
    assert splitter.feed("ld again") == ["Hello world"]
    assert splitter.flush() == "again"


def test_punctuation_before_the_word_limit_ends_the_first_phrase() -> None:
    assert spoken(PhraseSplitter(first_words=4), ["Yes, ", "of course."]) == ["Yes,", "of course."]


def test_full_width_punctuation_ends_a_phrase_with_no_space_after_it() -> None:
    deltas = ["今天", "天气", "很好，", "阳光", "明媚。", "出去", "走走吧！"]
    phrases = spoken(PhraseSplitter(first_words=4, max_words=20), deltas)
    assert phrases == ["今天天气很好，", "阳光明媚。", "出去走走吧！"]


def test_text_without_spaces_or_punctuation_is_cut_at_a_bounded_length() -> None:
    splitter = PhraseSplitter(first_words=3, max_words=5)
    text = "数" * 100
    phrases = spoken(splitter, list(text))
    assert [len(p) for p in phrases[:2]] == [3 * CHARS_PER_WORD, 5 * CHARS_PER_WORD]
    assert "".join(phrases) == text  # nothing lost or repeated


def test_a_long_run_is_cut_at_its_last_space() -> None:
    # two "words" of random tokens: the first ends in time, the second never does
    splitter = PhraseSplitter(first_words=3)
    first = splitter.feed("abcdefgh " + "x" * 20)
    assert first == ["abcdefgh"]
    assert splitter.flush() == "x" * 20


def test_a_boundary_past_the_length_limit_does_not_make_a_long_phrase() -> None:
    # a released early reply's text comes as one delta
    phrases = PhraseSplitter(first_words=2).feed("一二三四五六七八九十一二三四五六，好。")
    assert phrases == ["一二三四五六七八九十一二", "三四五六，", "好。"]


def test_the_words_so_far_are_taken_whole_and_the_growing_one_stays() -> None:
    splitter = PhraseSplitter(first_words=2, max_words=20)
    assert splitter.feed("The sky is blue because of a pro") == ["The sky"]
    assert splitter.take_words(at_least=8) is None  # five whole words: too few
    assert splitter.take_words(at_least=2) == "is blue because of a"
    assert splitter.feed("cess called scattering. Yes") == ["process called scattering."]
    assert splitter.flush() == "Yes"


def test_early_phrases_are_due_once_the_lead_is_under_the_low_water() -> None:
    early = EarlyPhrase(low_water_s=0.6)
    assert early.wait_s(2.0) == 1.4
    assert early.wait_s(0.5) == 0.0
    assert EarlyPhrase(low_water_s=0).wait_s(0.0) is None  # off
