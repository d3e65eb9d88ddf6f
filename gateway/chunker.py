"""Cut a caller's 16 kHz PCM16 stream into the fixed 200 ms chunks the encoder ring carries."""

from __future__ import annotations

import numpy as np

from stages.messages import CHUNK_SAMPLES

__all__ = ["Chunker"]


class Chunker:
    """Accumulates PCM16 mono of any chunking (20 ms VAD frames, resampler output) into chunks of
    exactly `chunk_samples`; `flush()` hands over the shorter remainder when the turn ends.

    Every returned chunk is a fresh array the caller may keep or push to a ring.
    """

    def __init__(self, chunk_samples: int = CHUNK_SAMPLES) -> None:
        if chunk_samples <= 0:
            raise ValueError(f"chunk_samples must be positive, got {chunk_samples}")
        self.chunk_samples = chunk_samples
        self._buffer = np.empty(chunk_samples, np.int16)
        self._filled = 0

    @property
    def pending(self) -> int:
        """Samples held back, waiting for a chunk to fill."""
        return self._filled

    def push(self, pcm16: np.ndarray) -> list[np.ndarray]:
        """Append samples; return every chunk they complete (often none, sometimes several)."""
        pcm16 = np.asarray(pcm16, dtype=np.int16).reshape(-1)
        chunks: list[np.ndarray] = []
        pos = 0
        while pos < len(pcm16):
            take = min(self.chunk_samples - self._filled, len(pcm16) - pos)
            self._buffer[self._filled : self._filled + take] = pcm16[pos : pos + take]
            self._filled += take
            pos += take
            if self._filled == self.chunk_samples:
                chunks.append(self._buffer)
                self._buffer = np.empty(self.chunk_samples, np.int16)
                self._filled = 0
        return chunks

    def flush(self) -> np.ndarray | None:
        """The partial chunk at the end of a turn, or None when nothing is pending."""
        if self._filled == 0:
            return None
        tail = self._buffer[: self._filled].copy()
        self._filled = 0
        return tail

    def reset(self) -> None:
        """Drop whatever is pending (the turn was discarded)."""
        self._filled = 0
