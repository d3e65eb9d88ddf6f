"""loadtest.hearing's parts: its variants as written on the command line, the codecs that
bring a clip to the encoder as the gateway would get it, and a clip made a turn with a pause."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from loadtest.hearing import (
    SILENCE_MS,
    Variant,
    at_pause,
    parse_variants,
    through_opus,
    through_phone,
)


def test_variants_are_a_name_a_model_and_yaml_options() -> None:
    assert parse_variants("a=bundled:whisper-base,beam_size=5,initial_prompt=Hi there.; b=m") == [
        Variant("a", "bundled:whisper-base", {"beam_size": 5, "initial_prompt": "Hi there."}),
        Variant("b", "m", {}),
    ]
    for bad in ("=m", "a=", "a=m,beam_size", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="--variants"):
            parse_variants(bad)


def tone(rate: int, seconds: float) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)


@pytest.mark.parametrize(("carry", "rate"), [(through_opus, 48000), (through_phone, 8000)])
def test_a_clip_comes_out_at_16_khz_as_long_and_nearly_as_loud(carry, rate) -> None:
    clip = tone(rate, 1.0)
    out = carry(clip)
    assert abs(len(out) - 16000) <= 16000 * 0.03  # a codec's frame and filter delay at most
    level = np.sqrt(np.mean(out[4000:12000].astype(np.float64) ** 2))
    # aiortc's Opus takes a mono sender's frames as stereo, 3 dB down, as the gateway gets them
    assert 0.65 < level / (8000 / np.sqrt(2)) < 1.05


def test_a_clip_is_a_turn_whose_last_pause_leaves_the_windows_silence_to_come(make_speech):
    speech = make_speech("what is the capital of france").pcm16
    found = at_pause(speech, 80)
    assert found is not None
    turn, end, to_come = found
    # the turn runs on from its last pause until the window ends it: what is still to come
    assert end + to_come == len(turn)
    assert 0 < to_come <= (SILENCE_MS - 80) * 16  # 80 ms or more of the pause had passed
    quiet = np.abs(turn[end:].astype(np.int32)).max()
    assert quiet < 0.05 * np.abs(turn[:end].astype(np.int32)).max()  # the pause is silence
