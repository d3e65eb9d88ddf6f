"""Callers that hold a conversation and talk over the agent: the load of the GPU run.

Each caller speaks a question, waits for the agent's voice, listens a moment, then speaks
again over it (a barge-in, which is also its next turn), and so on. What it measures, on this
host's CLOCK_MONOTONIC (the same clock as the ring records' stamps):
- turn latency: the caller's end of speech (the send time of the 20 ms frame holding the last
  voiced sample) to the first voiced frame of the agent's reply received;
- barge-in latency: the caller's speech onset (first frame of the clip sent) to the agent's
  audio stopping in what the caller receives (the first frame after which 200 ms are silent).
Callers run in processes of their own, so the gateway under test does not share their loop.
"""

from __future__ import annotations

import asyncio
import bisect
import random
from typing import Any

import numpy as np

from gateway import aiortc_tuning
from gateway.client import FRAME, Microphone, RealtimeCall, Speaker
from gateway.ice import restrict_host_addresses

SILENT_RMS = 30.0  # Opus silence decodes to a few LSBs
SILENT_FRAMES_AFTER_STOP = 10  # 200 ms
VOICED_SAMPLE = 500  # |sample| above which the caller's clip counts as speech


class WatchedMicrophone(Microphone):
    """A microphone that says when its queue has been sent."""

    def __init__(self) -> None:
        super().__init__()
        self.drained = asyncio.Event()

    def play(self, pcm48k: np.ndarray) -> None:
        self.drained.clear()
        super().play(pcm48k)

    async def recv(self) -> Any:
        frame = await super().recv()
        if not self.busy:
            self.drained.set()
        return frame


class _NotifyingTrack:
    """Wraps a received track: each `recv()` call (made once the previous frame is recorded)
    wakes the speaker's waiters."""

    def __init__(self, track: Any, event: asyncio.Event) -> None:
        self.track, self.event = track, event

    async def recv(self) -> Any:
        self.event.set()
        return await self.track.recv()


class WatchedSpeaker(Speaker):
    """A speaker that wakes waiters on every frame received."""

    def __init__(self) -> None:
        super().__init__()
        self.frame_received = asyncio.Event()

    def start(self, track: Any) -> None:
        super().start(_NotifyingTrack(track, self.frame_received))

    async def voiced_after(self, t: float, timeout: float) -> float:
        """Arrival time of the first voiced frame received after `t`."""
        async with asyncio.timeout(timeout):
            start = bisect.bisect_right(self.arrivals, t)
            while True:
                for i in range(start, len(self.arrivals)):
                    if self.levels[i] > SILENT_RMS:
                        return self.arrivals[i]
                start = len(self.arrivals)
                self.frame_received.clear()
                await self.frame_received.wait()

    def stopped_after(self, t: float) -> float | None:
        """Arrival of the first frame after `t` from which SILENT_FRAMES_AFTER_STOP are silent."""
        start = bisect.bisect_left(self.arrivals, t)
        levels = self.levels
        for i in range(start, len(levels) - SILENT_FRAMES_AFTER_STOP + 1):
            if all(lv <= SILENT_RMS for lv in levels[i : i + SILENT_FRAMES_AFTER_STOP]):
                return self.arrivals[i]
        return None


class ConversationCall(RealtimeCall):
    def __init__(self, pc: Any, channel: Any, speakerphone: Any = None) -> None:
        if speakerphone is not None:
            raise ValueError("a conversation's callers have no speakerphone")
        super().__init__(pc, channel)
        self.microphone = WatchedMicrophone()
        self.speaker = WatchedSpeaker()


def last_voiced_frame(pcm48k: np.ndarray) -> int:
    """Index of the 20 ms frame that holds the clip's last voiced sample."""
    voiced = np.flatnonzero(np.abs(pcm48k) > VOICED_SAMPLE)
    return int(voiced[-1]) // FRAME if len(voiced) else 0


def _clips(speech48k: np.ndarray | list[np.ndarray]) -> list[np.ndarray]:
    return list(speech48k) if isinstance(speech48k, list | tuple) else [speech48k]


async def converse(
    base_url: str,
    speech48k: np.ndarray | list[np.ndarray],
    turns: int,
    listen_s: float,
    start_delay_s: float,
    reply_timeout_s: float,
) -> dict[str, Any]:
    """One caller's conversation; returns its call id and the times of each turn.

    `speech48k` is one clip, or several spoken in turn. A call the gateway refuses (503, at
    capacity) is reported with `refused` set and no turns. `arrivals` are the receive times
    of every agent frame, silence included, for the audio gaps the caller heard."""
    clips = _clips(speech48k)
    last_frames = [last_voiced_frame(c) for c in clips]
    await asyncio.sleep(start_delay_s)  # callers start spread out, as real ones do
    try:
        call = await ConversationCall.connect(base_url)
    except ConnectionError as exc:
        refused = "503" in str(exc)
        return {"call_id": None, "turns": [], "refused": refused, "error": str(exc)}
    mic, speaker = call.microphone, call.speaker
    out: dict[str, Any] = {"call_id": call.call_id, "turns": [], "refused": False, "error": None}
    try:
        await call.next_event("session.created")
        for k in range(turns):
            speech48k, last_frame = clips[k % len(clips)], last_frames[k % len(clips)]
            mic.play(speech48k)
            # bounded: a connection that fails stops pulling frames, and drained never comes
            await asyncio.wait_for(mic.drained.wait(), len(speech48k) / 48000 + reply_timeout_s)
            onset = mic.clip_started[-1]
            first = bisect.bisect_left(mic.send_times, onset)
            end_of_speech = mic.send_times[first + last_frame]
            turn: dict[str, Any] = {"onset": onset, "end_of_speech": end_of_speech}
            if k > 0:  # this turn talked over the agent's previous reply
                turn["agent_stopped"] = speaker.stopped_after(onset)
            search_from = max(end_of_speech, turn.get("agent_stopped") or 0.0)
            try:
                turn["first_audio"] = await speaker.voiced_after(search_from, reply_timeout_s)
            except TimeoutError:
                turn["first_audio"] = None
                out["turns"].append(turn)
                out["error"] = f"no reply within {reply_timeout_s} s at turn {k}"
                break
            out["turns"].append(turn)
            if k < turns - 1:
                await asyncio.sleep(listen_s)  # listening to the agent before talking over it
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        out["arrivals"] = list(speaker.arrivals)
        await call.close()
    return out


async def _callers(
    base_url: str,
    n: int,
    speech48k: np.ndarray | list[np.ndarray],
    turns: int,
    listen_s: float,
    spread_s: float,
    reply_timeout_s: float,
    seed: int,
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return await asyncio.gather(
        *(
            converse(
                base_url,
                speech48k,
                turns,
                listen_s,
                rng.uniform(0, spread_s),
                reply_timeout_s,
            )
            for _ in range(n)
        )
    )


def run_conversations(
    base_url: str,
    n: int,
    speech48k: np.ndarray | list[np.ndarray],
    turns: int,
    listen_s: float = 0.8,
    spread_s: float = 2.0,
    reply_timeout_s: float = 30.0,
    seed: int = 0,
    audio_prefetch: int = 1,
    opus: str = "opuslib",
) -> list[dict[str, Any]]:
    """Entry point for a spawned process: `n` callers, each `turns` turns; `opus` is the
    callers' codec, as the gateway's `experiments.opus` (aiortc where there is no opuslib)."""
    aiortc_tuning.apply(audio_prefetch, opus=opus)
    restrict_host_addresses(["127.0.0.1"])
    return asyncio.run(
        _callers(base_url, n, speech48k, turns, listen_s, spread_s, reply_timeout_s, seed)
    )
