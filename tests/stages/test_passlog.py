"""The pass log's line (passes, items a pass, time a pass and extras, averaged over its period)
and the latency log's (how many, p50, p95, max)."""

from __future__ import annotations

import logging

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
        "vocoder: first audio: 100 in 0 s, p50 50.5 ms, p95 95.0 ms, max 100.0 ms"
    )
    assert log.samples == []  # a new period starts
