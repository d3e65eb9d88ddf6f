"""The Python client's microphone: what it sends and when it says each clip started."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.client import FRAME, Microphone

pytestmark = pytest.mark.asyncio


def clip(value: int, frames: int) -> np.ndarray:
    return np.full(frames * FRAME, value, np.int16)


async def test_clip_played_behind_another_starts_when_its_own_first_frame_leaves() -> None:
    """A clip queued while the previous one is still going out starts after it: its start time
    is taken when its own first frame leaves, not the next frame of the clip before it."""
    mic = Microphone()
    mic.play(clip(1000, 3))
    sent = [await mic.recv()]
    mic.play(clip(2000, 2))  # two frames of the first clip are still queued
    starts_seen = [len(mic.clip_started)]
    for _ in range(5):
        sent.append(await mic.recv())
        starts_seen.append(len(mic.clip_started))
    mic.stop()

    values = [int(frame.to_ndarray()[0, 0]) for frame in sent]
    assert values == [1000, 1000, 1000, 2000, 2000, 0]
    # the second clip's start is counted with frame 3, its first, and at the time it left
    assert starts_seen == [1, 1, 1, 2, 2, 2]
    assert mic.clip_started[1] == pytest.approx(mic.send_times[3], abs=1e-3)
    assert mic.clip_started[1] - mic.clip_started[0] >= 0.05  # three 20 ms frames later


async def test_empty_clip_marks_no_start() -> None:
    mic = Microphone()
    mic.play(np.zeros(0, np.int16))
    mic.play(clip(500, 1))
    await mic.recv()
    mic.stop()
    assert len(mic.clip_started) == 1
