"""The soak benchmark's readings (the benchmark itself runs the real service for minutes)."""

from __future__ import annotations

import os

from loadtest.soak import rss_by_process, shm_usage, table
from stages.config import PipelineConfig
from stages.rings import RingNames, RingSet


def test_shared_memory_counted_is_the_services_own() -> None:
    rings = RingSet(RingNames.fresh(), PipelineConfig())  # made by this process
    try:
        mine = shm_usage(os.getpid())
        assert mine["segments"] == 9 and mine["mib"] > 0  # control + 8 rings, pages written
        assert shm_usage(1) == {"segments": 0, "mib": 0.0}  # another owner's are not counted
    finally:
        rings.close()


def test_rss_is_read_for_this_process_and_named_as_the_service() -> None:
    rss = rss_by_process(os.getpid(), {})
    assert rss["gateway + supervisor"] > 10


def test_the_table_gives_each_process_from_minute_one_to_the_end() -> None:
    def sample(minute: float, gateway: float, shm_mib: float) -> dict:
        return {
            "minute": minute,
            "rss_mib": {"gateway + supervisor": gateway, "VLLM::EngineCore": 500.0},
            "shm": {"segments": 9, "mib": shm_mib},
        }

    result = {
        "samples": [sample(1, 180.0, 14.0), sample(30, 183.5, 14.0)],
        "sessions": 10,
        "minutes": 30,
        "turns": 2000,
        "failed_turns": 0,
        "longest_turns": 210,
        "longest_tokens": 29400,
        "context_tokens": 1024,
    }
    text = table(result)
    assert "| gateway + supervisor | 180.0 | 183.5 | +3.5 |" in text
    assert "| VLLM::EngineCore | 500.0 | 500.0 | +0.0 |" in text
    assert "2000 turns, 0 failed" in text and "context of 1024" in text
