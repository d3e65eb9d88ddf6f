"""What vLLM's stat loggers tell the reasoning stage, step by step: the KV-cache usage a
cancel's acknowledgement waits on (`KvUsageMonitor`), how each wait for an abort's freed blocks
ended (`AbortWaits`), and the engine's steps by kind (`StepLog`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any

import numpy as np

from stages.passlog import CountLog, spread_ms

logger = logging.getLogger(__name__)


class AbortWaits(CountLog):
    """How each wait for an abort's freed KV blocks ended, as a log line every `every_s`.

    `freed_first_step`: the first stats record after the cancel showed less usage (or an empty
    scheduler); `freed_later_step`: a later one did (the first left the engine core before the
    abort reached it); `hidden`: two records after the abort went out, usage had not fallen,
    since other replies took as many new blocks; `idle_after_abort`: the aborts left the engine
    nothing to run, and a round trip through its input queue confirmed them; `timed_out`;
    `nothing_held`. An ack that
    waited for a second step is one of `freed_later_step` and `hidden`."""

    def __init__(self, every_s: float = 10.0) -> None:
        super().__init__("vLLM aborts", "how their freed blocks were seen", every_s)


class StepLog:
    """vLLM's steps as this process sees them (a stats record a step), a line every `every_s`:
    the time from one record to the next while the engine had requests, the steps that
    finished a prompt's prefill counted apart. A cancel's ack waits for the rest of the step in
    flight, so its tail is the long steps', and this says which kind they are. (Under vLLM's
    asynchronous scheduling, its default, a step is scheduled while the one before runs, and a
    long step's interval shows on the record after its own: run synchronously to tell them
    apart.) The line ends with the share of the KV cache's blocks held, over the busy records:
    what prefilling turns while the caller speaks costs in memory."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._last: float | None = None  # the previous record, if the engine was busy then
        self._since: float | None = None
        self._decode: list[float] = []
        self._prefill: list[float] = []
        self._prompt_tokens = 0
        self._usage: list[float] = []

    def add(self, now: float, busy: bool, prompt_tokens: int, usage: float = 0.0) -> None:
        """A record at `now` (monotonic s); `busy`: the engine had requests after its step;
        `usage`: the share of KV blocks held after it."""
        if self._since is None:
            self._since = now
        if self._last is not None:
            (self._prefill if prompt_tokens else self._decode).append(now - self._last)
            self._prompt_tokens += prompt_tokens
            self._usage.append(usage)
        self._last = now if busy else None
        if now - self._since < self.every_s or not (self._decode or self._prefill):
            return
        p50, p99 = np.percentile(self._usage, (50, 99)) * 100
        logger.info(
            "vLLM steps in %.0f s, record to record: %s; %s; KV cache held p50 %.1f%%, "
            "p99 %.1f%%, max %.1f%%",
            now - self._since,
            _spread("decoding only", self._decode),
            _spread(
                f"finishing a prefill ({self._prompt_tokens / max(len(self._prefill), 1):.0f}"
                " prompt tokens a step)",
                self._prefill,
            ),
            p50,
            p99,
            100 * max(self._usage),
        )
        self._since, self._decode, self._prefill, self._prompt_tokens = now, [], [], 0
        self._usage = []


def _spread(what: str, seconds: list[float]) -> str:
    return f"{what} {len(seconds)}, {spread_ms(seconds, (50, 99))}" if seconds else f"{what} 0"


class KvUsageMonitor:
    """Latest KV-cache usage reported by the engine, with waiters for it to fall to idle.

    Updated from the stat logger, which ``AsyncLLM`` calls on its output-handler task, i.e. on the
    event loop that runs the engine, once for every batch of engine outputs.
    """

    def __init__(self) -> None:
        self.usage = 0.0
        self.seq = 0  # stats records seen
        self.requests = 0
        self.updated_at = 0.0
        self._changed: asyncio.Event | None = None
        self.abort_waits = AbortWaits()
        self.steps = StepLog()

    def update(self, usage: float, requests: int = 0, prompt_tokens: int = 0) -> None:
        self.seq += 1
        self.usage = usage
        self.requests = requests  # running + waiting in the scheduler at that step
        self.updated_at = time.monotonic()
        self.steps.add(self.updated_at, requests > 0, prompt_tokens, usage)
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    async def wait_seq(self, seq: int, timeout: float) -> float:
        """The usage once the `seq`-th stats record has arrived, or the latest after `timeout`."""
        deadline = time.monotonic() + timeout
        while self.seq < seq and (remaining := deadline - time.monotonic()) > 0:
            if self._changed is None:
                self._changed = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return self.usage

    async def wait_idle(self, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while self.usage > 0.0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"KV cache usage still {self.usage:.1%} after waiting {timeout:.3f} s for idle"
                )
            if self._changed is None:
                self._changed = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        return self.usage


@functools.cache
def kv_stat_logger_class() -> type:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class KvUsageStatLogger(StatLoggerBase):
        """Feeds ``SchedulerStats.kv_cache_usage`` of every engine step to a monitor."""

        def __init__(
            self, vllm_config: Any, engine_index: int = 0, *, monitor: KvUsageMonitor
        ) -> None:
            self.engine_index = engine_index
            self.monitor = monitor

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                self.monitor.update(
                    scheduler_stats.kv_cache_usage,
                    scheduler_stats.num_running_reqs + scheduler_stats.num_waiting_reqs,
                    # prompts whose prefill ended this step (their first token came)
                    getattr(iteration_stats, "num_prompt_tokens", 0),
                )

        def log_engine_initialized(self) -> None:
            pass

    return KvUsageStatLogger
