"""Sounds that are not words, for turn-taking tests and benchmarks: coughs and noise bursts,
made from seeded noise so that every run hears the same ones."""

from __future__ import annotations

import numpy as np

RATE = 16_000


def noise_burst(ms: int = 250, dbfs: float = -20.0, seed: int = 0, rate: int = RATE) -> np.ndarray:
    """White noise at `dbfs` RMS, 10 ms ramps at both ends; PCM16 mono at `rate`."""
    rng = np.random.default_rng(seed)
    n = rate * ms // 1000
    ramp = max(1, rate // 100)
    envelope = np.ones(n)
    envelope[:ramp] = np.linspace(0, 1, ramp)
    envelope[-ramp:] = np.linspace(1, 0, ramp)
    x = rng.standard_normal(n) * envelope
    x *= 10 ** (dbfs / 20) * 32767 / np.sqrt(np.mean(x**2))
    return np.clip(x, -32767, 32767).astype(np.int16)


def cough(seed: int = 0, dbfs: float = -14.0, rate: int = RATE) -> np.ndarray:
    """One or two bursts of band-limited noise (300-3500 Hz) with a sharp attack and a fast
    decay, as a cough sounds; peak at `dbfs`."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(1 + seed % 2):
        n = int(rate * rng.uniform(0.18, 0.3))
        t = np.arange(n) / rate
        spectrum = np.fft.rfft(rng.standard_normal(n))
        freqs = np.fft.rfftfreq(n, 1 / rate)
        spectrum[(freqs < 300) | (freqs > 3500)] = 0
        x = np.fft.irfft(spectrum, n)
        x *= np.minimum(1, t / 0.008) * np.exp(-t / rng.uniform(0.05, 0.09))
        x *= 10 ** (dbfs / 20) * 32767 / np.abs(x).max()
        parts += [x, np.zeros(int(rate * 0.12))]
    return np.concatenate(parts).astype(np.int16)
