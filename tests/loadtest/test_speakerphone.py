"""The simulated speakerphone: the echo comes at its delay and level, through the room, under
the microphone's noise, the same in pieces as whole, and nothing where nothing was played."""

from __future__ import annotations

import numpy as np
import pytest

from loadtest.speakerphone import EchoSettings, Speakerphone

QUIET = float("-inf")  # no microphone noise
T0 = 1000.0  # a monotonic time to start from


def noise(seconds: float, rate: int, rms: float = 3000.0, seed: int = 7) -> np.ndarray:
    pcm = np.random.default_rng(seed).standard_normal(round(seconds * rate)) * rms
    return pcm.astype(np.int16)


def call(
    phone: Speakerphone,
    played: np.ndarray,
    seconds: float,
    *,
    play_at: float = T0,
    mic_at: float = T0,
    jitter_s: float = 0.0,
) -> np.ndarray:
    """Run a call as the test callers do, 20 ms at a time: the loudspeaker plays `played` from
    `play_at` on, the microphone captures `seconds` from `mic_at` on, each on a clock
    that jitters after the first frame, which places it. What the microphone picked up."""
    frame = phone.rate // 50
    jitter = np.random.default_rng(3).uniform(-jitter_s, jitter_s, 2 * round(seconds * 50) + 2)
    events = [(play_at + i / phone.rate, "play", i) for i in range(0, len(played), frame)]
    events += [
        (mic_at + i / phone.rate, "mic", i) for i in range(0, round(seconds * phone.rate), frame)
    ]
    picked = []
    for k, (at, kind, i) in enumerate(sorted(events)):
        at += jitter[k % len(jitter)] if i else 0.0
        if kind == "play":
            phone.played(played[i : i + frame], at)
        else:
            picked.append(phone.pick_up(frame, at))
    return np.concatenate(picked)


def lag_of_peak(picked: np.ndarray, played: np.ndarray) -> int:
    """The lag at which `picked` best matches `played` (cross-correlation's peak)."""
    size = 1 << (len(picked) + len(played)).bit_length()
    spectrum = np.fft.rfft(picked, size) * np.conj(np.fft.rfft(played.astype(float), size))
    return int(np.argmax(np.fft.irfft(spectrum, size)[: len(picked)]))


def db(power_ratio: float) -> float:
    return 10 * np.log10(power_ratio)


@pytest.mark.parametrize(("rate", "delay_ms"), [(8000, 60), (8000, 250), (48000, 150)])
def test_the_echo_comes_at_the_delay_after_it_was_played(rate: int, delay_ms: float) -> None:
    phone = Speakerphone(rate, EchoSettings(delay_ms=delay_ms))
    played = noise(1.0, rate)
    # the microphone started half a second before the agent spoke, and its loop jitters
    picked = call(phone, played, 2.0, play_at=T0 + 0.5, jitter_s=0.004)
    assert lag_of_peak(picked, played) == round((0.5 + delay_ms / 1000) * rate)


@pytest.mark.parametrize("attenuation_db", [6.0, 20.0])
def test_the_echo_is_the_attenuation_below_what_was_played(attenuation_db: float) -> None:
    settings = EchoSettings(attenuation_db=attenuation_db, noise_dbfs=QUIET)
    played = noise(2.0, 8000)
    picked = call(Speakerphone(8000, settings), played, 2.5)
    echo = picked[round(0.25 * 8000) : round(2.1 * 8000)]  # past the delay and the room's onset
    level = db(np.mean(echo**2) / np.mean(played.astype(float) ** 2))
    assert level == pytest.approx(-attenuation_db, abs=1.5)


def test_the_room_spreads_the_echo_after_its_direct_path() -> None:
    phone = Speakerphone(8000, EchoSettings(delay_ms=100, attenuation_db=0, noise_dbfs=QUIET))
    click = np.zeros(1600, np.int16)
    click[0] = 10000
    picked = call(phone, click, 0.4)
    onset = round(0.1 * 8000)
    assert not picked[:onset].any()
    assert np.argmax(np.abs(picked)) == onset  # the direct path is the loudest
    room = picked[onset + 1 : onset + round(0.06 * 8000)]
    assert np.abs(room[-80:]).max() > 0.01  # reflections for the room's 60 ms ...
    assert db(np.sum(room**2) / picked[onset] ** 2) == pytest.approx(-10, abs=0.1)
    assert np.abs(picked[onset + round(0.06 * 8000) :]).max() < 1e-6  # ... and none after


def test_the_echo_picked_up_in_pieces_is_the_echo_picked_up_whole() -> None:
    settings = EchoSettings(delay_ms=90, seed=5)  # with the noise: it too continues
    played = noise(0.8, 8000)
    whole_phone, piecewise = Speakerphone(8000, settings), Speakerphone(8000, settings)
    whole_phone.played(played, T0)
    whole = whole_phone.pick_up(8000, T0)
    piecewise.played(played[:3000], T0)
    pieces = [piecewise.pick_up(1000, T0)]  # the microphone starts with the loudspeaker
    piecewise.played(played[3000:], T0 + 3000 / 8000 + 0.002)  # a little late: it follows on
    # the microphone's own count places each piece, whatever time its caller stamps on it
    pieces += [piecewise.pick_up(n, T0 + 0.2 * i) for i, n in enumerate([1, 2999, 4000], 1)]
    assert np.allclose(np.concatenate(pieces), whole, atol=1e-6)


def test_a_microphone_frame_hears_silence_where_nothing_was_played() -> None:
    phone = Speakerphone(8000, EchoSettings(delay_ms=150, noise_dbfs=QUIET))
    picked = call(phone, noise(0.2, 8000), 2.0, play_at=T0 + 1.0, jitter_s=0.004)
    start, end = round(1.15 * 8000), round((1.15 + 0.2 + 0.06) * 8000)
    assert np.abs(picked[:start]).max() < 1e-6
    assert np.mean(picked[start : start + 1600] ** 2) > 1e5
    assert np.abs(picked[end:]).max() < 1e-6


def test_frames_that_come_together_play_one_after_the_other() -> None:
    settings = EchoSettings(noise_dbfs=QUIET)
    played = noise(0.6, 8000)
    on_time = call(Speakerphone(8000, settings), played, 1.0)
    # the loudspeaker's queue plays a burst in order and closes gaps of arrival jitter
    phone = Speakerphone(8000, settings)
    phone.played(played[:1600], T0)
    phone.played(played[1600:3200], T0)
    phone.played(played[3200:], T0 + 0.4 + 0.003)
    assert np.allclose(phone.pick_up(8000, T0), on_time, atol=1e-6)


def test_what_is_played_after_the_microphone_heard_its_time_is_lost() -> None:
    settings = EchoSettings(delay_ms=100, attenuation_db=0, noise_dbfs=QUIET)
    phone, twin = Speakerphone(8000, settings), Speakerphone(8000, settings)
    for speakerphone in (phone, twin):  # heard the loudspeaker until T0 + 0.2
        assert not speakerphone.pick_up(2400, T0).any()
    phone.played(np.full(800, 1000, np.int16), T0)  # came too late to be heard at all
    for speakerphone in (phone, twin):  # the first half came too late, the second did not
        speakerphone.played(np.full(800, 2000, np.int16), T0 + 0.15)
    later = phone.pick_up(2400, T0 + 0.3)
    assert np.array_equal(later, twin.pick_up(2400, T0 + 0.3))
    assert later[:400].min() > 1000  # T0 + 0.2 to T0 + 0.25, a hundred ms later
    assert np.abs(later[400 + 480 :]).max() < 1e-6  # and no more once the room is quiet


@pytest.mark.parametrize("noise_dbfs", [-55.0, -30.0])
def test_the_microphone_hisses_at_the_noise_level(noise_dbfs: float) -> None:
    picked = Speakerphone(8000, EchoSettings(noise_dbfs=noise_dbfs)).pick_up(16000, T0)
    assert db(np.mean(picked**2) / 32768**2) == pytest.approx(noise_dbfs, abs=0.3)
    again = Speakerphone(8000, EchoSettings(noise_dbfs=noise_dbfs)).pick_up(16000, T0)
    other = Speakerphone(8000, EchoSettings(noise_dbfs=noise_dbfs, seed=1)).pick_up(16000, T0)
    assert np.array_equal(picked, again)
    assert not np.allclose(picked, other)


def test_mixing_adds_the_echo_to_the_speech_and_clips() -> None:
    settings = EchoSettings(delay_ms=60, attenuation_db=0)
    played = np.full(800, 30000, np.int16)
    phone, twin = Speakerphone(8000, settings), Speakerphone(8000, settings)
    phone.played(played, T0)
    twin.played(played, T0)
    speech = np.full(1600, 20000, np.int16)
    mixed = phone.mix(speech, T0)
    echo = twin.pick_up(1600, T0)
    assert mixed.dtype == np.int16
    assert np.array_equal(mixed[:480], np.rint(speech[:480] + echo[:480]).astype(np.int16))
    assert mixed[480:].max() == 32767  # clipped, not wrapped around
    assert mixed.min() > 0
