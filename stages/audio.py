"""WAV files and sample-rate conversion (PyAV's libswresample, not hand-written interpolation)."""

from __future__ import annotations

import wave
from pathlib import Path

import av
import numpy as np


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """(int16 mono samples, sample rate) of a PCM16 WAV; stereo is averaged to mono."""
    try:
        with wave.open(str(path), "rb") as w:
            if w.getsampwidth() != 2:
                raise ValueError(f"{path}: {8 * w.getsampwidth()}-bit WAV; PCM16 is needed")
            channels, rate = w.getnchannels(), w.getframerate()
            data = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
    except wave.Error as exc:
        raise ValueError(f"{path}: not a PCM WAV file ({exc})") from None
    if channels > 1:
        data = data.reshape(-1, channels).mean(axis=1).astype(np.int16)
    return data, rate


def write_wav(path: str | Path, pcm16: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.ascontiguousarray(pcm16, dtype=np.int16).tobytes())


def resample(pcm16: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Resample a whole mono int16 signal."""
    if src_rate == dst_rate or len(pcm16) == 0:
        return pcm16
    resampler = av.AudioResampler(format="s16", layout="mono", rate=dst_rate)
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(pcm16, np.int16).reshape(1, -1), format="s16", layout="mono"
    )
    frame.sample_rate = src_rate
    out = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    out += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    return np.concatenate(out) if out else np.zeros(0, np.int16)
