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


async def _reply_started(call: RealtimeCall, timeout: float) -> str | None:
    """None once the agent's voice starts on `call`; else why not (a timeout, an error)."""
    try:
        await call.next_event("output_audio_buffer.started", timeout=timeout)
        return None
    except TimeoutError:
        return f"no reply within {timeout:.0f} s"
    except RuntimeError as exc:  # an error event
        return str(exc)


async def _media_flowing(call: RealtimeCall, timeout: float = 10.0) -> None:
    """Wait for the gateway's first audio frame (silence when idle): the media path is up, so
    the caller's first words are not spoken into a connection still being set up."""
    deadline = time.monotonic() + timeout
    while not call.speaker.arrivals and time.monotonic() < deadline:
        await asyncio.sleep(0.02)  # polling the receiver's frame log


async def _callers(
    base_url: str, n: int, speech48k: np.ndarray, listen_s: float, reply_timeout: float
) -> dict[str, Any]:
    calls = await asyncio.gather(*(RealtimeCall.connect(base_url) for _ in range(n)))
    try:
        for call in calls:
            await call.next_event("session.created")
        await asyncio.gather(*(_media_flowing(c) for c in calls))
        t0 = time.monotonic()
        for call in calls:
            call.microphone.play(speech48k)
        # all at once, so one call without a reply costs the others no time
        failures = await asyncio.gather(*(_reply_started(c, reply_timeout) for c in calls))
        t_replies = time.monotonic()
        await asyncio.sleep(listen_s)  # keep every call exchanging audio for a while
        end = time.monotonic()
        return {
            "call_ids": [c.call_id for c in calls],
            "replied": [f is None for f in failures],
            "failures": failures,
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
