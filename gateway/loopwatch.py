"""What stalls a gateway process's event loop: its lag, and the garbage collector's pauses.

One event loop carries every call of a gateway process; while it is held, every call's audio
waits (a stall of 100 ms is a gap in all of them at once). `LoopWatch` measures how late the
loop wakes a 20 ms timer (the frame period) and how long each garbage collection holds the
process, into the process's metrics, so a load test can tell the two apart. With no call in
the process the timer is set once a second (a 20 ms timer was most of an idle gateway's CPU)
and `wake()` brings it back to 20 ms when a call comes.

With a stall threshold, a thread of its own also logs the loop thread's stack whenever the
loop has not ticked for that long: what held it, caught in the act.

`freeze_startup_objects()` moves everything allocated so far (the imports, the configuration,
the app) into the collector's permanent generation: a full collection then scans only what
the calls allocate, not the ~80k objects of the process's start.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from prometheus_client import Histogram

from stages.tasks import cancel_and_wait

logger = logging.getLogger(__name__)

TICK_S = 0.02  # the frame period: a lag is what a frame due now waits
IDLE_TICK_S = 1.0  # no call: no frame is due, and the process should cost next to nothing
MAX_STALL_REPORTS = 100  # per process: enough to see the pattern, never a flood of logs


def freeze_startup_objects() -> int:
    """Collect once, then exempt every surviving object from later collections; returns how
    many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def where(frame: Any, depth: int = 12) -> str:
    """A stack on one log line, innermost call first: `func (file:line) <- caller (...)`,
    with the innermost line's code."""
    frames = traceback.extract_stack(frame)[-depth:][::-1]
    if not frames:
        return "?"
    calls = " <- ".join(
        f"{f.name} ({'/'.join(f.filename.split('/')[-2:])}:{f.lineno})" for f in frames
    )
    return f"{calls} | {frames[0].line}"


class LoopWatch:
    """Observes loop lag and GC pauses into two histograms while started; with `stall_s`,
    logs the loop's stack each time it is held that long. `busy()` says whether a call is in
    progress: only then does the watch tick at the frame period."""

    def __init__(
        self,
        lag: Histogram,
        gc_pause: Histogram,
        stall_s: float | None = None,
        busy: Callable[[], bool] = lambda: True,
    ) -> None:
        self._lag = lag
        self._gc_pause = gc_pause
        self._gc_started: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._stall_s = stall_s
        self._busy = busy
        self._woken = asyncio.Event()
        self.tick_s = TICK_S  # the timer in progress
        self._ticked = time.monotonic()
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None
        self.stalls_reported = 0

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="loop-watch")
        if self._stall_s is not None:
            self._ticked = time.monotonic()
            self._reporter = threading.Thread(
                target=self._report_stalls,
                args=(threading.get_ident(), self._stall_s),
                name="loop-stall-reporter",
                daemon=True,
            )
            self._reporter.start()

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        self._stop.set()
        if self._reporter is not None:
            await asyncio.to_thread(self._reporter.join)
        if self._task is not None:
            await cancel_and_wait(self._task)

    def wake(self) -> None:
        """A call has come: tick at the frame period from now, not after the idle timer."""
        self._woken.set()

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.tick_s = TICK_S if self._busy() else IDLE_TICK_S
            due = loop.time() + self.tick_s
            woken = False
            if self.tick_s == TICK_S:
                await asyncio.sleep(TICK_S)
            else:
                self._woken.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), IDLE_TICK_S)
                    woken = True
            self._ticked = time.monotonic()
            if not woken:  # woken early, it was not late
                self._lag.observe(max(0.0, loop.time() - due))

    def _report_stalls(self, loop_thread: int, stall_s: float) -> None:
        """Log the loop thread's stack once per stall longer than `stall_s` (beyond the tick)."""
        reported_tick = None
        while not self._stop.wait(stall_s / 4):
            ticked = self._ticked
            held = time.monotonic() - ticked - self.tick_s
            if held < stall_s or ticked == reported_tick:
                continue
            reported_tick = ticked
            frame = sys._current_frames().get(loop_thread)
            if frame is None or self.stalls_reported >= MAX_STALL_REPORTS:
                continue
            self.stalls_reported += 1
            logger.warning("event loop held for %.0f ms so far, at %s", 1000 * held, where(frame))

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started is not None:
            pause = time.perf_counter() - self._gc_started
            self._gc_pause.labels(str(info.get("generation", "?"))).observe(pause)
            self._gc_started = None
