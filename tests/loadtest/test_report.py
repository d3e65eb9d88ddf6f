"""The load report's analysis: audio gaps from frame arrival times, where the pipeline
saturates, and whether memory stays flat. Made-up times; no gateway, no stages."""

from __future__ import annotations

import pytest

from loadtest.report import gap_figures, growth, load_report, saturation, shm_bytes, table

MIB = 1 << 20


def test_gaps_count_intervals_over_80_ms_per_call() -> None:
    steady = [0.02 * i for i in range(50)]
    # one 100 ms hole (an 80 ms gap in a 20 ms stream) and one 70 ms interval (not a gap)
    holed = [0.0, 0.02, 0.04, 0.14, 0.16, 0.23, 0.25]
    figures = gap_figures([steady, holed, [1.0]])  # a call with one frame has no interval
    assert figures["calls"] == 2
    assert figures["intervals_over_80ms"] == 1
    assert figures["intervals"] == 49 + 6
    assert figures["worst_interval_ms"]["max"] == pytest.approx(100)
    assert figures["worst_interval_ms"]["p50"] == pytest.approx(60)


def test_no_calls_no_gaps() -> None:
    figures = gap_figures([])
    assert figures["calls"] == 0 and figures["share_over_80ms_pct"] is None


def load(p95: float, answered: int = 6, asked: int = 6) -> dict:
    return {"turn_ms": {"p95": p95}, "turns_answered": answered, "turns_asked": asked}


def test_saturation_is_the_first_load_that_doubles_p95_or_drops_a_turn() -> None:
    assert saturation({"1": load(900), "4": load(1500), "8": load(2100)}) == 8
    assert saturation({"1": load(900), "4": load(1000, answered=5)}) == 4
    assert saturation({"1": load(900), "2": load(1000)}) is None
    assert saturation({"1": {"error": "x"}}) is None


def test_growth_reports_the_slope_per_minute() -> None:
    flat = [{"t": t, "rss": 100 * MIB} for t in range(60)]
    assert growth(flat, "rss") == {
        "first_mib": 100.0,
        "last_mib": 100.0,
        "max_mib": 100.0,
        "slope_mib_per_min": 0.0,
    }
    leaking = [{"t": t, "rss": (100 + t / 6) * MIB} for t in range(60)]  # 10 MiB a minute
    assert growth(leaking, "rss")["slope_mib_per_min"] == pytest.approx(10)
    assert growth(flat[:1], "rss") is None


def test_shm_bytes_counts_a_segment(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr("loadtest.report.SHM", tmp_path)
    (tmp_path / "omni-x").write_bytes(b"\1" * 8192)
    (tmp_path / "other").write_bytes(b"\1" * 4096)
    assert shm_bytes("omni-") >= 8192
    assert shm_bytes() >= shm_bytes("omni-") + 4096


def test_table_renders_a_failed_load_and_the_saturation_point() -> None:
    results = {"loads": {"4": {"error": "boom"}}, "memory_over_run": {}, "saturates_at": None}
    text = table(results)
    assert "| 4 | failed: boom |" in text and "not within these loads" in text


def test_a_load_counts_refused_callers_and_charges_cpu_to_admitted_sessions() -> None:
    frames = [0.02 * i for i in range(100)]
    reports = [
        {"call_id": f"rtc_{i}", "turns": [], "refused": False, "error": None, "arrivals": frames}
        for i in range(2)
    ]
    reports.append(
        {"call_id": None, "turns": [], "refused": True, "error": "gateway answered 503: full"}
    )
    figures = load_report(
        4,
        reports,
        [],
        500,
        {"rtc_0": frames},
        {"gateway": 1.0, "vocoder": 0.0},
        {"gateway": 2.0, "vocoder": 0.5},
        wall_s=10.0,
        samples=[{"t": 0, "shm": MIB, "rss_gateway": 9 * MIB}, {"t": 1, "shm": MIB}],
    )
    assert figures["sessions"] == {"callers": 4, "admitted": 2, "refused": 1, "no_report": 1}
    assert figures["errors"] == []  # a refusal is counted, not an error
    assert figures["cpu_pct_of_a_core_per_session"] == {"gateway": 5.0, "vocoder": 2.5}
    assert figures["gaps_at_callers"]["calls"] == 2 and figures["gaps_at_gateway"]["calls"] == 1
    assert figures["memory"]["shm"]["slope_mib_per_min"] == 0
    assert figures["memory"]["rss_gateway"] is None  # one sample: no trend
