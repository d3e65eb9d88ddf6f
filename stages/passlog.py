"""Periodic log lines on a batching model: its passes (how full they were and what they took),
latencies it adds (LatencyLog), and how often each outcome of something came (CountLog).

A pass that takes longer than the work it does is worth (the audio a vocoder pass makes, the
turn end a recognizer pass answers) means callers wait; this line is where that shows first.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import numpy as np

logger = logging.getLogger(__name__)


class PassLog:
    """`add(items, took_s, **extra_s)` after every pass; every `every_s` one line says how many
    passes ran, `items` a pass, milliseconds a pass, and each extra (seconds) per pass."""

    def __init__(self, what: str, items: str, every_s: float = 10.0) -> None:
        self.what, self.items, self.every_s = what, items, every_s
        self._lock = threading.Lock()  # passes may end on several threads
        self._reset(time.monotonic())

    def _reset(self, now: float) -> None:
        self.since, self.count, self.carried, self.total_s, self.max_s = now, 0, 0, 0.0, 0.0
        self.extra_s: dict[str, float] = {}

    def add(self, items: int, took_s: float, **extra_s: float) -> None:
        with self._lock:
            self.count += 1
            self.carried += items
            self.total_s += took_s
            self.max_s = max(self.max_s, took_s)
            for key, seconds in extra_s.items():
                self.extra_s[key] = self.extra_s.get(key, 0.0) + seconds
            now = time.monotonic()
            if now - self.since < self.every_s:
                return
            extras = "".join(
                f", {key} {1000 * s / self.count:.1f} ms" for key, s in self.extra_s.items()
            )
            logger.info(
                "%s: %d passes in %.0f s, %.1f %s a pass, %.1f ms a pass (max %.1f)%s",
                self.what,
                self.count,
                now - self.since,
                self.carried / self.count,
                self.items,
                1000 * self.total_s / self.count,
                1000 * self.max_s,
                extras,
            )
            self._reset(now)


def spread_ms(seconds: list[float], percentiles: tuple[int, ...] = (50, 95, 99)) -> str:
    """`p50 X ms, p95 Y ms, ..., max Z ms` of `seconds` (one or more)."""
    values = np.percentile(seconds, percentiles) * 1000
    parts = [f"p{q} {v:.1f} ms" for q, v in zip(percentiles, values, strict=True)]
    return ", ".join([*parts, f"max {1000 * max(seconds):.1f} ms"])


class LatencyLog:
    """`add(seconds)` for every event; every `every_s`, if any came, one line with how many
    and their p50, p95, p99 and max in milliseconds."""

    def __init__(self, what: str, every_s: float = 10.0) -> None:
        self.what, self.every_s = what, every_s
        self._lock = threading.Lock()
        self.since = time.monotonic()
        self.samples: list[float] = []

    def add(self, seconds: float) -> None:
        with self._lock:
            self.samples.append(seconds)
            now = time.monotonic()
            if now - self.since < self.every_s:
                return
            logger.info(
                "%s: %d in %.0f s, %s",
                self.what,
                len(self.samples),
                now - self.since,
                spread_ms(self.samples),
            )
            self.since, self.samples = now, []


class CountLog:
    """`add(outcome)` for every event; every `every_s`, one line with how many of each
    outcome came since the last line: "`what` in N s, `how`: outcome n, ..."."""

    def __init__(self, what: str, how: str, every_s: float = 10.0) -> None:
        self.what, self.how, self.every_s = what, how, every_s
        self.totals: collections.Counter[str] = collections.Counter()
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._since = time.monotonic()

    def add(self, outcome: str) -> None:
        with self._lock:
            self.totals[outcome] += 1
            self._counts[outcome] += 1
            now = time.monotonic()
            if now - self._since < self.every_s:
                return
            logger.info(
                "%s in %.0f s, %s: %s",
                self.what,
                now - self._since,
                self.how,
                ", ".join(f"{how} {n}" for how, n in sorted(self._counts.items())),
            )
            self._counts.clear()
            self._since = now


class CancelHops:
    """Where a cancel of a reply being made spends its time in the reasoning stage, a log line
    a hop every 10 s: from the gateway's push to the event loop reading it (ring, reader thread, a
    busy loop), to vLLM's abort sent (the reply's task stopped), to the freed blocks seen (the
    engine's step in flight; see `kv_usage_after_abort`)."""

    HOPS = (
        "CANCEL pushed to read on the event loop",
        "read to vLLM's abort sent",
        "abort sent to freed blocks seen",
    )

    def __init__(self) -> None:
        self.logs = [LatencyLog(f"cancel of a reply being made: {hop}") for hop in self.HOPS]

    def add(self, stamps: list[int]) -> None:
        """As the ack goes out: `stamps` are pushed, read and abort sent (monotonic ns)."""
        stamps = [*stamps, time.monotonic_ns()]
        for log, start, end in zip(self.logs, stamps, stamps[1:], strict=False):
            log.add((end - start) / 1e9)
