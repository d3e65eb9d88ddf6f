"""The Python client's microphone and speaker: what the microphone sends and when it says each
clip started, and what both hand a speakerphone's echo path."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame

from gateway.client import FRAME, Microphone, Speaker

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


class RecordedEcho:
    """An echo path that adds a constant and records what it was given."""

    def __init__(self) -> None:
        self.plays: list[tuple[np.ndarray, float]] = []
        self.mixes: list[tuple[np.ndarray, float]] = []

    def played(self, pcm: np.ndarray, at: float) -> None:
        self.plays.append((pcm, at))

    def mix(self, speech: np.ndarray, at: float) -> np.ndarray:
        self.mixes.append((speech.copy(), at))
        return speech + 7


async def test_an_echo_path_is_mixed_into_every_frame_at_its_send_time() -> None:
    echo = RecordedEcho()
    mic = Microphone(echo)
    mic.play(clip(1000, 1))
    sent = [await mic.recv() for _ in range(3)]
    mic.stop()
    assert [int(frame.to_ndarray()[0, 0]) for frame in sent] == [1007, 7, 7]
    assert [int(speech[0]) for speech, _ in echo.mixes] == [1000, 0, 0]  # speech and silence
    assert [at for _, at in echo.mixes] == mic.send_times


async def test_the_speaker_plays_each_frame_into_the_echo_path_as_it_arrives() -> None:
    frames = [clip(value, 1) for value in (300, -300)]

    class Track:
        async def recv(self) -> AudioFrame:
            if not frames:
                raise MediaStreamError
            frame = AudioFrame.from_ndarray(frames.pop(0).reshape(1, -1), layout="mono")
            frame.sample_rate = 48000
            return frame

    echo = RecordedEcho()
    speaker = Speaker(echo)
    speaker.start(Track())
    async with asyncio.timeout(5):
        while len(speaker.frames) < 2:
            await asyncio.sleep(0.001)
    await speaker.stop()
    assert [int(pcm[0]) for pcm, _ in echo.plays] == [300, -300]
    assert [at for _, at in echo.plays] == speaker.arrivals
