"""loadtest.offline_quality's scoring: words compared as a caller says them, and the word error
rate over them."""

from __future__ import annotations

import pytest

from loadtest.offline_quality import encoder_settings, errors, spelled, words


@pytest.mark.parametrize(
    ("n", "said"),
    [(0, "zero"), (7, "seven"), (23, "twenty three"), (40, "forty"), (115, "one hundred fifteen")],
)
def test_numbers_are_spelled_as_said(n: int, said: str) -> None:
    assert spelled(n) == said


def test_times_and_phone_numbers_read_as_a_caller_says_them() -> None:
    assert words("Meet at 9.30, Dr. Who!") == ["meet", "at", "nine", "thirty", "doctor", "who"]
    assert words("Call 555-1234") == ["call", "five", "five", "five", "one", "two", "three", "four"]
    assert words("It is 23 degrees.") == words("It is twenty three degrees")


def test_the_error_count_is_the_word_edit_distance() -> None:
    assert errors("the cat sat on the mat", "the cat sat on the mat") == (0, 6)
    assert errors("the cat sat on the mat", "a cat sat on mat") == (2, 6)  # one swap, one drop
    assert errors("turn off the lights", "turn off the lights please") == (1, 4)  # one added
    assert errors("hello", "") == (1, 1)


def test_an_encoder_is_named_by_its_backend_and_model() -> None:
    assert encoder_settings("pocketsphinx") == {
        "encoder.backend": "pocketsphinx",
        "encoder.options": {},  # not Whisper's
    }
    assert encoder_settings("ctranslate2=bundled:whisper-base") == {
        "encoder.backend": "ctranslate2",
        "encoder.model": "bundled:whisper-base",
    }
