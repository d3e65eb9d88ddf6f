"""The gateway-scaling benchmark's figures from the callers' reports."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest

from gateway.config import ConfigError, load_config
from gateway.metrics import GatewayMetrics
from loadtest.gateway_scaling import (
    CONFIG,
    carries,
    config_for,
    gaps_at_gateway,
    load_figures,
    parse_frame_intervals,
    parse_stalls,
    stalls_at_gateway,
)


def report(end_of_speech: float, first_audio: float | None, arrivals: list[float]) -> dict:
    turn = {"onset": end_of_speech - 1.0, "end_of_speech": end_of_speech}
    turn["first_audio"] = first_audio
    return {"call_id": "rtc_g0_x", "turns": [turn], "error": None, "arrivals": arrivals}


def test_a_load_is_carried_only_when_answered_in_time_without_gaps() -> None:
    steady = [i * 0.02 for i in range(100)]
    light = load_figures([report(1.0, 1.6, steady)], {"gateway": 0.5}, 10.0, 500)
    assert light["turn_ms"]["p50"] == 600.0
    assert light["turn_beyond_vad_window_ms"]["p50"] == 100.0
    assert light["gateway_cpu_pct_of_a_core_per_session"] == 5.0
    assert carries(light)

    gap = [*steady, steady[-1] + 0.1]  # one 100 ms interval: a gap of 80 ms
    assert not carries(load_figures([report(1.0, 1.6, gap)], {"gateway": 1}, 10, 500))
    slow = load_figures([report(1.0, 2.9, steady)], {"gateway": 1}, 10, 500)
    assert carries(slow)  # a slow turn is the stages': reported, not the gateway's limit
    late = load_figures([report(1.0, 1.6, steady)], {"gateway": 1}, 10, 500)
    late["barge_in_ms"]["p95"] = 151.0
    assert not carries(late)
    unanswered = load_figures([report(1.0, None, steady)], {"gateway": 1}, 10, 500)
    assert not carries(unanswered)
    light["gaps_at_gateway"] = gaps_at_gateway(
        {"in": {"intervals": 10, "within_80ms": 10}},
        {"in": {"intervals": 60, "within_80ms": 59}, "out": {"intervals": 50, "within_80ms": 50}},
    )
    assert light["gaps_at_gateway"]["in"] == {"intervals": 50, "over_80ms": 1}
    assert not carries(light)  # a gap in what the gateway received


def test_gateway_gaps_are_read_from_its_metrics() -> None:
    metrics = GatewayMetrics()
    for interval in (0.02, 0.021, 0.09, 0.5):
        metrics.frame_interval.labels("in").observe(interval)
    metrics.frame_interval.labels("out").observe(0.02)
    counts = parse_frame_intervals(generate_latest(metrics.registry).decode())
    assert counts == {
        "in": {"intervals": 4, "within_80ms": 2},
        "out": {"intervals": 1, "within_80ms": 1},
    }


def test_gateway_stalls_are_read_from_its_metrics() -> None:
    metrics = GatewayMetrics()
    before = parse_stalls(generate_latest(metrics.registry).decode())
    for lag in (0.001, 0.002, 0.06, 0.3):
        metrics.loop_lag.observe(lag)
    for generation, pause in (("0", 0.001), ("2", 0.03), ("2", 0.015)):
        metrics.gc_pause.labels(generation).observe(pause)
    after = parse_stalls(generate_latest(metrics.registry).decode())
    assert stalls_at_gateway(before, after) == {
        "loop_late_over_50ms": 2,
        "gcs": 3,
        "full_gcs": 2,
        "gcs_over_20ms": 1,
        "gc_ms": 46.0,
    }


def test_each_variant_gets_a_config_file_of_its_own_and_bad_keys_are_refused(
    tmp_path: Path,
) -> None:
    data = yaml.safe_load(CONFIG.read_text())
    one = config_for(data, 2, 8, tmp_path, settings=(("gateway.media.udp_reads_per_wake", 1),))
    other = config_for(data, 2, 8, tmp_path, settings=(("gateway.media.udp_reads_per_wake", 32),))
    assert one != other
    assert load_config(one).gateway.media.udp_reads_per_wake == 1
    assert load_config(other).gateway.processes == 2
    with pytest.raises(ConfigError, match="udp_reads_per_wake"):
        config_for(data, 1, 8, tmp_path, settings=(("gateway.media.udp_reads_per_wake", 0),))
    with pytest.raises(ConfigError, match="no_such_key"):
        config_for(data, 1, 8, tmp_path, settings=(("gateway.no_such_key", 1),))
