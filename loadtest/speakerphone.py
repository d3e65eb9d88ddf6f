"""A simulated speakerphone: what a test caller's microphone picks up of its own loudspeaker.

A caller on a speakerphone or a car kit sends the agent's own voice back into the call: the
loudspeaker plays what the agent said, the room carries it to the microphone, delayed and quieter,
under the caller's speech and the microphone's noise. The gateway must cancel that echo
or the agent hears itself and barges in on its own reply. `Speakerphone` is that echo path for one
call at one sample rate, for the test callers (gateway.client, loadtest.phone) to mix in:

    phone = Speakerphone(8000, EchoSettings(delay_ms=120, attenuation_db=12))
    phone.played(pcm, at=t)          # the loudspeaker began playing `pcm` at time.monotonic() t
    frame = phone.mix(speech, at=t)  # a microphone frame: the caller's speech plus the echo
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_JITTER_S = 0.005  # a gap this short between two played frames is arrival jitter, not silence
_KEEP_S = 1.0  # played audio kept beyond the delay, for a microphone that lags its clock


@dataclass(frozen=True)
class EchoSettings:
    """The echo path from the loudspeaker to the microphone."""

    delay_ms: float = 150.0  # loudspeaker to microphone, the device's audio buffers included
    attenuation_db: float = 10.0  # the echo's level below what was played
    room_ms: float = 60.0  # the room's impulse response: its length, to -60 dB
    reverb_db: float = -10.0  # the room's reflections' energy relative to the direct path
    noise_dbfs: float = -55.0  # the microphone's white noise, RMS to full scale; -inf for none
    seed: int = 0  # the room's reflections and the noise: the same seed, the same echo


def room_response(rate: int, settings: EchoSettings) -> np.ndarray:
    """A room's impulse response, of unit energy (so the attenuation alone sets the echo's
    level): the direct path first, then random reflections decaying to -60 dB by `room_ms`."""
    n = max(1, round(settings.room_ms * rate / 1000))
    decay = np.exp(-6.9 * np.arange(1, n) / n)  # e^-6.9 is -60 dB
    tail = np.random.default_rng([settings.seed, 0]).standard_normal(n - 1) * decay
    if n > 1:
        tail *= np.sqrt(10 ** (settings.reverb_db / 10) / np.sum(tail**2))
    response = np.concatenate([[1.0], tail])
    return response / np.sqrt(np.sum(response**2))


class Speakerphone:
    """One call's echo path at `rate`: the loudspeaker's output on a sample grid by the time
    each piece began playing, heard by a microphone that advances by the samples it captures.
    Times are time.monotonic() seconds; samples are int16 mono."""

    def __init__(self, rate: int, settings: EchoSettings | None = None) -> None:
        self.rate = rate
        self.settings = settings or EchoSettings()
        self.room = room_response(rate, self.settings)
        self._room_spectra: dict[int, np.ndarray] = {}
        self._delay = round(self.settings.delay_ms * rate / 1000)
        self._gain = 10 ** (-self.settings.attenuation_db / 20)
        self._noise_rms = 32768 * 10 ** (self.settings.noise_dbfs / 20)
        self._noise = np.random.default_rng([self.settings.seed, 1])
        self._origin: float | None = None  # the time of sample 0
        self._speaker = np.zeros(0)  # the loudspeaker's output from sample `_start` on
        self._start = 0
        self._played_end: int | None = None  # the sample after the last one played
        self._mic: int | None = None  # the microphone's next sample
        self._tail = np.zeros(len(self.room) - 1)  # the room filter's last input samples

    def _sample(self, at: float) -> int:
        if self._origin is None:
            self._origin = at
        return round((at - self._origin) * self.rate)

    def played(self, pcm: np.ndarray, at: float) -> None:
        """The loudspeaker began playing `pcm` at `at`. A piece that comes while the last one
        is still playing, or just after it ended, follows it, as a loudspeaker's queue plays."""
        samples = np.asarray(pcm, dtype=np.float64).reshape(-1)
        start = self._sample(at)
        if self._played_end is not None and start < self._played_end + _JITTER_S * self.rate:
            start = self._played_end
        self._played_end = end = start + len(samples)
        self._forget(start - self._delay - round(_KEEP_S * self.rate))
        if end <= self._start:  # the microphone has passed it already
            return
        if start < self._start:
            samples, start = samples[self._start - start :], self._start
        if end > self._start + len(self._speaker):
            grow = end - self._start - len(self._speaker)
            self._speaker = np.concatenate([self._speaker, np.zeros(grow)])
        self._speaker[start - self._start : end - self._start] = samples

    def pick_up(self, n: int, at: float) -> np.ndarray:
        """The echo and noise in the `n` microphone samples captured from `at` on (float, in
        int16's scale). Only the first call's `at` places the microphone: after it, each call
        follows the last, so jitter in the caller's sending loop makes no gaps or overlaps."""
        if self._mic is None:
            self._mic = self._sample(at)
        heard = self._mic - self._delay  # the first loudspeaker sample these samples hear
        self._mic += n
        source = np.zeros(n)  # silence where nothing was played
        lo, hi = max(heard, self._start), min(heard + n, self._start + len(self._speaker))
        if lo < hi:
            source[lo - heard : hi - heard] = self._speaker[lo - self._start : hi - self._start]
        self._forget(heard + n)
        echo = self._gain * self._filter(source)
        return echo + self._noise_rms * self._noise.standard_normal(n)

    def mix(self, speech: np.ndarray, at: float) -> np.ndarray:
        """A microphone frame captured from `at` on: the caller's `speech` plus the echo."""
        speech = np.asarray(speech).reshape(-1)
        mixed = speech + self.pick_up(len(speech), at)
        return np.clip(np.rint(mixed), -32768, 32767).astype(np.int16)

    def _filter(self, source: np.ndarray) -> np.ndarray:
        """`source` through the room, continuing the last call's stream (overlap-save)."""
        n, taps = len(source), len(self.room)
        signal = np.concatenate([self._tail, source])
        self._tail = signal[len(signal) - (taps - 1) :]
        if not signal.any():  # the usual case between the agent's replies
            return np.zeros(n)
        # circular convolution wraps only into the first taps - 1 outputs, which are dropped
        size = 1 << (len(signal) - 1).bit_length()
        room = self._room_spectra.get(size)
        if room is None:
            room = self._room_spectra[size] = np.fft.rfft(self.room, size)
        return np.fft.irfft(np.fft.rfft(signal, size) * room, size)[taps - 1 : taps - 1 + n]

    def _forget(self, before: int) -> None:
        """Drop the loudspeaker's output before sample `before`: nothing will hear it."""
        if before > self._start:
            self._speaker = self._speaker[before - self._start :]
            self._start = before
