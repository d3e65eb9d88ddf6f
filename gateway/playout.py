"""The agent's voice as an aiortc audio track: 20 ms frames on the wall clock, never a gap.

aiortc's sender pulls `recv()` in a loop and sends whatever it gets, so the track itself sets the
pace: one 20 ms frame (mono s16, 48 kHz unless told otherwise) every 20 ms on an absolute
schedule, audio from the queue when there is some and silence when there is none. The queue
is what barge-in empties: `clear()` drops everything not yet returned, so the next frame is
already silent. While it is idle (silence going out), audio queued between two beats goes out
at once and the beat moves with it, instead of waiting up to 20 ms for the next one.
"""

from __future__ import annotations

import asyncio
import collections
import fractions
import logging
import time
from collections.abc import Callable

import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

__all__ = ["FRAME_SAMPLES", "PLAYOUT_RATE", "PlayoutTrack"]

logger = logging.getLogger(__name__)

PLAYOUT_RATE = 48_000
FRAME_SAMPLES = 960  # 20 ms, aiortc's audio packetization time


class PlayoutTrack(MediaStreamTrack):
    """Queue of agent audio played out in real time to one caller.

    Hooks run on the event loop inside `recv()`, right after the frame they concern is handed to
    the sender (an exception in one is logged, never allowed to stall the audio):
    - `on_started()`: the first frame with audio after idle (`output_audio_buffer.started`);
    - `on_stopped()`: the frame that drained the queue went out. A vocoder that falls behind
      drains it too, so the session should report `output_audio_buffer.stopped` only once the
      response is done (or enqueue a mark after the last chunk);
    - `on_mark(mark)`: the last sample of the chunk enqueued with `mark` went out;
    - `on_interval(s)`: seconds since the previous frame was handed over (for gap metrics;
      called before the frame is made);
    - `on_played(pcm, at)`: a frame with audio went out; `at` is its time on the playout
      clock (the loop's, time.monotonic()), which the caller hears it by: the echo
      canceller's far end.
    `clear()` fires none of them: the caller knows it cleared, and dropped marks are discarded.
    Not thread-safe: enqueue from the event loop (the ring reader threads hop over with
    `loop.call_soon_threadsafe`).
    """

    kind = "audio"

    def __init__(
        self,
        *,
        on_started: Callable[[], None] | None = None,
        on_stopped: Callable[[], None] | None = None,
        on_mark: Callable[[object], None] | None = None,
        on_interval: Callable[[float], None] | None = None,
        on_played: Callable[[np.ndarray, float], None] | None = None,
        max_lag_s: float = 0.2,
        rate: int = PLAYOUT_RATE,
    ) -> None:
        super().__init__()
        self.on_started = on_started
        self.on_stopped = on_stopped
        self.on_mark = on_mark
        self.on_interval = on_interval  # seconds since the previous frame went out
        self.on_played = on_played
        self._last_sent: float | None = None
        self.max_lag_s = max_lag_s
        self.rate = rate  # 48 kHz for aiortc's own encoder; an Opus rate for opuslib's
        self.frame_samples = rate // 50  # 20 ms
        self._time_base = fractions.Fraction(1, rate)
        self.played_samples = 0  # audio samples sent, silence not counted
        self._chunks: collections.deque[tuple[np.ndarray, object | None]] = collections.deque()
        self._head_offset = 0  # samples of _chunks[0] already sent
        self._queued = 0
        self._playing = False
        # True: silence goes out and the queue waits (the caller may be starting to talk over
        # the agent: nothing is lost if not); clear() resets it
        self.held = False
        self._start: float | None = None
        self._pts = 0
        self._silence = np.zeros(self.frame_samples, np.int16)
        self._idle_wait: asyncio.Future[None] | None = None  # set while idle between beats

    @property
    def is_playing(self) -> bool:
        """True from the first audio frame until the queue drains or is cleared."""
        return self._playing

    @property
    def queued_samples(self) -> int:
        """Samples waiting to be played."""
        return self._queued

    def enqueue(self, pcm: np.ndarray, mark: object | None = None) -> None:
        """Queue mono PCM16 at the track's rate (any length, copied); `mark` is reported once
        it has played."""
        pcm = np.array(pcm, dtype=np.int16, copy=True).reshape(-1)
        if len(pcm) == 0 and mark is None:
            return
        self._chunks.append((pcm, mark))
        self._queued += len(pcm)
        woken = self._idle_wait
        if len(pcm) and not self.held and woken is not None and not woken.done():
            woken.set_result(None)  # the first audio after idle: no beat to wait for

    def clear(self) -> int:
        """Drop all queued audio at once (barge-in); return how many samples were dropped."""
        dropped = self._queued
        self._chunks.clear()
        self._head_offset = 0
        self._queued = 0
        self._playing = False
        self.held = False
        return dropped

    def stop(self) -> None:
        self.clear()
        super().stop()

    async def recv(self) -> AudioFrame:
        """The next 20 ms frame, at its time on the wall clock."""
        if self.readyState != "live":
            raise MediaStreamError
        await self._wait_for_slot()
        if self.on_interval is not None:
            now = time.monotonic()
            if self._last_sent is not None:
                self.on_interval(now - self._last_sent)
            self._last_sent = now
        pcm, played, marks = self._take_frame()
        frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.rate
        frame.pts = self._pts
        frame.time_base = self._time_base
        self._report(played, marks)
        if played and self.on_played is not None:
            assert self._start is not None
            self._call(self.on_played, pcm, self._start + self._pts / self.rate)
        return frame

    async def _wait_for_slot(self) -> None:
        loop = asyncio.get_running_loop()
        if self._start is None:
            self._start = loop.time()
            return
        self._pts += self.frame_samples
        due = self._start + self._pts / self.rate
        wait = due - loop.time()
        if wait > 0 and (self._playing or self._queued or self.held):
            await asyncio.sleep(wait)  # mid-stream: keep the beat
        elif wait > 0:
            await self._idle_until(loop, wait)
            early = due - loop.time()
            if early > 0:  # audio came: it goes now, and the frames after it from now on
                self._start -= early
        elif wait < -self.max_lag_s:
            # The loop stalled (or nobody pulled for a while): move the schedule rather than burst
            # out the backlog as fast as the sender can take it. pts stays continuous.
            self._start -= wait

    async def _idle_until(self, loop: asyncio.AbstractEventLoop, wait: float) -> None:
        """Sleep `wait` seconds, or until `enqueue` brings audio (an asyncio.sleep that can be
        woken)."""
        woken = self._idle_wait = loop.create_future()
        timer = loop.call_later(wait, lambda: woken.done() or woken.set_result(None))
        try:
            await woken
        finally:
            timer.cancel()
            self._idle_wait = None

    def _take_frame(self) -> tuple[np.ndarray, int, list[object]]:
        """(one frame of samples, how many of them are audio, marks completed by this frame)."""
        marks: list[object] = []
        if not self._chunks or self.held:
            return self._silence, 0, marks
        out = np.zeros(self.frame_samples, np.int16)
        filled = 0
        while self._chunks:
            chunk, mark = self._chunks[0]
            take = min(self.frame_samples - filled, len(chunk) - self._head_offset)
            out[filled : filled + take] = chunk[self._head_offset : self._head_offset + take]
            filled += take
            self._head_offset += take
            if self._head_offset < len(chunk):
                break  # the frame is full
            self._chunks.popleft()
            self._head_offset = 0
            if mark is not None:
                marks.append(mark)
        self._queued -= filled
        # A short tail (end of speech, or a vocoder underrun) is padded with silence.
        return out, filled, marks

    def _report(self, played: int, marks: list[object]) -> None:
        self.played_samples += played
        if played and not self._playing:
            self._playing = True
            self._call(self.on_started)
        for mark in marks:
            self._call(self.on_mark, mark)
        if self._playing and self._queued == 0 and not self.held:
            self._playing = False
            self._call(self.on_stopped)

    def _call(self, hook: Callable[..., None] | None, *args: object) -> None:
        if hook is None:
            return
        try:
            hook(*args)
        except Exception:
            logger.exception("playout hook %r failed", hook)
