"""The encoder's audio tower, one pass for every window that is waiting.

Each session's tower lane (stages.lanes) asks for its window's rows and waits; one thread
takes whatever windows the lanes have asked for by then and runs them through the tower in
one pass (`AudioTower.rows_of`). At 32 callers a window completes every 60 ms or so; run one
at a time, on 16 lanes, their passes were a few hundred kernel launches each, every one
holding the interpreter's lock that the recognizer's passes in the same process wait for
(docs/lab-notes.md, "Speech-in on the H200: the rerun"). Batched, the launches are those of
one pass, whatever the number of windows in it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from stages.backends.speech_in import AudioTower
from stages.passlog import PassLog

__all__ = ["BatchedTower"]


class BatchedTower:
    """An AudioTower whose `rows` may be called from many threads at once: the calls that
    wait together share one pass of at most `max_windows`. `close` (the stage stopping) lets
    the windows already asked for through and refuses any later call."""

    def __init__(
        self,
        tower: AudioTower,
        max_windows: int = 64,
        on_stream: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        """`on_stream`: the context the passes run in (stages.backends.speech.gpu_stream)."""
        self.tower = tower
        self.on_stream = on_stream
        self.window_samples, self.dim, self.dtype = tower.window_samples, tower.dim, tower.dtype
        self.max_windows = max_windows
        self.log = PassLog("audio tower", "windows")
        self._waiting: queue.SimpleQueue[
            tuple[np.ndarray, concurrent.futures.Future[np.ndarray]] | None
        ] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="encoder-tower-pass", daemon=True)
        self._thread.start()

    def rows(self, audio: np.ndarray) -> np.ndarray:
        """The window's rows, from the next pass (blocks the calling lane until then)."""
        done: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the encoder stage is stopping: no more tower passes")
            self._waiting.put((audio, done))
        return done.result()

    def rows_of(self, audios: Sequence[np.ndarray]) -> list[np.ndarray]:
        return self.tower.rows_of(audios)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._waiting.put(None)  # after every window asked for: each gets its rows
        self._thread.join()

    def _run(self) -> None:
        while True:
            first = self._waiting.get()
            if first is None:
                break
            batch = [first]
            stop = False
            while len(batch) < self.max_windows:
                try:
                    more = self._waiting.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            self._pass(batch)
            if stop:
                break

    def _pass(self, batch: list[tuple[np.ndarray, concurrent.futures.Future[np.ndarray]]]) -> None:
        started = time.monotonic()
        try:
            with self.on_stream():
                rows = self.tower.rows_of([audio for audio, _ in batch])
            if len(rows) != len(batch):
                raise RuntimeError(f"the tower gave {len(rows)} windows' rows for {len(batch)}")
        except Exception as exc:  # each lane reports it for its own session
            for _, done in batch:
                done.set_exception(exc)
            return
        self.log.add(len(batch), time.monotonic() - started)
        for (_, done), window_rows in zip(batch, rows, strict=True):
            done.set_result(window_rows)
