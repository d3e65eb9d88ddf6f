"""Echo cancelling: the agent's own voice taken out of the caller's audio before the VAD, the
turn models and the encoder hear it. A caller on a speakerphone or a car kit sends the agent's
voice back a few tens to a few hundred ms late; without this the agent interrupts itself, or
pauses at every echo and hears its own words as the caller's turn.

The canceller is WebRTC's audio processing module (AEC3, its noise suppressor and high-pass
filter) as the `livekit` package ships it (`rtc.AudioProcessingModule`; docs/lab-notes.md,
"Echo cancelling: the packages compared"). AEC3 finds the echo's delay by itself, 0-350 ms
after its reference, but it cannot cancel an echo that comes before its reference, and it
loses about 20 dB for a second after the reference skips a gap. So the far end it is given
is `PlayedAudio`: what the caller was played, on the gateway's clock, silence included, a
far-end frame for each of the caller's. The transports know when it played: WebRTC from its
playout clock, the phone from its send-ahead window and the marks Twilio echoes, a WebSocket
client from when its audio was sent. What AEC3 lets through when the echo path moves,
`ResidualEcho` finds and brings down. With no echo in the microphone (a headset, a handset),
AEC3's suppressor takes words the caller says over the agent for echo, so a second module
without the canceller runs beside it, and its output is used while `EchoPath` finds no echo.

`audio_processing` and `EchoPath` are the decisions (which processing a session gets, and
whether its microphone hears the agent); `EchoCanceller` is the plumbing. A 10 ms frame costs
about 120 µs (both modules, both directions; 85 with one), about 1.2% of a core a call; the
modules' calls run on one thread of their own (`worker`), not the event loop.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from gateway.resample import Upsampler
from stages.messages import CALLER_RATE

__all__ = [
    "AudioProcessing",
    "EchoCanceller",
    "EchoPath",
    "PlayedAudio",
    "audio_processing",
    "worker",
]

FRAME = CALLER_RATE // 100  # 10 ms: the only frame the module takes
# The far end is taken this far behind the caller's audio's arrival: what the transport
# places as it plays (a WebRTC frame as it is sent) is there a loop's jitter late, and the
# caller's audio that comes sooner than the first did keeps the same far end this much
MARGIN = 4 * FRAME
EARLY = 2 * FRAME  # the caller's audio this much sooner than before is not placed again
MAX_LAG = CALLER_RATE // 10  # the far end this far behind its place is placed again
SILENT_DBFS = -100.0
RECENT_FRAMES = 50  # the far end's last half second, for ResidualEcho
LEAK_GAIN = 10 ** (-30 / 20)  # a frame of leaked echo is brought 30 dB down
AEC3_DELAY = 128  # samples: how much later the echo canceller's output comes than without it


@dataclass(frozen=True)
class AudioProcessing:
    """What one session's caller audio goes through (the high-pass filter with either)."""

    echo: bool  # the agent's echo cancelled
    noise: bool  # WebRTC's noise suppressor


def audio_processing(
    transport_default: bool, noise_reduction: str | None, noise_suppression: bool = True
) -> AudioProcessing | None:
    """The session's processing: `noise_reduction` as the Realtime client set it
    (`far_field`: a speakerphone or a laptop, the echo cancelled and the noise suppressed;
    `near_field`: a headset, whose mic hears no loudspeaker, only the noise suppressed), or
    when it set none, the transport's default (gateway.media.echo_cancel), with
    `noise_suppression` beside it. None: the audio goes through untouched."""
    if noise_reduction == "far_field":
        return AudioProcessing(echo=True, noise=True)
    if noise_reduction == "near_field":
        return AudioProcessing(echo=False, noise=True)
    if transport_default:
        return AudioProcessing(echo=True, noise=noise_suppression)
    return None


@dataclass(frozen=True)
class ResidualEcho:
    """Whether a 10 ms frame out of the canceller is only what is left of the agent's echo.
    AEC3 leaves 25-45 dB of it out, but after an echo path changes (the caller's jitter
    buffer moves) it leaks for a moment 10-20 dB under the echo, which a VAD calls speech.
    A frame the canceller took `cancelled_db` out of, and that is `below_far_db` under what
    the agent played in the last half second, is such a leak: the caller talking over the
    agent keeps most of their frame's level. A caller 8 dB quieter than the echo at their
    own microphone is lost with it."""

    cancelled_db: float = 8.0
    below_far_db: float = 15.0

    def only_echo(self, heard_dbfs: float, left_dbfs: float, played_dbfs: float) -> bool:
        """`heard_dbfs`: the frame as it came; `left_dbfs`: after the canceller;
        `played_dbfs`: the loudest far-end frame of the last half second."""
        return (
            played_dbfs > SILENT_DBFS
            and heard_dbfs - left_dbfs >= self.cancelled_db
            and played_dbfs - left_dbfs >= self.below_far_db
        )


class EchoPath:
    """Whether the caller's microphone hears the agent at all: a speakerphone or a car kit
    does, a headset or a handset with its own canceller does not. AEC3 cannot be left to
    tell: with no echo to find, its suppressor can still take the caller's words over the
    agent for echo (docs/lab-notes.md, "Echo cancelling: no echo path"), so the canceller's
    output is used only while there is an echo path.

    The evidence is the microphone's floor rising some delay after the agent played: over
    the last `WINDOW` 10 ms frames, at each of the delays AEC3 covers, a low percentile of
    the microphone's level on frames whose far end (that delay earlier) was loud, less a
    lower one where it was quiet. Percentiles, not means: the caller talks mostly in the
    agent's pauses and sometimes over it, which moves a mean by several dB (a real echo
    10 dB down rose only 4.7 dB so), but not the quietest part of either set unless they
    talk through most of it. Until the first judgement the path is taken to be there, which
    keeps the agent from interrupting itself at its first reply; between the two thresholds
    the last judgement stands."""

    WINDOW = 600  # frames: 6 s
    LAGS = np.arange(0, 41, 2)  # frames: delays of 0-400 ms, in 20 ms steps (the room smears)
    EVERY = 50  # frames between two judgements
    SEEN = 100  # frames of the far end loud, and of it quiet, in the window at a delay
    # the far end's frame: loud (an echo 20 dB down still over a quiet room), quiet
    LOUD_DBFS, QUIET_DBFS = -30.0, -70.0
    FLOOR_DBFS = -80.0  # levels under this count as this: digital silence is no quieter
    LOUD_QUANTILE, QUIET_QUANTILE = 0.25, 0.1  # the caller talks more in the pauses
    PRESENT_DB, ABSENT_DB = 6.0, 3.0  # a rise from which the path is there / gone

    def __init__(self) -> None:
        self.present = True
        self.rise_db: float | None = None  # the last judgement's
        # the delay of the largest rise, 10 ms frames -> judgements: where the echo sat
        # against the far end, over the call (the far end placed late shows as a short one)
        self.delays: collections.Counter[int] = collections.Counter()
        span = self.WINDOW + int(self.LAGS[-1])
        # ring buffers, oldest at `_next`; a far end not seen yet is neither loud nor quiet
        self._far = np.full(span, np.nan)
        self._mic = np.full(span, self.FLOOR_DBFS)
        self._next = 0
        self._frames = 0

    def add(self, far_dbfs: float, mic_dbfs: float) -> bool:
        """One 10 ms frame: the far end's level and the microphone's, before processing.
        Returns whether there is an echo path now."""
        self._far[self._next] = max(far_dbfs, self.FLOOR_DBFS)
        self._mic[self._next] = max(mic_dbfs, self.FLOOR_DBFS)
        self._next = (self._next + 1) % len(self._far)
        self._frames += 1
        if self._frames % self.EVERY == 0:
            self._judge()
        return self.present

    def _judge(self) -> None:
        far = np.roll(self._far, -self._next)
        mic = np.roll(self._mic, -self._next)[-self.WINDOW :]
        # row k: the far end LAGS[k] frames before each of the window's microphone frames
        windows = np.lib.stride_tricks.sliding_window_view(far, self.WINDOW)
        at_lag = windows[int(self.LAGS[-1]) - self.LAGS]
        loud, n_loud = self._floor(mic, at_lag > self.LOUD_DBFS, self.LOUD_QUANTILE)
        quiet, n_quiet = self._floor(mic, at_lag < self.QUIET_DBFS, self.QUIET_QUANTILE)
        if min(n_loud.min(), n_quiet.min()) < self.SEEN:
            # too little of the agent, or of its pauses, at some delay to go on (the delays
            # that have enough may all be wrong ones): the last judgement stands
            return
        rises = loud - quiet
        best = float(np.max(rises))
        self.rise_db = best
        self.delays[int(self.LAGS[int(np.argmax(rises))])] += 1
        if best >= self.PRESENT_DB:
            self.present = True
        elif best < self.ABSENT_DB:
            self.present = False

    @staticmethod
    def _floor(
        mic: np.ndarray, chosen: np.ndarray, quantile: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each row's `quantile` of the microphone's levels where `chosen`, and how many."""
        n = chosen.sum(axis=1)
        levels = np.where(chosen, mic, np.inf)
        levels.sort(axis=1)
        at = (quantile * np.maximum(n - 1, 0)).astype(int)
        return levels[np.arange(len(levels)), at], n


def level_dbfs(pcm: np.ndarray) -> float:
    """A frame's RMS level in dB under full scale (SILENT_DBFS for digital silence)."""
    energy = float(np.dot(pcm.astype(np.float64), pcm.astype(np.float64)))
    if not energy:
        return SILENT_DBFS
    return max(SILENT_DBFS, 10 * math.log10(energy / (len(pcm) * 32768.0**2)))


class PlayedAudio:
    """The agent's audio on the caller's side, at 16 kHz on the gateway's clock: the far end
    of the echo canceller. Pieces are placed by when they began to play (`at`, or after what
    is already placed); `take` hands out the timeline up to a moment in whole 10 ms frames,
    silence where nothing played. Runs on the event loop, like the session."""

    def __init__(self, rate: int, clock: Callable[[], float] = time.monotonic) -> None:
        """`rate`: the sample rate of the pieces the transport places (brought to 16 kHz)."""
        self.clock = clock
        self._origin = clock()
        self._resampler = Upsampler(rate, CALLER_RATE)
        self._pieces: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self._end = 0  # sample index where the last piece placed ends
        self._taken: int | None = None  # where the last take ended

    def _index(self, at: float) -> int:
        return round((at - self._origin) * CALLER_RATE)

    def _time(self, index: int) -> float:
        return self._origin + index / CALLER_RATE

    def play_at(self, pcm: np.ndarray, at: float) -> None:
        """`pcm` began playing at `at` (clock seconds). The transports' times are exact (a
        playout schedule, a send-ahead clock): a piece within a sample or two of the last
        one's end continues it, and a gap, which the caller's player had too, stays."""
        pcm = self._resampler.convert(pcm)
        start = self._index(at)
        if abs(start - self._end) <= 2:
            start = self._end
        self._place(start, pcm)

    def play_next(self, pcm: np.ndarray) -> float:
        """`pcm` plays after what is already placed, or now if that has played; returns
        when it begins."""
        pcm = self._resampler.convert(pcm)
        start = max(self._end, self._index(self.clock()))
        self._place(start, pcm)
        return self._time(start)

    def _place(self, start: int, pcm: np.ndarray) -> None:
        if len(pcm):
            self._pieces.append((start, pcm))
            self._end = max(self._end, start + len(pcm))

    def cut(self, at: float | None = None) -> None:
        """Nothing placed plays after `at` (now): a barge-in's clear."""
        cut = self._index(self.clock() if at is None else at)
        kept: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        for start, pcm in self._pieces:
            if start < cut:
                kept.append((start, pcm[: cut - start]))
        self._pieces = kept
        self._end = min(self._end, max(cut, 0))
        self._resampler.reset()

    def shift_from(self, at: float, by_s: float) -> None:
        """What was placed to begin at or after `at` plays `by_s` later (earlier if negative):
        the phone's player fell behind the send-ahead window's clock, or caught up."""
        start_at, by = self._index(at), round(by_s * CALLER_RATE)
        if not by:
            return
        self._pieces = collections.deque(
            (start + by if start >= start_at else start, pcm) for start, pcm in self._pieces
        )
        if self._end >= start_at:
            self._end += by

    def take(self, samples: int, until: float) -> np.ndarray:
        """`samples` of the timeline (whole 10 ms frames) on from the last take: the far end
        of as much of the caller's audio, which arrived by `until`. The far end keeps step
        with the caller's samples, not with when they arrive, so that arrivals in bursts do
        not move the one against the other; it is placed again by `until` when it runs ahead
        of it (a piece that is not placed yet) or more than `MAX_LAG` behind (a loss, a
        stall, the first take). Silence where nothing played."""
        target = self._index(until) - samples - MARGIN
        if self._taken is None or not target - MAX_LAG <= self._taken <= target + EARLY:
            self._taken = target
        lo, hi = self._taken, self._taken + samples
        out = np.zeros(samples, np.int16)
        for start, pcm in self._pieces:
            a, b = max(start, lo), min(start + len(pcm), hi)
            if a < b:
                out[a - lo : b - lo] = pcm[a - start : b - start]
        self._taken = hi
        while self._pieces and self._pieces[0][0] + len(self._pieces[0][1]) <= hi:
            self._pieces.popleft()
        return out


class EchoCanceller:
    """One session's caller audio through WebRTC's audio processing module, with `played` as
    the far end. Takes 16 kHz PCM in pieces of any length and gives back the processed audio
    in whole 10 ms frames (a shorter rest waits for the next piece). `busy_s` is the time it
    has spent, for the CPU a call costs."""

    def __init__(self, processing: AudioProcessing, played: PlayedAudio | None) -> None:
        from livekit import rtc  # loaded with the first session that needs it

        self.processing = processing
        self.played = played if processing.echo else None
        self._frame = rtc.AudioFrame
        # two modules on every frame: the whole processing, whose output is used while there
        # is an echo path (EchoPath), and the same without the echo canceller, used while
        # there is none; both run throughout, so either is ready (AEC3 adapted, the noise
        # suppressor's estimate current) when the judgement changes
        self._echo: Any = self._module(rtc, processing, echo=True) if processing.echo else None
        self._clean: Any = self._module(rtc, processing, echo=False)
        self.echo_path = EchoPath()
        self._clean_held = np.zeros(AEC3_DELAY, np.int16)
        self._rest = np.zeros(0, np.int16)
        self.residual = ResidualEcho()
        self._played_levels: collections.deque[float] = collections.deque(
            [SILENT_DBFS], maxlen=RECENT_FRAMES
        )
        self._heard: collections.deque[float] = collections.deque(maxlen=3)  # frames in
        self.echo_frames = 0  # frames found to be only echo (ResidualEcho), brought down
        self.frames = 0  # frames out
        self.clean_frames = 0  # of them, the module's without the canceller: no echo path
        self.busy_s = 0.0
        self.counted_s = 0.0  # of busy_s, what the session has counted in its metrics

    def process(self, pcm16k: np.ndarray) -> np.ndarray:
        """The caller's audio that just arrived, with the agent's echo taken out (`take` and
        `cancel` in one, on the calling thread)."""
        return self.cancel(*self.take(pcm16k))

    def take(self, pcm16k: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """On the event loop, as the caller's audio arrives: its whole 10 ms frames, and the
        far end that goes with them (None: no echo to cancel)."""
        pcm = np.concatenate([self._rest, np.asarray(pcm16k, np.int16).reshape(-1)])
        whole = len(pcm) - len(pcm) % FRAME
        self._rest = pcm[whole:].copy()
        far = None if self.played is None else self.played.take(whole, self.played.clock())
        return pcm[:whole], far

    def cancel(self, pcm: np.ndarray, far: np.ndarray | None) -> np.ndarray:
        """The frames `take` gave through the module, on one thread at a time (the event
        loop's, or `worker()`'s: the module's calls let go of the GIL, and on a busy machine
        one can wait milliseconds for a core)."""
        started = time.perf_counter()
        out = np.empty(len(pcm), np.int16)
        for i in range(0, len(pcm), FRAME):
            heard = pcm[i : i + FRAME]
            frame = self._audio_frame(heard)
            self._clean.process_stream(frame)  # in place
            clean = np.frombuffer(frame.data, np.int16)
            if far is None or self._echo is None:
                out[i : i + FRAME] = clean
                continue
            # AEC3 holds its output back AEC3_DELAY samples more: the clean output is held
            # as long, so that a frame of the one follows a frame of the other seamlessly
            held = np.concatenate([self._clean_held, clean])
            self._clean_held = held[FRAME:]
            cancelled, present = self._cancel_echo(heard, far[i : i + FRAME])
            out[i : i + FRAME] = cancelled if present else held[:FRAME]
            self.clean_frames += not present
        self.frames += len(pcm) // FRAME
        self.busy_s += time.perf_counter() - started
        return out

    def _cancel_echo(self, heard: np.ndarray, far: np.ndarray) -> tuple[np.ndarray, bool]:
        """One frame through the echo's module, with its far end just before it (always: the
        module keeps step with the echo path even while its output is not used), and
        whether its output is the one to use: whether there is an echo path."""
        played = level_dbfs(far)
        self._played_levels.append(played)
        self._echo.process_reverse_stream(self._audio_frame(far))
        frame = self._audio_frame(heard)
        self._echo.process_stream(frame)  # in place
        left = np.frombuffer(frame.data, np.int16)
        heard_level = level_dbfs(heard)
        present = self.echo_path.add(played, heard_level)
        # the module's output is 10-15 ms behind its input: a frame out is weighed
        # against the loudest of the last three frames in
        self._heard.append(heard_level)
        if present and self.residual.only_echo(
            max(self._heard), level_dbfs(left), max(self._played_levels)
        ):
            left = (left * LEAK_GAIN).astype(np.int16)
            self.echo_frames += 1
        return left, present

    def _module(self, rtc: Any, processing: AudioProcessing, echo: bool) -> Any:
        return rtc.AudioProcessingModule(
            echo_cancellation=echo,
            noise_suppression=processing.noise,
            high_pass_filter=True,
            auto_gain_control=False,  # the level must not move under the recognisers
        )

    def _audio_frame(self, pcm: np.ndarray) -> Any:
        # exactly 10 ms: another length aborts the whole process inside the module
        if len(pcm) != FRAME:
            raise ValueError(f"the audio processing module takes 10 ms frames, not {len(pcm)}")
        # a buffer of its own, which the module writes
        return self._frame(bytearray(pcm.tobytes()), CALLER_RATE, 1, FRAME)


_worker: concurrent.futures.ThreadPoolExecutor | None = None


def worker() -> concurrent.futures.ThreadPoolExecutor:
    """The process's one thread that runs every session's `cancel`, in the order they were
    given it, off the event loop: at 20 calls on a busy 2-core machine the module's calls on
    the loop held it for up to a second (docs/lab-notes.md, "Echo cancelling")."""
    global _worker
    if _worker is None:
        _worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="echo-cancel")
    return _worker
