"""The gateway's end of the pipeline: push caller audio and commands, receive stage events.

Used by the gateway and by anything else that drives the stages without WebRTC
(`omni-gateway say-file`, the tests, the load generator).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from stages.envelope import Envelope, RingReader
from stages.messages import (
    Cancel,
    History,
    HistoryMessage,
    Kind,
    Msg,
    ResponseCreate,
    ResponseDone,
    ResponseStarted,
    ResponseStop,
    SessionClose,
    SessionOpen,
    SessionSettings,
    SpeechStarted,
    SpeechStopped,
    TextDelta,
    Tools,
    Truncate,
    TurnPaused,
    TurnResumed,
)
from stages.rings import GATEWAY, STAGES, RingNames, attach_ends

logger = logging.getLogger(__name__)


class SessionsFull(RuntimeError):
    """Every session slot of the pipeline is taken."""


class PipelineLink:
    """Attaches to the gateway's ends of the rings; `on_event` runs on reader threads."""

    def __init__(
        self,
        names: RingNames,
        on_event: Callable[[Envelope], None],
        instance: str = GATEWAY,
    ) -> None:
        """`instance`: which gateway process this is ('gateway', 'gateway.1', ...); it hands
        out only its own stride of session ids."""
        self.names = names
        self.instance = instance
        self._stride = names.gateway_stride(instance)
        self.ends = attach_ends(names, instance)
        self.control = self.ends.control
        self.on_event = on_event
        self._cancel_ids = itertools.count(1)
        self._readers = [
            RingReader(
                stage,
                ring,
                on_event,
                name=f"link<-{stage}",
                on_bad=lambda session, why: logger.error("bad record: %s", why),
                on_failure=lambda session, kind, exc: logger.error(
                    "handling a %s record failed", kind, exc_info=exc
                ),
            )
            for stage, ring in self.ends.inputs.items()
        ]
        for reader in self._readers:
            reader.start()

    def _send(self, stage: str, session: int, msg: Msg) -> None:
        """Send to the instance of role `stage` that serves `session`."""
        outbox = self.ends.outbox(stage, session)
        if not outbox.send(session, msg, timeout=1.0):
            raise RuntimeError(f"ring to {outbox.dst} is full: is the {outbox.dst} stage stuck?")

    # -- sessions --------------------------------------------------------------------------

    def open_session(self, opening: SessionOpen | None = None) -> int:
        """Claim a session id and tell every stage; raises SessionsFull when none is free."""
        session = self.control.open_session(*self._stride)
        if session is None:
            count = len(self.names.sessions_of(self.instance, self.control.max_sessions))
            raise SessionsFull(f"all {count} sessions of {self.instance} are in use")
        for stage in STAGES:
            self._send(stage, session, opening or SessionOpen())
        return session

    def close_session(self, session: int, reason: str = "closed") -> None:
        """Tell every stage to drop the session (the reasoning stage aborts its request),
        then free the id. Records still queued for it become stale."""
        try:
            for stage in STAGES:
                self._send(stage, session, SessionClose(reason))
        finally:
            self.control.close_session(session)

    # -- caller audio and turns ------------------------------------------------------------

    def send_audio(self, session: int, pcm16: np.ndarray | bytes) -> bool:
        """Push PCM16 mono 16 kHz; False if the encoder's ring stayed full (audio dropped)."""
        payload = pcm16 if isinstance(pcm16, bytes) else np.ascontiguousarray(pcm16, np.int16)
        encoder = self.ends.outbox("encoder", session)
        return encoder.push(session, Kind.AUDIO_IN, payload, timeout=0.2)

    def speech_started(
        self, session: int, turn_id: int, audio_start_ms: int = 0, provisional: bool = False
    ) -> None:
        self._send("encoder", session, SpeechStarted(turn_id, audio_start_ms, provisional))

    def speech_stopped(
        self,
        session: int,
        turn_id: int,
        audio_end_ms: int = 0,
        create_response: bool = True,
        provisional: bool = False,
    ) -> int:
        """End the caller's turn; returns the CLOCK_MONOTONIC time it was sent. A
        `provisional` turn's transcript comes to the gateway alone."""
        t = time.monotonic_ns()
        stopped = SpeechStopped(turn_id, audio_end_ms, create_response, provisional)
        self._send("encoder", session, stopped)
        return t

    def turn_paused(
        self,
        session: int,
        turn_id: int,
        create_response: bool = True,
        silence_to_come_ms: int = 0,
    ) -> None:
        """The caller paused: the stages may prepare the reply, held until the turn ends."""
        self._send("encoder", session, TurnPaused(turn_id, create_response, silence_to_come_ms))

    def turn_resumed(self, session: int, turn_id: int) -> None:
        """The caller went on after a pause: drop what was prepared."""
        self._send("encoder", session, TurnResumed(turn_id))

    # -- replies ---------------------------------------------------------------------------

    def create_response(
        self,
        session: int,
        response_id: str,
        text: str | None = None,
        instructions: str | None = None,
        audio: bool | None = None,
        max_output_tokens: int | None = None,
        tools: Tools | None = None,
    ) -> None:
        """Start a reply; None fields take the session's settings."""
        msg = ResponseCreate(response_id, text, instructions, audio, max_output_tokens, tools=tools)
        self._send("reasoning", session, msg)

    def set_history(self, session: int, messages: list[HistoryMessage]) -> None:
        """Replace the reasoning stage's copy of the conversation."""
        self._send("reasoning", session, History(messages))

    def apply_settings(self, session: int, settings: SessionSettings) -> None:
        self._send("reasoning", session, settings)

    def speak(self, session: int, response_id: str, text: str) -> None:
        """Have the vocoder alone say `text`, as fast as it can (no reasoning, no pacing);
        its audio comes back as AUDIO_OUT records ending with AUDIO_DONE."""
        for msg in (
            ResponseStarted(response_id, -1, audio=True, paced=False),
            TextDelta(response_id, text, 0),
            ResponseDone(response_id, "completed", text),
        ):
            self._send("vocoder", session, msg)

    def stop_response(self, session: int, response_id: str) -> None:
        """Drop one reply in reasoning (its vLLM request aborted) and the vocoder, unheard and
        out of the history, without purging the session (messages.ResponseStop)."""
        msg = ResponseStop(response_id)
        self._send("reasoning", session, msg)
        self._send("vocoder", session, msg)

    def truncate(self, session: int, response_id: str, spoken_text: str) -> None:
        self._send("reasoning", session, Truncate(response_id, spoken_text))

    def cancel(
        self,
        session: int,
        response_id: str | None = None,
        spoken_text: str | None = None,
        reason: str = "barge_in",
    ) -> tuple[int, int]:
        """Purge the session everywhere at once (epoch bump), then ask each stage to stop and
        acknowledge. Returns (cancel_id, CLOCK_MONOTONIC ns of the cancel)."""
        t = time.monotonic_ns()
        self.control.cancel(session)
        cancel_id = next(self._cancel_ids)
        msg = Cancel(cancel_id, response_id, spoken_text, reason)
        for stage in STAGES:
            self._send(stage, session, msg)
        return cancel_id, t

    def rings(self) -> dict[str, Any]:
        """This end's rings by name ('encoder->gateway', ...), for metrics."""
        return dict(self.ends.rings())

    def close(self) -> None:
        for reader in self._readers:
            reader.stop()
        self.ends.close()


class EventQueues:
    """An `on_event` sink with a queue per session, for code that waits on events."""

    def __init__(self) -> None:
        self._queues: dict[int, queue.SimpleQueue[Envelope]] = {}
        self._lock = threading.Lock()

    def __call__(self, event: Envelope) -> None:
        self.queue(event.session).put(event)

    def queue(self, session: int) -> queue.SimpleQueue[Envelope]:
        with self._lock:
            return self._queues.setdefault(session, queue.SimpleQueue())

    def next(self, session: int, timeout: float) -> Envelope:
        """The session's next event; raises TimeoutError naming the wait."""
        try:
            return self.queue(session).get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no event for session {session} within {timeout} s") from None
