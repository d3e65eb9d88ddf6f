"""Silero VAD on ONNX: the probability that a caller's 20 ms frame is speech.

Silero (MIT; `bundled:silero-vad`, docs/models.md) reads 512-sample windows (32 ms at 16 kHz)
with the last 64 samples of the window before as context, and carries a recurrent state from
window to window. The VAD feeds 20 ms frames, so each frame adds to a window and is given the
probability of the newest complete one: a frame's answer is at most 32 ms old.

A frame costs about 0.15 ms on the event loop, where the frame is: 15 times webrtcvad's, about
15% of a core for 20 calls (`python -m loadtest.vad_load`, docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gateway.turns.onnx import onnx_session
from stages.messages import CALLER_RATE

WINDOW = 512
CONTEXT = 64
STATE_SHAPE = (2, 1, 128)


class SileroModel:
    """One loaded ONNX session, shared by every caller of a process (each keeps its state)."""

    def __init__(self, path: str | Path) -> None:
        self.session = onnx_session(path, "Silero VAD model")
        self._sr = np.array(CALLER_RATE, dtype=np.int64)

    def window(self, samples: np.ndarray, state: np.ndarray) -> tuple[float, np.ndarray]:
        """Speech probability of one context+window [1, 576] float32, and the next state."""
        out, next_state = self.session.run(None, {"input": samples, "state": state, "sr": self._sr})
        return float(out.reshape(-1)[0]), next_state


class SileroStream:
    """One caller's frames through Silero: `probability(frame)` per 20 ms frame."""

    def __init__(self, model: SileroModel) -> None:
        self.model = model
        self.reset()

    def reset(self) -> None:
        self._state = np.zeros(STATE_SHAPE, dtype=np.float32)
        self._pending = np.zeros(CONTEXT, dtype=np.float32)  # context, then the window filling
        self._last = 0.0

    def probability(self, frame: np.ndarray) -> float:
        """Feed one frame (int16); the probability of the newest whole window."""
        pcm = frame.astype(np.float32) / 32768.0
        self._pending = np.concatenate([self._pending, pcm])
        while len(self._pending) >= CONTEXT + WINDOW:
            chunk = self._pending[: CONTEXT + WINDOW][np.newaxis]
            self._last, self._state = self.model.window(chunk, self._state)
            self._pending = self._pending[WINDOW:]  # its last 64 samples are the next context
        return self._last
