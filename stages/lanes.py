"""Per-session lanes on a thread pool: each session's work runs in order, sessions in parallel.

A stage whose model calls are long (a recognizer finishing a turn) runs them here, so its model
loop stays free to acknowledge a CANCEL at once instead of after the call in progress. Models
that release the GIL (torch on a GPU, C decoders) also get real overlap between sessions.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)


class SessionLanes:
    """`submit(session, job)` runs `job` after the session's earlier jobs, on one of `threads`
    worker threads. A job that raises is logged and passed to `on_error`; the lane goes on."""

    def __init__(
        self,
        threads: int,
        name: str,
        on_error: Callable[[int, BaseException], None] | None = None,
    ) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._on_error = on_error
        self._lock = threading.Lock()
        self._queued: dict[int, collections.deque[Callable[[], None]]] = {}

    def submit(self, session: int, job: Callable[[], None]) -> None:
        with self._lock:
            lane = self._queued.get(session)
            if lane is not None:  # the lane is draining: the job joins its queue
                lane.append(job)
                return
            self._queued[session] = collections.deque((job,))
        self._pool.submit(self._drain, session)

    def _drain(self, session: int) -> None:
        while True:
            with self._lock:
                lane = self._queued[session]
                if not lane:
                    del self._queued[session]
                    return
                job = lane.popleft()
            try:
                job()
            except Exception as exc:
                logger.exception("session %d: job failed", session)
                if self._on_error is not None:
                    self._on_error(session, exc)

    def pending(self) -> int:
        """Jobs queued and not started, over all sessions."""
        with self._lock:
            return sum(len(lane) for lane in self._queued.values())

    def close(self, wait: bool = True) -> None:
        """Run what is queued (wait=True) or drop it, then stop the threads."""
        if not wait:
            with self._lock:
                for lane in self._queued.values():
                    lane.clear()
        self._pool.shutdown(wait=True)
