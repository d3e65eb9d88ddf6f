"""gateway.echo: the far end's timeline (a clock of the test's) and the phone player's lag
that moves it (gateway.twilio.PlayerLag), the processing a session gets, and WebRTC's echo
canceller on a synthetic speakerphone (the real module)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from gateway.echo import (
    AEC3_DELAY,
    FRAME,
    MARGIN,
    AudioProcessing,
    EchoCanceller,
    EchoPath,
    PlayedAudio,
    ResidualEcho,
    audio_processing,
)
from gateway.twilio import LAG_MARKS, PlayerLag

RATE = 16_000


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def tone(seconds: float, level: int = 8000) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (level * np.sin(2 * np.pi * 440 * t)).astype(np.int16)


def test_the_timeline_is_silence_where_nothing_played_and_the_piece_where_it_did() -> None:
    clock = Clock()
    played = PlayedAudio(RATE, clock)
    start = clock.now
    piece = tone(0.1)
    played.play_at(piece, start + 0.05)
    clock.now += 0.2 + MARGIN / RATE  # the far end is taken MARGIN behind the caller's audio
    out = played.take(int(0.2 * RATE), clock.now)
    assert len(out) == 0.2 * RATE
    assert not out[: int(0.05 * RATE)].any()
    np.testing.assert_array_equal(out[int(0.05 * RATE) : int(0.15 * RATE)], piece)
    assert not out[int(0.15 * RATE) :].any()


def test_the_far_end_keeps_step_with_the_callers_audio_not_with_its_arrival() -> None:
    clock = Clock()
    played = PlayedAudio(RATE, clock)
    piece = tone(0.5)
    played.play_at(piece, clock.now)
    clock.now += (2 * FRAME + MARGIN) / RATE
    parts = [played.take(2 * FRAME, clock.now)]
    # 20 ms pieces of the caller's audio, arriving up to 60 ms late and in bursts
    for late in (0.03, 0.0, 0.06, 0.06, 0.0, 0.01, 0.06, 0.06, 0.06, 0.02):
        clock.now += 0.02
        parts.append(played.take(2 * FRAME, clock.now + late))
    np.testing.assert_array_equal(np.concatenate(parts), piece[: 22 * FRAME])


def test_the_far_end_is_placed_again_after_a_stall_or_when_it_runs_ahead() -> None:
    clock = Clock()
    played = PlayedAudio(RATE, clock)
    played.play_at(tone(2.0), clock.now)
    played.take(2 * FRAME, clock.now)
    clock.now += 0.5  # nothing came for half a second: the far end moves on with the clock
    after_stall = played.take(2 * FRAME, clock.now)
    skipped_to = int(0.5 * RATE) - 2 * FRAME - MARGIN
    np.testing.assert_array_equal(after_stall, tone(2.0)[skipped_to : skipped_to + 2 * FRAME])
    # the caller's audio comes faster than it is spoken: the far end is not read ahead of now
    for _ in range(20):
        played.take(2 * FRAME, clock.now)
        assert played._taken <= round((clock.now - played._origin) * RATE)


def test_a_piece_continues_the_last_and_a_gap_stays_a_gap() -> None:
    clock = Clock()
    played = PlayedAudio(RATE, clock)
    a, b, c = tone(0.02, 1000), tone(0.02, 2000), tone(0.02, 3000)
    played.play_at(a, clock.now)
    played.play_at(b, clock.now + 0.02 + 1 / RATE)  # a sample off: rounding, no gap
    played.play_at(c, clock.now + 0.043)  # 3 ms later than b's end: the player's gap
    out = played.take(int(0.1 * RATE), clock.now + 0.1 + MARGIN / RATE)
    np.testing.assert_array_equal(out[: 2 * len(a)], np.concatenate([a, b]))
    assert not out[2 * len(a) : int(0.043 * RATE)].any()
    np.testing.assert_array_equal(out[int(0.043 * RATE) : int(0.063 * RATE)], c)


def test_play_next_follows_what_is_placed_and_a_cut_drops_what_has_not_played() -> None:
    clock = Clock()
    played = PlayedAudio(RATE, clock)
    start = clock.now
    first = played.play_next(tone(0.1))
    second = played.play_next(tone(0.1))
    assert first == pytest.approx(clock.now) and second == pytest.approx(clock.now + 0.1)
    clock.now += 0.05
    played.cut()
    assert played.play_next(tone(0.02)) == pytest.approx(clock.now)  # after the cut: now
    clock.now = start + 0.5
    out = played.take(int(0.5 * RATE), clock.now + MARGIN / RATE)
    voiced = np.flatnonzero(np.abs(out) > 100)
    # 50 ms of the first, then the 20 ms piece placed after the cut, then nothing
    assert voiced[-1] < int(0.07 * RATE)


@pytest.mark.parametrize("taken_back", [False, True])
def test_shift_from_moves_what_had_not_begun(taken_back) -> None:
    clock = Clock()
    played = PlayedAudio(RATE, clock)
    start = clock.now
    played.play_next(tone(0.1))
    later = played.play_next(tone(0.1, 2000))
    played.shift_from(later, 0.05)
    if taken_back:  # the player caught up: back where it was
        played.shift_from(later + 0.05, -0.05)
    out = played.take(int(0.4 * RATE), start + 0.4 + MARGIN / RATE)
    second = slice(int(0.1 * RATE), int(0.2 * RATE))
    if taken_back:
        assert (
            np.count_nonzero(out[second]) > 0.9 * len(out[second]) and not out[second.stop :].any()
        )
    else:
        assert not out[int(0.1 * RATE) : int(0.15 * RATE)].any()  # the gap the delay made
        assert np.abs(out[int(0.15 * RATE) : int(0.25 * RATE)]).max() > 1000


def test_processing_follows_noise_reduction_then_the_transports_default() -> None:
    assert audio_processing(False, "far_field") == AudioProcessing(echo=True, noise=True)
    assert audio_processing(True, "near_field") == AudioProcessing(echo=False, noise=True)
    assert audio_processing(True, None) == AudioProcessing(echo=True, noise=True)
    assert audio_processing(True, None, noise_suppression=False) == AudioProcessing(True, False)
    assert audio_processing(False, None) is None


def speakerphone(far: np.ndarray, delay_s: float, attenuation_db: float) -> np.ndarray:
    """The far end as a speakerphone's mic hears it: late, quieter, through a short room."""
    taps = int(0.03 * RATE)
    room = np.exp(-np.arange(taps) / (0.006 * RATE)) * np.random.default_rng(7).normal(0, 1, taps)
    room[0] = 1.0
    room /= np.sqrt(np.sum(room**2))
    echo = np.convolve(far.astype(np.float64), room)[: len(far)] * 10 ** (-attenuation_db / 20)
    delay = int(delay_s * RATE)
    return np.concatenate([np.zeros(delay), echo])[: len(far)]


def voice_like(seconds: float, seed: int) -> np.ndarray:
    """Noise shaped like speech: syllables of a few hundred ms, a voiced band, pauses."""
    rng = np.random.default_rng(seed)
    n = int(seconds * RATE)
    noise = np.convolve(rng.normal(0, 1, n), np.hanning(24), "same")
    syllables = (np.sin(2 * np.pi * 3.5 * np.arange(n) / RATE + seed) > -0.2).astype(float)
    return (noise / noise.std() * 4000 * syllables).astype(np.int16)


def rms_db(x: np.ndarray) -> float:
    return 10 * np.log10(np.mean(x.astype(np.float64) ** 2) + 1e-9)


def run_canceller(canceller: EchoCanceller, clock: Clock, far: np.ndarray, mic: np.ndarray):
    """Play `far` and hear `mic` in 20 ms steps, as a call does; the processed mic back."""
    assert canceller.played is not None
    out = []
    step = 2 * FRAME
    for i in range(0, len(far), step):
        canceller.played.play_at(far[i : i + step], clock.now)
        clock.now += step / RATE
        out.append(canceller.process(mic[i : i + step]))
    return np.concatenate(out)


def spoken(make_speech, sentences: list[str], seconds: float) -> np.ndarray:
    pcm = np.concatenate([make_speech(s).pcm16 for s in sentences])
    return np.resize(pcm, int(seconds * RATE))


AGENT = [
    "The weather in Paris is mild today, with a light wind from the west.",
    "Tomorrow brings rain in the morning and sunshine in the afternoon.",
]


def test_the_canceller_takes_the_echo_out_and_leaves_the_caller(make_speech) -> None:
    clock = Clock()
    seconds = 8.0
    far = spoken(make_speech, AGENT, seconds)
    echo = speakerphone(far, delay_s=0.15, attenuation_db=10)
    near = np.zeros(len(far), np.int16)
    caller = make_speech("Stop, I want to book a table for two people.").pcm16
    start = int(5 * RATE)  # the caller talks over the agent from 5 s
    near[start : start + len(caller)] = caller[: len(near) - start]
    mic = np.clip(echo + near, -32768, 32767).astype(np.int16)
    canceller = EchoCanceller(AudioProcessing(echo=True, noise=False), PlayedAudio(RATE, clock))
    out = run_canceller(canceller, clock, far, mic)
    # echo alone, after 2 s to converge: at least 15 dB taken out
    span = slice(int(2 * RATE), start)
    erle = rms_db(mic[span]) - rms_db(out[span])
    assert erle > 15, erle
    # double talk: the caller's speech is still there, within a few dB
    talk = slice(start + int(0.5 * RATE), start + len(caller) - int(0.5 * RATE))
    assert abs(rms_db(out[talk]) - rms_db(near[talk])) < 4
    assert canceller.busy_s > 0


def test_without_a_reference_nothing_is_cancelled(make_speech) -> None:
    """The same echo with the far end never placed: the check above would fail."""
    clock = Clock()
    far = spoken(make_speech, AGENT, 4.0)
    mic = speakerphone(far, 0.15, 10).astype(np.int16)
    canceller = EchoCanceller(AudioProcessing(echo=True, noise=False), PlayedAudio(RATE, clock))
    out = run_canceller(canceller, clock, np.zeros_like(far), mic)
    span = slice(int(2 * RATE), int(4 * RATE) - FRAME)
    assert rms_db(mic[span]) - rms_db(out[span]) < 6


def test_pieces_of_any_length_come_back_in_whole_frames_and_nothing_is_lost() -> None:
    canceller = EchoCanceller(AudioProcessing(echo=False, noise=False), None)
    pcm = voice_like(1.0, seed=3)
    out, fed = [], 0
    for size in (7, 160, 333, 1, 999, 4500):
        out.append(canceller.process(pcm[fed : fed + size]))
        assert len(out[-1]) % FRAME == 0
        fed += size
    assert sum(len(o) for o in out) == fed - fed % FRAME


def test_a_leak_well_under_the_far_end_is_echo_and_a_caller_over_it_is_not() -> None:
    residual = ResidualEcho()
    assert residual.only_echo(heard_dbfs=-40, left_dbfs=-55, played_dbfs=-20)
    # the caller over the agent: the canceller took little out
    assert not residual.only_echo(heard_dbfs=-30, left_dbfs=-32, played_dbfs=-20)
    # nothing played: whatever is left is the caller's
    assert not residual.only_echo(heard_dbfs=-40, left_dbfs=-60, played_dbfs=-100)


# -- the echo path ----------------------------------------------------------------------------


def power_sum(*levels: np.ndarray) -> np.ndarray:
    return 10 * np.log10(sum(10 ** (np.asarray(level) / 10) for level in levels))


def call_levels(
    seconds: float, echo_db: float | None, *, caller_over_s: float = 0.0, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """A call's 10 ms frame levels (far end, microphone): the agent's replies of 4 s (syllables
    around -20 dBFS) 3 s apart, the caller talking through 90% of each pause (their turns),
    and `caller_over_s` over each reply a second into it (the agent talking on); the echo
    `echo_db` under the far end 150 ms late through a short room (None: no echo path), over
    noise at -60 dBFS."""
    rng = np.random.default_rng(seed)
    n = int(seconds * 100)
    far, caller = np.full(n, -100.0), np.full(n, -200.0)
    for start in range(100, n, 700):
        reply = np.arange(start, min(n, start + 400))
        syllables = np.sin(2 * np.pi * (reply - start) / 25 + rng.uniform(0, 6)) > -0.3
        far[reply] = np.where(syllables, rng.normal(-20, 5, len(reply)), -100.0)
        if caller_over_s:
            over = slice(start + 100, min(n, start + 100 + int(caller_over_s * 100)))
            caller[over] = rng.normal(-24, 4, len(caller[over]))
        pause = slice(min(n, start + 400), min(n, start + 670))
        caller[pause] = rng.normal(-24, 4, len(caller[pause]))
    echo = np.full(n, -200.0)
    if echo_db is not None:
        delay = 15
        for k, tail_db in enumerate((0, -12, -18, -24, -30, -36)):
            reflected = far[: n - delay - k] - echo_db + tail_db
            echo[delay + k :] = power_sum(echo[delay + k :], reflected)
    mic = power_sum(rng.normal(-60, 0.5, n), echo, caller)
    return far, mic


def judged(far: np.ndarray, mic: np.ndarray) -> tuple[EchoPath, np.ndarray]:
    path = EchoPath()
    return path, np.array([path.add(f, m) for f, m in zip(far, mic, strict=True)])


@pytest.mark.parametrize("echo_db", [6, 10, 20])
def test_an_echo_path_is_there_though_the_caller_talks_in_the_agents_pauses(echo_db) -> None:
    far, mic = call_levels(30, echo_db)
    path, present = judged(far, mic)
    assert present.all()
    assert path.rise_db is not None and path.rise_db >= EchoPath.PRESENT_DB


def test_the_echo_path_is_judged_at_the_echos_delay() -> None:
    # a far end loud or quiet at random, as syllables come (without the synthetic call's
    # period, which fits several delays); its echo 12 dB down and 160 ms late
    rng = np.random.default_rng(1)
    far = np.where(rng.random(1500) < 0.5, rng.normal(-20, 3, 1500), -100.0)
    echo = np.concatenate([np.full(16, -200.0), far[:-16] - 12])
    path, _ = judged(far, power_sum(rng.normal(-60, 0.5, 1500), echo))
    assert set(path.delays) == {16}, path.delays


@pytest.mark.parametrize("caller_over_s", [0.0, 0.5])
def test_no_echo_path_is_found_once_the_agent_has_played(caller_over_s) -> None:
    far, mic = call_levels(30, None, caller_over_s=caller_over_s)
    path, present = judged(far, mic)
    first_reply_heard = 100 + 400 + EchoPath.EVERY  # frames: its end, and a judgement
    assert present[:100].all()  # nothing to judge by yet: taken to be there
    assert not present[first_reply_heard + 700 :].any()
    assert path.rise_db is not None and path.rise_db < EchoPath.ABSENT_DB


def test_the_echo_path_is_taken_to_be_there_until_it_can_be_judged() -> None:
    """The agent talking on without a pause into a quiet microphone: nothing to weigh the
    microphone against, so no judgement, and the canceller stays on."""
    path = EchoPath()
    rng = np.random.default_rng(1)
    for far, mic in zip(rng.normal(-20, 3, 3000), rng.normal(-60, 0.5, 3000), strict=True):
        assert path.add(far, mic)
    assert path.rise_db is None


def test_judging_the_echo_path_costs_little() -> None:
    far, mic = call_levels(20, 10, caller_over_s=0.5)
    path = EchoPath()
    started = time.perf_counter()
    for f, m in zip(far, mic, strict=True):
        path.add(f, m)
    per_frame_us = (time.perf_counter() - started) / len(far) * 1e6
    # the whole canceller's budget is ~200 µs a 10 ms frame; the modules take most of it
    assert per_frame_us < 40, per_frame_us


def test_with_no_echo_path_the_callers_words_over_the_agent_keep_their_level(make_speech) -> None:
    """A headset: the agent plays but the microphone hears only the caller, who talks over it.
    Through AEC3 a tenth of their voiced frames lose over 4 dB; with no echo path found, the
    output is the module without the echo canceller, and they lose next to nothing."""
    clock = Clock()
    seconds = 16.0
    far = spoken(make_speech, AGENT, seconds)
    far[int(4 * RATE) : int(7 * RATE)] = 0  # the agent's pause, the caller's turn
    near = np.zeros(len(far), np.int16)
    turn = make_speech("I would like a table for two tonight.").pcm16[: int(3 * RATE)]
    near[int(4 * RATE) : int(4 * RATE) + len(turn)] = turn
    caller = make_speech("Stop, I want to book a table for two people.").pcm16
    start = int(12 * RATE)  # over the agent
    near[start : start + len(caller)] = caller[: len(near) - start]
    noise = np.random.default_rng(5).normal(0, 30, len(near))
    mic = np.clip(near + noise, -32768, 32767).astype(np.int16)
    canceller = EchoCanceller(AudioProcessing(echo=True, noise=False), PlayedAudio(RATE, clock))
    out = run_canceller(canceller, clock, far, mic)
    assert not canceller.echo_path.present
    frames = range(start, min(len(near), start + len(caller)) - FRAME, FRAME)
    voiced = [k for k in frames if rms_db(near[k : k + FRAME]) > 40]
    # AEC3_DELAY: the output comes that much later than the microphone
    later = [out[k + AEC3_DELAY : k + AEC3_DELAY + FRAME] for k in voiced]
    lost = [rms_db(near[k : k + FRAME]) - rms_db(o) for k, o in zip(voiced, later, strict=True)]
    assert np.median(lost) < 1.0, np.median(lost)
    assert np.percentile(lost, 90) < 3.0, np.percentile(lost, 90)


class TestPlayerLag:
    """The phone player's lag behind the send-ahead clock, from its marks' lateness."""

    def test_one_mark_held_on_its_way_is_no_lag(self) -> None:
        lag = PlayerLag()
        for late in (0.03, 0.03, 0.03, 0.03, 0.35, 0.03, 0.03):
            assert lag.mark(late) is None
        assert lag.lag == 0.0

    def test_a_lateness_that_lasts_is_the_players_and_is_taken_back_when_it_ends(self) -> None:
        lag = PlayerLag()
        moves = [lag.mark(late) for late in [0.03] * 4 + [0.13] * (LAG_MARKS + 1) + [0.03]]
        assert moves[: 4 + LAG_MARKS - 1] == [None] * (4 + LAG_MARKS - 1)
        assert moves[4 + LAG_MARKS - 1] == pytest.approx(0.10)  # late in all of the last marks
        assert moves[-2] is None and moves[-1] == pytest.approx(0.0)

    def test_running_dry_ends_the_lag(self) -> None:
        lag = PlayerLag()
        for late in [0.03] + [0.23] * LAG_MARKS:
            lag.mark(late)
        assert lag.lag == pytest.approx(0.2)
        lag.ran_dry()
        assert lag.lag == 0.0
        assert lag.mark(0.03) is None
