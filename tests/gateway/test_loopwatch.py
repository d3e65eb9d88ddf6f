"""The gateway's loop watch: a held loop and a garbage collection both show in its metrics,
and a held loop is logged with the code that held it."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from gateway.loopwatch import IDLE_TICK_S, TICK_S, LoopWatch, freeze_startup_objects
from gateway.metrics import GatewayMetrics


def count(metrics: GatewayMetrics, name: str, labels: dict[str, str] | None = None) -> float:
    return metrics.registry.get_sample_value(name, labels or {}) or 0.0


@pytest.mark.asyncio
async def test_a_held_loop_and_a_full_collection_are_observed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = GatewayMetrics()
    watch = LoopWatch(metrics.loop_lag, metrics.gc_pause, stall_s=0.05)
    watch.start()
    try:
        deadline = time.monotonic() + 5
        while count(metrics, "omni_event_loop_lag_seconds_count") < 2:  # the watch is ticking
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        time.sleep(0.12)  # what a stalled callback does to every call: holds the loop
        gc.collect()
        before = count(metrics, "omni_event_loop_lag_seconds_count")
        while count(metrics, "omni_event_loop_lag_seconds_count") == before:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
    finally:
        await watch.stop()
    on_time = count(metrics, "omni_event_loop_lag_seconds_bucket", {"le": "0.05"})
    assert count(metrics, "omni_event_loop_lag_seconds_count") - on_time >= 1  # the held tick
    assert count(metrics, "omni_gc_pause_seconds_count", {"generation": "2"}) >= 1
    assert gc.callbacks.count(watch._on_gc) == 0  # stopped: no longer called
    # the held loop was reported once, with the line that held it
    stalls = [r for r in caplog.records if "event loop held" in r.getMessage()]
    assert len(stalls) == 1 and watch.stalls_reported == 1
    assert "time.sleep(0.12)" in stalls[0].getMessage()


@pytest.mark.asyncio
async def test_with_no_call_the_watch_ticks_once_a_second_and_a_new_call_wakes_it() -> None:
    metrics = GatewayMetrics()
    calls: list[str] = []
    watch = LoopWatch(metrics.loop_lag, metrics.gc_pause, busy=lambda: bool(calls))
    loop = asyncio.get_running_loop()
    watch.start()
    try:
        await asyncio.sleep(0)  # the watch runs to its first timer
        assert watch.tick_s == IDLE_TICK_S
        assert count(metrics, "omni_event_loop_lag_seconds_count") == 0
        calls.append("call")
        woken_at = loop.time()
        watch.wake()
        while count(metrics, "omni_event_loop_lag_seconds_count") < 3:
            assert loop.time() - woken_at < IDLE_TICK_S / 2  # not after the idle second
            await asyncio.sleep(0.005)
        assert watch.tick_s == TICK_S
        calls.clear()  # the call ended: back to the idle timer after the tick in progress
        while watch.tick_s != IDLE_TICK_S:
            assert loop.time() - woken_at < 5
            await asyncio.sleep(0.005)
    finally:
        await watch.stop()


def test_start_up_objects_are_frozen_out_of_collections() -> None:
    try:
        frozen = freeze_startup_objects()
        assert frozen > 1000 and gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()
