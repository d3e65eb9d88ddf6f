"""The pass log's line (passes, items a pass, time a pass and extras, averaged over its period)
and the latency log's (how many, p50, p95, p99, max)."""

from __future__ import annotations

import logging
import re
import time

import pytest

from stages.passlog import LatencyLog, PassLog


def test_a_line_averages_the_passes_of_its_period(caplog: pytest.LogCaptureFixture) -> None:
    log = PassLog("whisper", "windows", every_s=3600)
    with caplog.at_level(logging.INFO, logger="stages.passlog"):
        log.add(1, 0.100, waited=0.010)
        log.add(3, 0.300, waited=0.030)
        assert not caplog.records  # the period is not over
        log.every_s = 0
        log.add(2, 0.200, waited=0.020)
    (record,) = caplog.records
    assert record.getMessage() == (
        "whisper: 3 passes in 0 s, 2.0 windows a pass, 200.0 ms a pass (max 300.0), waited 20.0 ms"
    )
    assert log.count == 0  # a new period starts


def test_a_latency_line_gives_the_percentiles_of_its_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = LatencyLog("vocoder: first audio", every_s=3600)
    with caplog.at_level(logging.INFO, logger="stages.passlog"):
        for ms in range(1, 100):
            log.add(ms / 1000)
        assert not caplog.records  # the period is not over
        log.every_s = 0
        log.add(0.100)
    (record,) = caplog.records
    assert record.getMessage() == (
        "vocoder: first audio: 100 in 0 s, p50 50.5 ms, p95 95.0 ms, p99 99.0 ms, max 100.0 ms"
    )
    assert log.samples == []  # a new period starts


def test_a_cancels_hops_in_the_reasoning_stage_are_logged_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from stages.passlog import CancelHops

    hops = CancelHops()
    for log in hops.logs:
        log.every_s = 0
    pushed = time.monotonic_ns() - 30_000_000
    with caplog.at_level(logging.INFO, logger="stages.passlog"):
        hops.add([pushed, pushed + 2_000_000, pushed + 5_000_000])  # acked now, ~25 ms later
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(":")[1].strip() for line in lines] == list(CancelHops.HOPS)
    took = [float(re.search(r"p50 ([0-9.]+) ms", line)[1]) for line in lines]
    assert took[:2] == [2.0, 3.0] and 25.0 <= took[2] < 1000
