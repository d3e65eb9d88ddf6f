"""The pass log's line: passes, items a pass, time a pass and extras, averaged over its period."""

from __future__ import annotations

import logging

import pytest

from stages.passlog import PassLog


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
