"""Per-frame speech classifiers for the turn detector: webrtcvad, or Silero on ONNX.

`threshold` is OpenAI's (0..1, default 0.5): higher means louder, clearer speech is needed.
Silero's is its probability's. webrtcvad has four aggressiveness modes, so the range is cut in
quarters: [0, 0.25) → 0, [0.25, 0.5) → 1, [0.5, 0.75) → 2, [0.75, 1] → 3. The default lands on
mode 2, the most accurate on speech at 16 kHz (frame accuracy 0.96).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import webrtcvad

from gateway.turns.silero import SileroModel, SileroStream
from stages.messages import CALLER_RATE


def aggressiveness_for(threshold: float) -> int:
    """webrtcvad mode (0-3) for an OpenAI-style threshold in [0, 1], by quarters."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be within [0, 1], got {threshold}")
    return min(3, int(threshold * 4))


class SpeechClassifier(Protocol):
    """Whether one caller's 20 ms frame is speech; it may keep state from frame to frame."""

    def set_threshold(self, threshold: float) -> None: ...

    def is_speech(self, frame: np.ndarray) -> bool: ...


class WebrtcClassifier:
    """webrtcvad's decision, its aggressiveness mode from the threshold by quarters."""

    def __init__(self, threshold: float = 0.5) -> None:
        self._vad = webrtcvad.Vad()
        self.set_threshold(threshold)

    def set_threshold(self, threshold: float) -> None:
        self._vad.set_mode(aggressiveness_for(threshold))

    def is_speech(self, frame: np.ndarray) -> bool:
        return bool(self._vad.is_speech(frame.tobytes(), CALLER_RATE))


class SileroClassifier:
    """Silero's probability against the threshold."""

    def __init__(self, model: SileroModel, threshold: float = 0.5) -> None:
        self._stream = SileroStream(model)
        self.set_threshold(threshold)

    def set_threshold(self, threshold: float) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be within [0, 1], got {threshold}")
        self.threshold = threshold

    def is_speech(self, frame: np.ndarray) -> bool:
        return self._stream.probability(frame) >= self.threshold
