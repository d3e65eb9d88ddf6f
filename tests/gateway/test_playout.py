"""gateway.playout: 20 ms pacing without drift, silence when idle, barge-in within one frame."""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError

from gateway.playout import FRAME_SAMPLES, PLAYOUT_RATE, PlayoutTrack


def tone(samples: int) -> np.ndarray:
    t = np.arange(samples) / PLAYOUT_RATE
    return (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16) | 1  # never exactly 0


async def test_frames_are_paced_at_20ms_without_drift() -> None:
    # No resynchronisation here, so a host hiccup (this is a shared 2-core box) shows up as a
    # few late frames followed by a catch-up, not as a moved schedule.
    track = PlayoutTrack(max_lag_s=60)
    loop = asyncio.get_running_loop()
    track.enqueue(tone(PLAYOUT_RATE))  # 1 s of audio then 1 s of silence
    stamps, frames = [], []
    for _ in range(101):
        frames.append(await track.recv())
        stamps.append(loop.time())
    intervals = np.diff(stamps) * 1000
    # How late each frame came against an exact 20 ms grid from the first one.
    late_ms = (np.array(stamps) - stamps[0] - np.arange(101) * 0.020) * 1000
    print(
        f"\npacing over 2 s: median interval {statistics.median(intervals):.2f} ms, "
        f"lateness median {np.median(late_ms):.2f} ms, max {late_ms.max():.2f} ms, "
        f"last frame {late_ms[-1]:.2f} ms"
    )
    assert statistics.median(intervals) == pytest.approx(20, abs=1)
    assert late_ms.min() > -0.5  # never early
    # No drift: frames in the last quarter are as punctual as the rest (within a margin that a
    # loaded 2-core machine's timer wake-ups stay in; a drift of 0.1 ms a frame exceeds it).
    assert np.median(late_ms) < 5 and np.median(late_ms[75:]) < 5
    assert [f.pts for f in frames] == [i * FRAME_SAMPLES for i in range(101)]
    first = frames[0]
    assert (first.sample_rate, first.samples, first.format.name, first.layout.name) == (
        PLAYOUT_RATE, FRAME_SAMPLES, "s16", "mono",
    )  # fmt: skip
    assert first.time_base.numerator == 1 and first.time_base.denominator == PLAYOUT_RATE


async def test_silence_when_nothing_is_queued() -> None:
    started = []
    track = PlayoutTrack(on_started=lambda: started.append(True))
    for _ in range(3):
        frame = await track.recv()
        assert not frame.to_ndarray().any()
    assert not track.is_playing and track.played_samples == 0 and not started


async def test_audio_comes_out_in_order_and_the_tail_is_padded() -> None:
    track = PlayoutTrack()
    audio = tone(2 * FRAME_SAMPLES + 100)
    track.enqueue(audio[:700])
    track.enqueue(audio[700:])
    out = np.concatenate([(await track.recv()).to_ndarray().reshape(-1) for _ in range(4)])
    np.testing.assert_array_equal(out[: len(audio)], audio)
    assert not out[len(audio) :].any()
    assert track.played_samples == len(audio) and track.queued_samples == 0


async def test_audio_queued_while_idle_goes_out_at_once_and_the_beat_moves() -> None:
    """Silence is going out; audio queued between two beats is the next frame, at once, not
    at the next beat; the frames after it keep 20 ms from there."""
    track = PlayoutTrack(max_lag_s=60)
    loop = asyncio.get_running_loop()
    for _ in range(3):
        await track.recv()  # idle: silence on the beat
    waiting = asyncio.ensure_future(track.recv())
    deadline = loop.time() + 1
    while track._idle_wait is None:  # until it waits for its beat
        assert loop.time() < deadline
        await asyncio.sleep(0)
    beat = track._start + (track._pts / track.rate)
    track.enqueue(tone(FRAME_SAMPLES * 3))
    frame = await waiting
    sent = loop.time()
    assert np.abs(frame.to_ndarray()).max() > 1000  # the audio, not silence
    assert sent < beat - 0.005  # well before the beat it would have waited for
    stamps = [sent]
    for _ in range(3):
        await track.recv()
        stamps.append(loop.time())
    assert np.diff(stamps) == pytest.approx([0.02] * 3, abs=0.006)  # paced from the new beat
    # mid-stream and held, nothing wakes it early
    track.held = True
    track.enqueue(tone(FRAME_SAMPLES))
    assert track._idle_wait is None


async def test_clear_silences_the_next_frame() -> None:
    track = PlayoutTrack()
    track.enqueue(tone(PLAYOUT_RATE))
    for _ in range(3):
        assert (await track.recv()).to_ndarray().all()
    assert track.is_playing
    dropped = track.clear()
    assert dropped == PLAYOUT_RATE - 3 * FRAME_SAMPLES
    assert not track.is_playing and track.queued_samples == 0
    assert not (await track.recv()).to_ndarray().any()
    assert track.played_samples == 3 * FRAME_SAMPLES
    assert track.clear() == 0


async def test_hold_silences_without_dropping_and_resume_plays_on() -> None:
    stopped: list[bool] = []
    track = PlayoutTrack(on_stopped=lambda: stopped.append(True))
    audio = tone(4 * FRAME_SAMPLES)
    track.enqueue(audio)
    first = (await track.recv()).to_ndarray().reshape(-1)
    track.held = True
    for _ in range(3):  # the caller may be talking: silence, the queue kept
        assert not (await track.recv()).to_ndarray().any()
    assert track.held and track.is_playing and not stopped
    assert track.queued_samples == 3 * FRAME_SAMPLES
    track.held = False  # it was not a barge-in: the agent goes on where it was
    rest = [(await track.recv()).to_ndarray().reshape(-1) for _ in range(3)]
    np.testing.assert_array_equal(np.concatenate([first, *rest]), audio)
    assert stopped == [True] and track.played_samples == len(audio)
    track.enqueue(audio)
    track.held = True
    track.clear()  # it was: the queue goes, and the hold with it
    assert not track.held and track.queued_samples == 0


async def test_started_stopped_and_marks_fire_when_their_audio_goes_out() -> None:
    log: list[tuple[str, object]] = []
    track = PlayoutTrack(
        on_started=lambda: log.append(("started", track.played_samples)),
        on_stopped=lambda: log.append(("stopped", track.played_samples)),
        on_mark=lambda mark: log.append((f"mark {mark}", track.played_samples)),
    )
    await track.recv()  # idle
    track.enqueue(tone(FRAME_SAMPLES + 10), mark="a")
    track.enqueue(tone(FRAME_SAMPLES), mark="b")
    track.enqueue(np.zeros(0, np.int16), mark="end of response")
    for _ in range(4):
        await track.recv()
    assert log == [
        ("started", 960),
        ("mark a", 1920),  # its last 10 samples went out in the second frame
        ("mark b", 1930),
        ("mark end of response", 1930),
        ("stopped", 1930),
    ]
    # After a clear the next audio is a new start; dropped marks never fire.
    track.enqueue(tone(5 * FRAME_SAMPLES), mark="dropped")
    await track.recv()
    track.clear()
    track.enqueue(tone(FRAME_SAMPLES))
    await track.recv()
    assert [name for name, _ in log[5:]] == ["started", "started", "stopped"]


async def test_a_failing_hook_does_not_stall_the_audio(caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> None:
        raise RuntimeError("session gone")

    track = PlayoutTrack(on_started=broken)
    track.enqueue(tone(2 * FRAME_SAMPLES))
    assert (await track.recv()).to_ndarray().all()
    assert (await track.recv()).to_ndarray().all()
    assert "playout hook" in caplog.text


async def test_a_stalled_consumer_does_not_get_a_burst() -> None:
    """After a long stall the schedule moves on instead of returning the backlog at once."""
    track = PlayoutTrack(max_lag_s=0.1)
    loop = asyncio.get_running_loop()
    await track.recv()
    time.sleep(0.3)  # a blocked event loop: the stall under test, not a synchronisation
    await track.recv()  # behind by ~0.3 s: resynchronised, returned at once
    before = loop.time()
    await track.recv()
    assert loop.time() - before >= 0.015  # a full frame period again, not the backlog


async def test_stopped_track_raises() -> None:
    track = PlayoutTrack()
    track.enqueue(tone(FRAME_SAMPLES))
    track.stop()
    assert track.queued_samples == 0
    with pytest.raises(MediaStreamError):
        await track.recv()
