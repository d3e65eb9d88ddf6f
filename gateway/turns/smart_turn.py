"""Whether the caller has finished their turn, from how it sounds: Smart Turn v3 on ONNX.

Smart Turn (pipecat's, BSD-2-Clause; `bundled:smart-turn-v3.2`, docs/models.md) reads the last
8 s of a turn as 80-bin Whisper log-mel features, zero-padded at the front, and gives the
probability that the turn is complete: intonation and an unfinished phrase say "not yet" where
a silence window can only wait. The features are faster-whisper's (the encoder's own
dependency) on the waveform normalised to zero mean and unit variance, as the model was trained.

One model serves every call of a gateway process. A prediction takes tens of milliseconds of a
core (52 ms p50 on a 2-core machine), far too long for the event loop that carries every call's
audio, so it runs on a thread of its own (onnxruntime and numpy's FFT release the GIL); calls
queue for it in order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from pathlib import Path

import numpy as np

from gateway.turns.onnx import onnx_session
from stages.messages import CALLER_RATE

logger = logging.getLogger(__name__)

WINDOW_S = 8
WINDOW_SAMPLES = CALLER_RATE * WINDOW_S
_NORMALISE_EPS = 1e-7


class SmartTurnModel:
    """Smart Turn v3 (any ONNX model with its input `input_features` [B, 80, 800] and one
    probability out), loaded from a folder holding `model.onnx` or from the file itself."""

    def __init__(self, path: str | Path, threads: int = 1) -> None:
        from faster_whisper.feature_extractor import FeatureExtractor

        self._session = onnx_session(path, "end-of-turn model", threads)
        self._input = self._session.get_inputs()[0].name
        self._features = FeatureExtractor(feature_size=80, chunk_length=WINDOW_S)
        self._lock = threading.Lock()  # one prediction at a time on the session

    def features(self, audio: np.ndarray) -> np.ndarray:
        """[80, 800] log-mel features of the last 8 s of `audio` (16 kHz int16 or float)."""
        wave = np.asarray(audio, dtype=np.float32)
        if audio.dtype == np.int16:
            wave = wave / 32768.0
        wave = wave[-WINDOW_SAMPLES:]
        wave = np.pad(wave, (WINDOW_SAMPLES - len(wave), 0))
        wave = (wave - wave.mean()) / np.sqrt(wave.var() + _NORMALISE_EPS)
        return self._features(wave, padding=0)[:, : WINDOW_SAMPLES // 160]

    def probability(self, audio: np.ndarray) -> float:
        """The probability that a turn whose audio ends with `audio` is complete."""
        batch = self.features(audio)[np.newaxis].astype(np.float32)
        with self._lock:
            (out,) = self._session.run(None, {self._input: batch})[:1]
        return float(np.asarray(out).reshape(-1)[0])


class SmartTurn:
    """A gateway process's end-of-turn predictions, off the event loop, each timed."""

    def __init__(self, model: SmartTurnModel) -> None:
        self.model = model
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="end-of-turn")

    async def probability(self, audio: np.ndarray) -> tuple[float, float]:
        """The probability that the turn is complete, and the seconds the answer took (its
        wait for the thread included)."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        p = await loop.run_in_executor(self._pool, self.model.probability, audio)
        return p, time.perf_counter() - started

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
