"""Streaming sample-rate conversion for both audio directions, with PyAV's libswresample.

In: aiortc decodes every caller's Opus into s16 packed stereo 48 kHz frames of 20 ms (even from a
mono sender); the VAD and the encoder stage want PCM16 mono 16 kHz. Out: the vocoder speaks PCM16
mono at its own rate (22,050 Hz for espeak-ng); playout wants 48 kHz mono.

Both converters keep libswresample's filter state across calls, so a stream converted chunk by
chunk matches the whole signal converted at once (no clicks at chunk edges). The filter holds back
a few samples of delay; `flush()` returns them at the end of a stream.
"""

from __future__ import annotations

import av
import numpy as np

from stages.messages import CALLER_RATE

__all__ = ["PLAYOUT_RATE", "Downmixer", "Upsampler"]

PLAYOUT_RATE = 48_000  # Opus' native rate; aiortc's encoder takes it without resampling again


def _concat(frames: list[av.AudioFrame]) -> np.ndarray:
    if not frames:
        return np.zeros(0, np.int16)
    if len(frames) == 1:
        return frames[0].to_ndarray().reshape(-1)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames])


class Downmixer:
    """aiortc's received audio frames → PCM16 mono at 16 kHz, one call per frame.

    libswresample averages the two channels (L=R from a mono sender gives back the same level,
    never clipping). A frame whose format, layout or rate differs from the previous one (a new
    remote track, another codec) flushes the old filter and starts a new one instead of failing.
    """

    def __init__(self, rate: int = CALLER_RATE) -> None:
        self.rate = rate
        self._resampler: av.AudioResampler | None = None
        self._input_shape: tuple[str, str, int] | None = None

    def convert(self, frame: av.AudioFrame) -> np.ndarray:
        """Int16 mono samples for `frame` (the first call returns a little less: filter delay)."""
        shape = (frame.format.name, frame.layout.name, frame.sample_rate)
        if shape == ("s16", "mono", self.rate) and self._resampler is None:
            # already what we want (libopus decoded it at this rate): no filter, no delay
            return frame.to_ndarray().reshape(-1)
        head = np.zeros(0, np.int16)
        if shape != self._input_shape:
            head = self.flush()
            self._resampler = av.AudioResampler(format="s16", layout="mono", rate=self.rate)
            self._input_shape = shape
        assert self._resampler is not None
        # Timestamps are irrelevant to a pure rate conversion; RTP gaps must not become silence.
        frame.pts = None
        out = _concat(self._resampler.resample(frame))
        return np.concatenate([head, out]) if len(head) else out

    def flush(self) -> np.ndarray:
        """The samples still held in the filter; the next frame starts a fresh stream."""
        if self._resampler is None:
            return np.zeros(0, np.int16)
        out = _concat(self._resampler.resample(None))
        self.reset()
        return out

    def reset(self) -> None:
        """Forget the filter state and its held-back samples (a new call, a cleared buffer)."""
        self._resampler = None
        self._input_shape = None


class Upsampler:
    """PCM16 mono at the vocoder's rate → PCM16 mono at 48 kHz (or `dst_rate`), streaming.

    Chunks may be any length, including empty. Used with `dst_rate=16_000` it also brings a
    WebSocket client's 24 kHz PCM16 down to the caller rate.
    """

    def __init__(self, src_rate: int, dst_rate: int = PLAYOUT_RATE) -> None:
        if src_rate <= 0 or dst_rate <= 0:
            raise ValueError(f"sample rates must be positive, got {src_rate} -> {dst_rate}")
        self.src_rate = src_rate
        self.dst_rate = dst_rate
        self._resampler: av.AudioResampler | None = None

    def convert(self, pcm16: np.ndarray) -> np.ndarray:
        """Int16 samples at `dst_rate` for the next chunk of the stream."""
        pcm16 = np.ascontiguousarray(pcm16, dtype=np.int16).reshape(-1)
        if self.src_rate == self.dst_rate:
            return pcm16.copy()
        if len(pcm16) == 0:
            return np.zeros(0, np.int16)
        if self._resampler is None:
            self._resampler = av.AudioResampler(format="s16", layout="mono", rate=self.dst_rate)
        frame = av.AudioFrame.from_ndarray(pcm16.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.src_rate
        return _concat(self._resampler.resample(frame))

    def flush(self) -> np.ndarray:
        """The samples still held in the filter; the next chunk starts a fresh stream."""
        if self._resampler is None:
            return np.zeros(0, np.int16)
        out = _concat(self._resampler.resample(None))
        self._resampler = None
        return out

    def reset(self) -> None:
        """Drop the filter state and its held-back samples (barge-in: the rest is not played)."""
        self._resampler = None
