"""gateway.resample: tones keep their pitch and length; streaming equals converting at once."""

from __future__ import annotations

import fractions

import numpy as np
import pytest
from av import AudioFrame

from gateway.resample import Downmixer, Upsampler


def tone(freq: float, rate: int, seconds: float, amplitude: float = 10_000) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.int16)


def dominant_hz(pcm: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(pcm.astype(np.float64) * np.hanning(len(pcm))))
    return float(np.argmax(spectrum) * rate / len(pcm))


def aiortc_frames(stereo_pcm: np.ndarray) -> list[AudioFrame]:
    """What aiortc's Opus decoder yields: s16 packed stereo, 48 kHz, 960 samples, with pts."""
    frames = []
    for index, pos in enumerate(range(0, len(stereo_pcm) // 2, 960)):
        pcm = stereo_pcm[2 * pos : 2 * (pos + 960)]
        frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="stereo")
        frame.sample_rate, frame.pts = 48_000, index * 960
        frame.time_base = fractions.Fraction(1, 48_000)
        frames.append(frame)
    return frames


def test_downmixer_keeps_a_1khz_tone_and_its_length() -> None:
    mono = tone(1000, 48_000, 1.0)
    downmixer = Downmixer()
    out = np.concatenate([downmixer.convert(f) for f in aiortc_frames(np.repeat(mono, 2))])
    out = np.concatenate([out, downmixer.flush()])
    assert abs(len(out) - 16_000) < 320  # within one 20 ms frame
    assert dominant_hz(out, 16_000) == pytest.approx(1000, abs=2)
    # L = R (a mono sender) comes back at the same level, not doubled.
    assert np.abs(out[400:-400]).max() == pytest.approx(10_000, rel=0.02)


def test_downmixer_frames_are_320_samples_after_the_first() -> None:
    downmixer = Downmixer()
    sizes = [len(downmixer.convert(f)) for f in aiortc_frames(np.zeros(2 * 960 * 10, np.int16))]
    assert sizes[0] <= 320 and sizes[1:] == [320] * 9


def test_downmixer_streaming_matches_whole_signal() -> None:
    stereo = np.random.default_rng(3).integers(-8000, 8000, 2 * 48_000, dtype=np.int16)
    downmixer = Downmixer()
    streamed = np.concatenate([downmixer.convert(f) for f in aiortc_frames(stereo)])
    streamed = np.concatenate([streamed, downmixer.flush()])
    whole_frame = AudioFrame.from_ndarray(stereo.reshape(1, -1), format="s16", layout="stereo")
    whole_frame.sample_rate = 48_000
    whole_downmixer = Downmixer()
    whole = np.concatenate([whole_downmixer.convert(whole_frame), whole_downmixer.flush()])
    assert len(streamed) == len(whole)
    assert np.abs(streamed.astype(np.int32) - whole).max() <= 1  # rounding only


def test_downmixer_follows_a_change_of_input_layout() -> None:
    downmixer = Downmixer()
    downmixer.convert(aiortc_frames(np.zeros(2 * 960, np.int16))[0])
    mono = AudioFrame.from_ndarray(
        tone(1000, 48_000, 0.1).reshape(1, -1), format="s16", layout="mono"
    )
    mono.sample_rate = 48_000
    out = downmixer.convert(mono)
    assert len(out) > 0


@pytest.mark.parametrize("src_rate", [22_050, 24_000, 16_000])
def test_upsampler_keeps_a_1khz_tone_and_its_length(src_rate: int) -> None:
    signal = tone(1000, src_rate, 1.0)
    upsampler = Upsampler(src_rate)
    # Vocoder-sized pieces of odd lengths, an empty one among them.
    pieces = np.split(signal, [1, 1, 500, 2_205, 9_000])
    out = np.concatenate([*(upsampler.convert(p) for p in pieces), upsampler.flush()])
    assert abs(len(out) - 48_000) < 960
    assert dominant_hz(out, 48_000) == pytest.approx(1000, abs=2)


def test_upsampler_streaming_matches_whole_signal() -> None:
    signal = np.random.default_rng(5).integers(-8000, 8000, 22_050, dtype=np.int16)
    streaming = Upsampler(22_050)
    pieces = [streaming.convert(p) for p in np.array_split(signal, 37)]
    streamed = np.concatenate([*pieces, streaming.flush()])
    whole_upsampler = Upsampler(22_050)
    whole = np.concatenate([whole_upsampler.convert(signal), whole_upsampler.flush()])
    assert len(streamed) == len(whole)
    assert np.abs(streamed.astype(np.int32) - whole).max() <= 1


def test_upsampler_reset_starts_a_fresh_stream() -> None:
    upsampler = Upsampler(22_050)
    upsampler.convert(tone(1000, 22_050, 0.1))
    upsampler.reset()
    assert len(upsampler.flush()) == 0
    with pytest.raises(ValueError, match="rates"):
        Upsampler(0)
