"""loadtest.offline_quality's scoring: words compared as a caller says them, and the word error
rate over them."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.offline_quality import (
    CONDITIONS,
    ROOT,
    encoder_settings,
    errors,
    right,
    spelled,
    table,
    with_noise,
    words,
)
from loadtest.spoken_questions import PARTS


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


def test_a_reply_is_right_when_it_holds_an_answer_word_whole() -> None:
    assert right("A week has 7 days.", ("seven",))
    assert right("Leaves turn red in the fall.", ("autumn", "fall"))
    assert right("There are twenty-four hours in a day.", ("twenty four",))
    assert not right("There are seventy days.", ("seven",))  # a word, not a part of one
    assert not right("", ("paris",))


def test_the_noisy_condition_is_its_signal_to_noise_ratio_below_the_speech() -> None:
    t = np.arange(48000) / 48000
    speech = np.concatenate([np.zeros(4800), 8000 * np.sin(2 * np.pi * 200 * t)])
    noisy = with_noise(speech.astype(np.int16), 20.0, seed=1).astype(np.float64)
    noise = noisy[:4800]  # where there was silence: the noise alone
    snr = 10 * np.log10(np.mean(speech[4800:] ** 2) / np.mean(noise**2))
    assert 19.0 < snr < 21.0


def test_the_parts_are_split_once_and_the_prompt_examples_are_in_neither() -> None:
    import yaml

    tuning, test = ({q for q, _ in PARTS[p]} for p in ("tuning", "test"))
    assert len(tuning) + len(test) >= 60 and not tuning & test
    offline = yaml.safe_load((ROOT / "configs" / "offline.yaml").read_text())
    examples = {e["user"] for e in offline["reasoning"].get("examples", [])}
    assert not examples & test  # a test question is never an example of the shipped prompt
    assert {c.name for c in CONDITIONS} >= {"piper", "piper noise 20 dB", "espeak:en-gb-x-rp phone"}


def test_the_table_counts_answers_as_heard_back_and_as_said() -> None:
    reply = {"question": "What is the capital of Norway?", "voice": "piper", "heard": "x"}
    results = {
        "encoders": [
            {
                "settings": {"encoder.backend": "ctranslate2"},
                "conditions": {},
                "answers": [
                    reply | {"heard_back": "also", "right": False, "right_said": True},
                    reply | {"heard_back": "Oslo", "right": True, "right_said": True},
                ],
            }
        ]
    }
    text = table(results)
    assert "answers right: 1 of 2 as heard back, 2 as said" in text
    assert text.splitlines()[-2].endswith("| also | no / yes |")
