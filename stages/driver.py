"""Drive one spoken turn through the stages without WebRTC: for `say-file` and the tests."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from stages.envelope import Envelope
from stages.link import EventQueues, PipelineLink
from stages.messages import CALLER_RATE, CHUNK_SAMPLES, Kind


class TurnFailed(RuntimeError):
    """A stage reported an error for the turn."""


@dataclass
class TurnResult:
    transcript: str = ""
    reply_text: str = ""
    response_id: str | None = None
    audio: list[np.ndarray] = field(default_factory=list)
    sample_rate: int = 0
    # CLOCK_MONOTONIC ns of each milestone, from the record headers (one clock for all)
    t_ns: dict[str, int] = field(default_factory=dict)
    events: list[Envelope] = field(default_factory=list)

    @property
    def pcm16(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.int16)

    def hops_ms(self) -> dict[str, float]:
        """Milliseconds between milestones: where the time of the turn went."""
        order = [
            "speech_stopped",
            "transcript",
            "response_started",
            "first_token",
            "first_phrase",
            "first_audio",
            "response_done",
            "audio_done",
        ]
        seen = [k for k in order if k in self.t_ns]
        hops = {
            f"{a}->{b}": (self.t_ns[b] - self.t_ns[a]) / 1e6 for a, b in itertools.pairwise(seen)
        }
        if "first_audio" in self.t_ns:
            hops["speech_stopped->first_audio"] = (
                self.t_ns["first_audio"] - self.t_ns["speech_stopped"]
            ) / 1e6
        return hops


def push_speech(
    link: PipelineLink, session: int, pcm16_16k: np.ndarray, turn_id: int, realtime: bool = False
) -> int:
    """Send one caller turn in 200 ms chunks; returns the speech-stopped time."""
    link.speech_started(session, turn_id)
    for start in range(0, len(pcm16_16k), CHUNK_SAMPLES):
        if not link.send_audio(session, pcm16_16k[start : start + CHUNK_SAMPLES]):
            raise TurnFailed("the encoder's ring stayed full")
        if realtime:
            time.sleep(CHUNK_SAMPLES / CALLER_RATE)  # pacing a live caller, not synchronisation
    return link.speech_stopped(session, turn_id)


def collect_reply(
    events: EventQueues, session: int, result: TurnResult, timeout: float = 60.0
) -> TurnResult:
    """Take the session's events until its spoken reply is complete."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"reply for session {session} incomplete after {timeout} s "
                f"(milestones so far: {sorted(result.t_ns)})"
            )
        ev = events.next(session, left)
        result.events.append(ev)
        m = ev.msg
        if ev.kind is Kind.ERROR:
            raise TurnFailed(f"{m.stage}: {m.code}: {m.message}")
        if ev.kind is Kind.TRANSCRIPT and m.final and not m.speculative:
            result.transcript = m.text
            result.t_ns["transcript"] = ev.t_ns
            if not m.text or not m.create_response:
                return result  # nothing was heard: no reply comes
        elif ev.kind is Kind.RESPONSE_STARTED:
            result.response_id = m.response_id
            result.t_ns["response_started"] = ev.t_ns
        elif ev.kind is Kind.TEXT_DELTA:
            result.t_ns.setdefault("first_token", ev.t_ns)
            result.reply_text += m.text
        elif ev.kind is Kind.PHRASE:
            result.t_ns.setdefault("first_phrase", ev.t_ns)
            result.sample_rate = m.sample_rate
        elif ev.kind is Kind.AUDIO_OUT:
            result.t_ns.setdefault("first_audio", ev.t_ns)
            result.audio.append(np.frombuffer(m, dtype=np.int16))
        elif ev.kind is Kind.RESPONSE_DONE:
            result.t_ns["response_done"] = ev.t_ns
        elif ev.kind is Kind.AUDIO_DONE:
            result.t_ns["audio_done"] = ev.t_ns
        # the two come on different rings (reasoning's, the vocoder's), in either order
        if "response_done" in result.t_ns and "audio_done" in result.t_ns:
            return result


def speak_turn(
    link: PipelineLink,
    events: EventQueues,
    session: int,
    pcm16_16k: np.ndarray,
    turn_id: int = 1,
    timeout: float = 60.0,
    realtime: bool = False,
) -> TurnResult:
    result = TurnResult()
    result.t_ns["speech_stopped"] = push_speech(link, session, pcm16_16k, turn_id, realtime)
    return collect_reply(events, session, result, timeout)
