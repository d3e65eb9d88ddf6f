"""Concurrent WebRTC callers in a process of their own, so the gateway under test does not
share its event loop with the load. The start of the load generator."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from gateway import aiortc_tuning
from gateway.client import RealtimeCall
from gateway.ice import restrict_host_addresses


def worst_gap_ms(arrivals: list[float], start: float, end: float) -> float:
    """Longest interval between consecutive frames received in [start, end]."""
    times = [t for t in arrivals if start <= t <= end]
    return float(max(np.diff(times)) * 1000) if len(times) > 1 else float("inf")


async def _callers(
    base_url: str, n: int, speech48k: np.ndarray, listen_s: float, reply_timeout: float
) -> dict[str, Any]:
    calls = await asyncio.gather(*(RealtimeCall.connect(base_url) for _ in range(n)))
    try:
        for call in calls:
            await call.next_event("session.created")
        t0 = time.monotonic()
        for call in calls:
            call.microphone.play(speech48k)
        replied = []
        for call in calls:
            try:
                await call.next_event("output_audio_buffer.started", timeout=reply_timeout)
                replied.append(True)
            except TimeoutError:
                replied.append(False)
        t_replies = time.monotonic()
        await asyncio.sleep(listen_s)  # keep every call exchanging audio for a while
        end = time.monotonic()
        return {
            "call_ids": [c.call_id for c in calls],
            "replied": replied,
            "reply_wait_s": t_replies - t0,
            "window": (t_replies, end),
            "worst_gap_in_ms": [worst_gap_ms(c.speaker.arrivals, t_replies, end) for c in calls],
            "voiced_frames": [sum(lv > 30 for lv in c.speaker.levels) for c in calls],
            "frames_sent": [c.microphone.frames_sent for c in calls],
        }
    finally:
        await asyncio.gather(*(c.close() for c in calls))


def run_callers(
    base_url: str,
    n: int,
    speech48k: np.ndarray,
    listen_s: float = 2.0,
    reply_timeout: float = 120.0,
    audio_prefetch: int = 1,
) -> dict[str, Any]:
    """Entry point for a spawned process: n callers speak once, wait for the agent's voice,
    and listen; returns what each saw (times are this host's CLOCK_MONOTONIC)."""
    aiortc_tuning.apply(audio_prefetch)
    restrict_host_addresses(["127.0.0.1"])
    return asyncio.run(_callers(base_url, n, speech48k, listen_s, reply_timeout))
