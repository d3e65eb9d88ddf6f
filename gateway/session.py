"""One call: caller audio through VAD into the encoder ring, stage events out to the caller.

Everything here runs on the event loop. Stage events arrive on ring reader threads and hop
over with `loop.call_soon_threadsafe` (see gateway.app). Barge-in is handled in one place,
`interrupt()`: playout stops at once, the session's epoch moves on (every stage's queued
work for the old reply is purged), and each stage is asked to stop and acknowledge.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiortc import MediaStreamTrack, RTCDataChannel, RTCPeerConnection
from aiortc.mediastreams import MediaStreamError

from gateway import events as ev
from gateway.chunker import Chunker
from gateway.metrics import GatewayMetrics
from gateway.playout import PLAYOUT_RATE, PlayoutTrack
from gateway.resample import Downmixer, Upsampler
from gateway.vad import SpeechStarted, SpeechStopped, TurnDetector
from stages.link import PipelineLink, SpokenTracker, StageEvent
from stages.messages import Kind

logger = logging.getLogger(__name__)

FRAME_SAMPLES_16K = 320  # 20 ms at 16 kHz
MAX_EVENT_BYTES = 256 * 1024


class CallLog(logging.LoggerAdapter):
    """Log lines of one call carry its call id and pipeline session, as text and as record
    attributes (`call`, `session`) for structured handlers."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = self.extra or {}
        kwargs["extra"] = {**extra, **kwargs.get("extra", {})}
        return f"[call={extra.get('call')} session={extra.get('session')}] {msg}", kwargs


@dataclass
class TurnSettings:
    """OpenAI's server_vad knobs."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True


@dataclass
class ActiveResponse:
    response_id: str
    started_ns: int
    tracker: SpokenTracker = field(default_factory=SpokenTracker)
    text: str = ""
    first_audio_ns: int = 0
    playout_start: int | None = None  # playout.played_samples + queued when its audio began
    generated: bool = False  # AUDIO_DONE came: nothing more will be queued


class CallSession:
    """A WebRTC call bound to one pipeline session."""

    def __init__(
        self,
        call_id: str,
        pc: RTCPeerConnection,
        link: PipelineLink,
        session: int,
        vocoder_rate: int,
        metrics: GatewayMetrics,
        settings: TurnSettings,
        on_closed: Callable[[CallSession], None],
    ) -> None:
        self.call_id = call_id
        self.pc = pc
        self.link = link
        self.session = session
        self.vocoder_rate = vocoder_rate
        self.metrics = metrics
        self.settings = settings
        self.on_closed = on_closed
        self.log = CallLog(logger, {"call": call_id, "session": session})
        self.vad = TurnDetector(
            settings.threshold, settings.prefix_padding_ms, settings.silence_duration_ms
        )
        self.chunker = Chunker()
        self.downmixer = Downmixer()
        self.upsampler = Upsampler(vocoder_rate, PLAYOUT_RATE)
        self.playout = PlayoutTrack(
            on_started=self._playout_started,
            on_stopped=self._playout_stopped,
            on_mark=self._played_mark,
        )
        self.channel: RTCDataChannel | None = None
        self.response: ActiveResponse | None = None
        self.turn_id = 0
        self.speech_stopped_ns = 0
        self.cancels: dict[int, int] = {}  # cancel_id -> CLOCK_MONOTONIC ns it was sent
        self.closed = asyncio.Event()
        self._pending_events: list[dict[str, Any]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self.audio_in_frames = 0
        self.frame_arrivals: collections.deque[float] = collections.deque(maxlen=3000)
        self.interrupted_at: collections.deque[float] = collections.deque(maxlen=100)

    # -- wiring ----------------------------------------------------------------------------

    def attach_channel(self, channel: RTCDataChannel) -> None:
        if channel.label != "oai-events":
            return
        self.channel = channel
        channel.on("message", self._on_client_message)
        channel.on("close", lambda: self._spawn(self.close("data channel closed"), "close"))
        if channel.readyState == "open":
            self._flush_events()
        else:
            channel.on("open", self._flush_events)

    def attach_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self._spawn(self._read_caller_audio(track), f"audio-in-{self.call_id}")

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def send(self, event: dict[str, Any]) -> None:
        """Send a server event on the data channel (queued until it opens)."""
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(json.dumps(event))
        elif not self.closed.is_set():
            self._pending_events.append(event)

    def _flush_events(self) -> None:
        pending, self._pending_events = self._pending_events, []
        for event in pending:
            self.send(event)

    # -- caller audio ----------------------------------------------------------------------

    async def _read_caller_audio(self, track: MediaStreamTrack) -> None:
        try:
            while True:
                frame = await track.recv()
                self.frame_arrivals.append(time.monotonic())
                pcm = self.downmixer.convert(frame)
                for start in range(0, len(pcm) - FRAME_SAMPLES_16K + 1, FRAME_SAMPLES_16K):
                    self._caller_frame(pcm[start : start + FRAME_SAMPLES_16K])
        except MediaStreamError:
            await self.close("caller audio ended")

    def _caller_frame(self, frame: np.ndarray) -> None:
        self.audio_in_frames += 1
        for vad_event in self.vad.feed(frame):
            if isinstance(vad_event, SpeechStarted):
                self._speech_started(vad_event)
            elif isinstance(vad_event, SpeechStopped):
                self._speech_stopped(vad_event)
                return
        if self.vad.in_speech:
            for chunk in self.chunker.push(frame):
                self.link.send_audio(self.session, chunk)

    def _speech_started(self, started: SpeechStarted) -> None:
        self.metrics.vad_events.labels("speech_started").inc()
        if self.settings.interrupt_response and self.response is not None:
            self.interrupt("barge_in")
        self.turn_id += 1
        self.link.speech_started(self.session, self.turn_id, started.audio_start_ms)
        self.chunker.reset()
        for chunk in self.chunker.push(started.prefix):
            self.link.send_audio(self.session, chunk)
        self.send(
            ev.event(
                "input_audio_buffer.speech_started",
                audio_start_ms=started.audio_start_ms,
                item_id=self._item_id(),
            )
        )

    def _speech_stopped(self, stopped: SpeechStopped) -> None:
        self.metrics.vad_events.labels("speech_stopped").inc()
        rest = self.chunker.flush()
        if rest is not None:
            self.link.send_audio(self.session, rest)
        self.speech_stopped_ns = self.link.speech_stopped(
            self.session, self.turn_id, stopped.audio_end_ms, self.settings.create_response
        )
        self.send(
            ev.event(
                "input_audio_buffer.speech_stopped",
                audio_end_ms=stopped.audio_end_ms,
                item_id=self._item_id(),
            )
        )
        self.send(
            ev.event("input_audio_buffer.committed", item_id=self._item_id(), previous_item_id=None)
        )

    def _item_id(self) -> str:
        return f"item_{self.call_id[-8:]}_{self.turn_id}"

    # -- barge-in and cancel: the one place ------------------------------------------------

    def interrupt(self, reason: str) -> None:
        """Stop the agent now: drop queued audio, purge every stage, ask each to ack."""
        response = self.response
        if response is None:
            return
        self.response = None
        self.playout.clear()
        self.interrupted_at.append(time.monotonic())
        heard = response.tracker.heard(self._heard_samples(response))
        cancel_id, t = self.link.cancel(self.session, response.response_id, heard, reason)
        self.cancels[cancel_id] = t
        self.upsampler.reset()
        if reason == "barge_in":
            self.metrics.barge_ins.inc()
        self.send(ev.event("output_audio_buffer.cleared", response_id=response.response_id))
        self.send(
            ev.event(
                "response.done",
                response=ev.response_obj(
                    response.response_id,
                    "cancelled",
                    output_text=heard,
                    status_details={
                        "type": "cancelled",
                        "reason": "turn_detected" if reason == "barge_in" else "client_cancelled",
                    },
                ),
            )
        )
        self.log.info("reply %s cut (%s); caller heard %r", response.response_id, reason, heard)

    def _heard_samples(self, response: ActiveResponse) -> int:
        if response.playout_start is None:
            return 0
        played48 = max(0, self.playout.played_samples - response.playout_start)
        return played48 * self.vocoder_rate // PLAYOUT_RATE

    # -- stage events ----------------------------------------------------------------------

    def on_stage_event(self, event: StageEvent) -> None:
        if self.closed.is_set():
            return
        m, kind = event.msg, event.kind
        if kind is Kind.AUDIO_OUT:
            self._agent_audio(event)
        elif kind is Kind.TRANSCRIPT:
            name = (
                "conversation.item.input_audio_transcription.completed"
                if m.final
                else "conversation.item.input_audio_transcription.delta"
            )
            fields = {"transcript": m.text} if m.final else {"delta": m.text}
            self.send(
                ev.event(
                    name, item_id=f"item_{self.call_id[-8:]}_{m.turn_id}", content_index=0, **fields
                )
            )
        elif kind is Kind.RESPONSE_STARTED:
            if self.response is not None:
                self.interrupt("superseded")
            self.response = ActiveResponse(m.response_id, event.t_ns)
            self.upsampler.reset()
            self.send(
                ev.event("response.created", response=ev.response_obj(m.response_id, "in_progress"))
            )
        elif kind is Kind.TEXT_DELTA:
            if self._current(m.response_id):
                self.response.text += m.text
                self.send(
                    ev.event(
                        "response.output_audio_transcript.delta",
                        response_id=m.response_id,
                        delta=m.text,
                    )
                )
        elif kind is Kind.PHRASE:
            if self._current(m.response_id):
                self.response.tracker.phrase(m.text)
        elif kind is Kind.RESPONSE_DONE:
            if self._current(m.response_id):
                self.send(
                    ev.event(
                        "response.output_audio_transcript.done",
                        response_id=m.response_id,
                        transcript=m.text,
                    )
                )
        elif kind is Kind.AUDIO_DONE:
            if self._current(m.response_id):
                self._reply_generated(m.response_id)
        elif kind is Kind.CANCEL_ACK:
            sent = self.cancels.get(m.cancel_id)
            if sent is not None:
                self.metrics.cancel_latency.labels(m.stage).observe((m.t_ns - sent) / 1e9)
            if m.kv_usage is not None:
                self.metrics.kv_usage.set(m.kv_usage)
        elif kind is Kind.ERROR:
            self.metrics.stage_errors.labels(m.stage).inc()
            self.send(ev.error(f"{m.stage}: {m.message}", code=m.code, type_="server_error"))

    def _current(self, response_id: str) -> bool:
        return self.response is not None and self.response.response_id == response_id

    def _agent_audio(self, event: StageEvent) -> None:
        response = self.response
        if response is None:
            return  # a reply that was cut: its stragglers are dropped
        pcm = np.frombuffer(event.msg, dtype=np.int16)
        response.tracker.audio(len(pcm))
        if response.playout_start is None:
            response.playout_start = self.playout.played_samples + self.playout.queued_samples
            response.first_audio_ns = time.monotonic_ns()
            if self.speech_stopped_ns:
                self.metrics.turn_latency.observe(
                    (response.first_audio_ns - self.speech_stopped_ns) / 1e9
                )
                self.speech_stopped_ns = 0
            self.metrics.time_to_first_audio.observe(
                (response.first_audio_ns - response.started_ns) / 1e9
            )
        self.playout.enqueue(self.upsampler.convert(pcm))

    def _reply_generated(self, response_id: str) -> None:
        assert self.response is not None
        self.response.generated = True
        tail = self.upsampler.flush()
        self.playout.enqueue(tail, mark=("done", response_id))
        self.send(
            ev.event(
                "response.done",
                response=ev.response_obj(response_id, "completed", output_text=self.response.text),
            )
        )

    def _playout_started(self) -> None:
        if self.response is not None:
            self.send(
                ev.event("output_audio_buffer.started", response_id=self.response.response_id)
            )

    def _playout_stopped(self) -> None:
        pass  # a drain mid-reply (vocoder behind) is not the end: the "done" mark is

    def _played_mark(self, mark: object) -> None:
        if isinstance(mark, tuple) and mark[0] == "done":
            self.send(ev.event("output_audio_buffer.stopped", response_id=mark[1]))
            if self._current(mark[1]):
                self.response = None

    # -- client events (the Realtime protocol's full set lives in the realtime issue) -------

    def _on_client_message(self, message: Any) -> None:
        if isinstance(message, bytes) or len(message) > MAX_EVENT_BYTES:
            self.send(ev.error("events must be JSON text of at most 256 KiB"))
            return
        try:
            data = json.loads(message)
        except json.JSONDecodeError as exc:
            self.send(ev.error(f"invalid JSON: {exc}", code="invalid_json"))
            return
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            self.send(
                ev.error("an event is a JSON object with a string 'type'", code="invalid_event")
            )
            return
        event_id = data.get("event_id")
        kind = data["type"]
        if kind == "response.cancel":
            self.interrupt("client_cancel")
        elif kind == "output_audio_buffer.clear":
            self.interrupt("client_clear")
        elif kind == "response.create":
            self.link.create_response(self.session, ev.new_id("resp"))
        elif kind == "session.update":
            self._session_update(data, event_id)
        else:
            self.send(
                ev.error(
                    f"unknown or unsupported event type {kind!r}",
                    code="unknown_event",
                    param="type",
                    event_id=event_id,
                )
            )

    def _session_update(self, data: dict[str, Any], event_id: str | None) -> None:
        session = data.get("session")
        td = (((session or {}).get("audio") or {}).get("input") or {}).get("turn_detection")
        if not isinstance(td, dict):
            self.send(
                ev.error(
                    "session.update needs session.audio.input.turn_detection here",
                    param="session",
                    event_id=event_id,
                )
            )
            return
        try:
            knobs = {
                k: td[k]
                for k in ("threshold", "prefix_padding_ms", "silence_duration_ms")
                if k in td
            }
            self.vad.update(**knobs)
        except (TypeError, ValueError) as exc:
            self.send(
                ev.error(f"bad turn_detection: {exc}", param="turn_detection", event_id=event_id)
            )
            return
        for key in ("create_response", "interrupt_response"):
            if key in td:
                setattr(self.settings, key, bool(td[key]))
        self.send(
            ev.event(
                "session.updated",
                session={
                    "audio": {
                        "input": {"turn_detection": {"type": "server_vad", **vars(self.settings)}}
                    }
                },
            )
        )

    # -- teardown --------------------------------------------------------------------------

    async def close(self, reason: str) -> None:
        """Tear the call down and free its stage state; safe to call twice."""
        if self.closed.is_set():
            return
        self.closed.set()
        self.log.info("call closed: %s", reason)
        if self.response is not None:
            self.response = None
            self.playout.clear()
        self.link.close_session(self.session)  # the reasoning stage aborts its request
        self.on_closed(self)
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        self.playout.stop()
        with contextlib.suppress(Exception):
            await self.pc.close()
