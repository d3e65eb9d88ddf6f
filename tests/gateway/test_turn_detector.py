"""gateway.turns.detector and its classifiers: turn onsets and ends on real (espeak-ng) speech,
no turns from silence or noise."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from gateway.turns.classifiers import aggressiveness_for
from gateway.turns.detector import TurnDetector, VadEvent, VadPause, VadResume, VadStart, VadStop
from stages.messages import FRAME_MS, FRAME_SAMPLES

RATE = 16_000
SENTENCE = "Hello there, I would like to book a table for two people tonight."


def speech_bounds_ms(pcm: np.ndarray) -> tuple[float, float]:
    """Where the speech really is: 5 ms windows within 40 dB of the loudest one."""
    window = RATE // 200
    usable = pcm[: len(pcm) // window * window].astype(np.float64).reshape(-1, window)
    rms = np.sqrt((usable * usable).mean(axis=1))
    loud = np.nonzero(rms > 0.01 * rms.max())[0]
    return loud[0] * 5.0, (loud[-1] + 1) * 5.0


def with_silence(
    pcm: np.ndarray, before_ms: int, after_ms: int, noise: float, seed: int
) -> np.ndarray:
    """`pcm` between silences, plus white noise of std `noise`, cut to whole frames."""
    out = np.concatenate(
        [np.zeros(before_ms * RATE // 1000), pcm, np.zeros(after_ms * RATE // 1000)]
    )
    out = out + np.random.default_rng(seed).normal(0.0, noise, len(out))
    out = np.clip(out, -32768, 32767).astype(np.int16)
    return out[: len(out) // FRAME_SAMPLES * FRAME_SAMPLES]


def run(detector: TurnDetector, pcm: np.ndarray) -> list[tuple[int, VadEvent]]:
    """Feed frame by frame; each event with the audio time at which it came out."""
    events = []
    for frame in pcm.reshape(-1, FRAME_SAMPLES):
        events += [(detector.audio_ms, event) for event in detector.feed(frame)]
    return events


@pytest.fixture(scope="module")
def sentence(make_speech: Callable[[str], Any]) -> np.ndarray:
    """The spoken sentence alone, its recording's padding cut off (to the 5 ms)."""
    pcm = make_speech(SENTENCE).pcm16
    start, end = speech_bounds_ms(pcm)
    return pcm[int(start) * RATE // 1000 : int(end) * RATE // 1000]


def test_threshold_maps_onto_webrtcvad_modes_by_quarters() -> None:
    assert [aggressiveness_for(t) for t in (0.0, 0.24, 0.25, 0.5, 0.74, 0.75, 1.0)] == [
        0, 0, 1, 2, 2, 3, 3,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="threshold"):
        aggressiveness_for(1.5)


@pytest.mark.parametrize("noise", [0.0, 30.0, 100.0])
@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.9])
def test_one_turn_with_accurate_onset_and_end(
    sentence: np.ndarray, threshold: float, noise: float
) -> None:
    # 1010 ms: the speech starts mid-frame, as it would in a call.
    pcm = with_silence(sentence, 1010, 1500, noise, seed=int(noise))
    true_start, true_end = 1010, 1010 + len(sentence) * 1000 / RATE
    detector = TurnDetector(threshold=threshold)
    events = run(detector, pcm)

    assert [type(e) for _, e in events] == [VadStart, VadStop], events
    (started_at, start), (stopped_at, stop) = events
    assert isinstance(start, VadStart) and isinstance(stop, VadStop)
    print(
        f"\nthreshold {threshold} noise {noise:.0f}: "
        f"true speech {true_start:.0f}-{true_end:.0f} ms; "
        f"start {start.speech_start_ms} (event at {started_at}), "
        f"end {stop.speech_end_ms}, stopped at {stopped_at}"
    )
    # Onset: stamped within 60 ms of the truth (exact at the default threshold; the most
    # aggressive mode misses the quiet first frames) and reported once the hysteresis has passed.
    assert abs(start.speech_start_ms - true_start) <= 60
    assert started_at - start.speech_start_ms == detector.onset_ms
    assert start.audio_start_ms == start.speech_start_ms - 300
    assert len(start.prefix) == (started_at - start.audio_start_ms) * RATE // 1000
    # End: silence_duration_ms after the speech; the level gate cuts webrtcvad's ~100 ms hangover,
    # so the speech end is placed to within a frame.
    assert stop.audio_end_ms == stopped_at
    assert abs(stop.speech_end_ms - true_end) <= 40
    assert 500 - 20 <= stopped_at - true_end <= 500 + 60
    assert stopped_at - stop.speech_end_ms >= 500
    assert not detector.in_speech


def test_prefix_is_the_audio_before_the_start(sentence: np.ndarray) -> None:
    pcm = with_silence(sentence, 700, 600, 0.0, seed=0)
    detector = TurnDetector(prefix_padding_ms=200)
    (started_at, start), *_ = run(detector, pcm)
    assert isinstance(start, VadStart)
    begin = start.audio_start_ms * RATE // 1000
    assert start.speech_start_ms - start.audio_start_ms == 200
    np.testing.assert_array_equal(start.prefix, pcm[begin : started_at * RATE // 1000])


def test_pause_shorter_than_silence_duration_keeps_one_turn(sentence: np.ndarray) -> None:
    pause = np.zeros(300 * RATE // 1000, np.int16)
    pcm = with_silence(np.concatenate([sentence, pause, sentence]), 500, 1000, 30.0, seed=3)
    assert [type(e) for _, e in run(TurnDetector(), pcm)] == [VadStart, VadStop]


def test_two_turns_when_the_pause_is_longer(sentence: np.ndarray) -> None:
    pause = np.zeros(1200 * RATE // 1000, np.int16)
    pcm = with_silence(np.concatenate([sentence, pause, sentence]), 500, 1000, 30.0, seed=4)
    kinds = [type(e) for _, e in run(TurnDetector(silence_duration_ms=500), pcm)]
    assert kinds == [VadStart, VadStop, VadStart, VadStop]


def test_a_pause_is_reported_early_then_resumed_or_ended(sentence: np.ndarray) -> None:
    pause = np.zeros(350 * RATE // 1000, np.int16)
    pcm = with_silence(np.concatenate([sentence, pause, sentence]), 500, 1000, 30.0, seed=3)
    events = run(TurnDetector(silence_duration_ms=500, pause_ms=200), pcm)
    kinds = [type(e) for _, e in events]
    # one turn; inside it every pause of 200 ms or more (the 350 ms one, and the sentence's
    # own, at its comma) is reported and then resumed; the last one ends the turn 300 ms later
    assert kinds[0] is VadStart and kinds[-2:] == [VadPause, VadStop]
    inside = kinds[1:-2]
    assert len(inside) >= 2 and inside == [VadPause, VadResume] * (len(inside) // 2)
    (paused_at, paused), (stopped_at, stopped) = events[-2:]
    assert paused.speech_end_ms == stopped.speech_end_ms  # the same end of speech
    assert paused_at - paused.speech_end_ms == 200
    assert stopped_at - paused_at == 300 == paused.silence_to_come_ms
    # without pause_ms, the same audio gives only the turn
    kinds = [type(e) for _, e in run(TurnDetector(silence_duration_ms=500), pcm)]
    assert kinds == [VadStart, VadStop]
    with pytest.raises(ValueError, match="pause_ms"):
        TurnDetector(pause_ms=-1)


@pytest.mark.parametrize("noise", [0.0, 10.0, 30.0, 100.0])
@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0])
def test_no_turn_from_silence_or_low_noise(threshold: float, noise: float) -> None:
    """Digital silence and white noise up to -50 dBFS (std 100) for 5 s: no start, including
    the first frames, where webrtcvad's untrained noise model calls everything speech."""
    pcm = with_silence(np.zeros(0), 0, 5000, noise, seed=11)
    assert run(TurnDetector(threshold=threshold), pcm) == []


def test_no_turn_when_a_muted_microphone_comes_back() -> None:
    """Digital silence, then a faint noise floor (dither-level, -70 dBFS): webrtcvad calls the
    change speech for ~100 ms; the level gate keeps it out."""
    pcm = np.concatenate(
        [np.zeros(2 * RATE, np.int16), with_silence(np.zeros(0), 0, 3000, 10.0, 6)]
    )
    assert run(TurnDetector(threshold=0.0), pcm) == []


def test_short_blip_does_not_start_a_turn() -> None:
    """A 40 ms click is shorter than the 60 ms onset hysteresis."""
    t = np.arange(40 * RATE // 1000) / RATE
    blip = 8000 * np.sin(2 * np.pi * 300 * t) * np.sin(np.pi * t / t[-1])
    pcm = with_silence(blip, 1000, 1000, 10.0, seed=5)
    assert run(TurnDetector(), pcm) == []


def test_reset_forgets_a_turn_in_progress_and_keeps_the_clock(sentence: np.ndarray) -> None:
    pcm = with_silence(sentence, 700, 0, 0.0, seed=0)
    detector = TurnDetector()
    events = run(detector, pcm[: len(pcm) // 2 // FRAME_SAMPLES * FRAME_SAMPLES])
    assert [type(e) for _, e in events] == [VadStart] and detector.in_speech
    fed = detector.audio_ms
    detector.reset()
    assert not detector.in_speech and detector.audio_ms == fed


def test_update_changes_knobs_mid_session() -> None:
    detector = TurnDetector()
    detector.update(silence_duration_ms=200, prefix_padding_ms=0)
    assert detector.silence_duration_ms == 200 and detector.prefix_padding_ms == 0
    assert detector.threshold == 0.5
    with pytest.raises(ValueError, match="onset_ms"):
        detector.update(onset_ms=0)


def test_rejects_frames_of_the_wrong_shape() -> None:
    detector = TurnDetector()
    with pytest.raises(ValueError, match="320 int16"):
        detector.feed(np.zeros(480, np.int16))
    with pytest.raises(ValueError, match="320 int16"):
        detector.feed(np.zeros(FRAME_SAMPLES, np.float32))
    assert detector.audio_ms == 0 and FRAME_MS == 20
