"""One Realtime session: caller audio through VAD into the encoder ring, stage events out as
OpenAI Realtime (GA) server events, client events in. Transport-agnostic: a WebRTC call
(gateway.webrtc) and a WebSocket (gateway.websocket) differ only in how audio and events
travel, which their `Transport` hides.

Everything here runs on the event loop. Stage events arrive on ring reader threads and hop
over with `loop.call_soon_threadsafe` (see gateway.app). Barge-in and every other way a reply
is stopped go through one place, `interrupt()`: playback stops at once, the session's epoch
moves on (every stage's queued work for the old reply is purged), and each stage is asked to
stop and acknowledge.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from gateway import events as ev
from gateway.chunker import Chunker
from gateway.conversation import Conversation, Item, item_from_client
from gateway.metrics import GatewayMetrics
from gateway.opus import PacketCodec
from gateway.protocol import (
    INPUT_RATE,
    OPUS,
    OUTPUT_RATE,
    ProtocolError,
    ResponseParams,
    SessionConfig,
    parse_response_create,
)
from gateway.resample import CALLER_RATE, Upsampler
from gateway.vad import SpeechPaused, SpeechResumed, SpeechStarted, SpeechStopped, TurnDetector
from stages.link import PipelineLink, SpokenTracker, StageEvent
from stages.messages import Kind, SessionSettings
from stages.rings import STAGES

logger = logging.getLogger(__name__)

FRAME_SAMPLES_16K = 320  # 20 ms at 16 kHz
MAX_EVENT_BYTES = 16 * 1024 * 1024  # input_audio_buffer.append carries up to 15 MiB of base64
MANUAL_BUFFER_S = 120  # audio held for a manual commit, at most
VOICE_AHEAD_MAX = 600  # vocoder records kept for a reply whose start has not come (~60 s)


class CallLog(logging.LoggerAdapter):
    """Log lines of one session carry its id and pipeline session, as text and as record
    attributes (`call`, `session`) for structured handlers."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = self.extra or {}
        kwargs["extra"] = {**extra, **kwargs.get("extra", {})}
        return f"[call={extra.get('call')} session={extra.get('session')}] {msg}", kwargs


@dataclass
class ActiveResponse:
    response_id: str
    item: Item
    started_ns: int
    audio: bool
    metadata: dict[str, Any] | None = None
    tracker: SpokenTracker = field(default_factory=SpokenTracker)
    text: str = ""
    first_audio_ns: int = 0
    samples: int = 0  # audio at the vocoder's rate handed to the transport
    generated: bool = False  # finished: its text and (if spoken) its audio are all in
    # RESPONSE_DONE and AUDIO_DONE come on different rings (reasoning's, the vocoder's), in
    # either order; the response is finished once both have come
    text_done: bool = False
    audio_done: bool = False
    playback_start: Any = None  # the transport's mark of where its audio began


@dataclass
class PendingCancel:
    response_id: str
    sent_ns: int
    acks: dict[str, int] = field(default_factory=dict)  # stage -> its CLOCK_MONOTONIC ns
    kv_usage: float | None = None


class Transport(Protocol):
    """How a session's audio and events reach the client."""

    kind: str  # "webrtc" or "websocket"

    def send_event(self, event: dict[str, Any]) -> None: ...

    def play(self, response: ActiveResponse, pcm: np.ndarray) -> None:
        """Agent audio at the vocoder's rate, as it is synthesized."""

    def finish(self, response: ActiveResponse) -> None:
        """All of the response's audio was handed over; call `session.playback_done(id)`
        once the client has (or will have) played it."""

    def clear(self) -> None:
        """Drop every queued sample now (barge-in)."""

    def hold(self, held: bool) -> None:
        """Pause (True) or go on with (False) the agent's audio, dropping nothing: the caller
        may be starting to talk over it."""

    def heard_samples(self, response: ActiveResponse) -> int:
        """How much of the response's audio (at the vocoder's rate) the caller has heard."""

    async def close(self) -> None: ...


class RealtimeSession:
    """A client connection bound to one pipeline session."""

    def __init__(
        self,
        call_id: str,
        link: PipelineLink,
        session: int,
        vocoder_rate: int,
        metrics: GatewayMetrics,
        config: SessionConfig,
        on_closed: Callable[[RealtimeSession], None],
        hold_on_voice: bool = True,
        prepare_reply_ms: int = 0,
    ) -> None:
        """`hold_on_voice`: silence the agent from the caller's first voiced frame until the
        VAD decides whether they are talking over it (GatewayConfig.barge_in_hold).
        `prepare_reply_ms`: silence inside a turn after which the stages start on the reply,
        held until the turn ends (GatewayConfig.prepare_reply_ms; 0: off)."""
        self.call_id = call_id
        self.hold_on_voice = hold_on_voice
        self.link = link
        self.session = session
        self.vocoder_rate = vocoder_rate
        self.metrics = metrics
        self.config = config
        self.on_closed = on_closed
        self.transport: Transport | None = None
        self.log = CallLog(logger, {"call": call_id, "session": session})
        td = config.turn_detection
        self.vad = (
            TurnDetector(
                td.threshold,
                td.prefix_padding_ms,
                td.silence_duration_ms,
                pause_ms=prepare_reply_ms,
            )
            if td
            else TurnDetector(pause_ms=prepare_reply_ms)
        )
        self.chunker = Chunker()
        self.items = Conversation()
        self.response: ActiveResponse | None = None
        self.turn_id = 0
        self.turn_items: dict[int, str] = {}  # turn id -> its user item
        self.awaiting_transcript: set[int] = set()
        self._partials: dict[int, str] = {}  # turn id -> the partial transcript sent so far
        self.deferred_create: tuple[ResponseParams, str | None] | None = None
        # a turn's end asked the stages for a reply that has not started yet: if the caller
        # speaks again first, a barge-in cancels it before it can start over them
        self.reply_asked = False
        self.speech_stopped_ns = 0
        self.cancels: dict[int, int] = {}  # cancel_id -> CLOCK_MONOTONIC ns it was sent
        self.pending_cancels: dict[int, PendingCancel] = {}
        self._metadata: dict[str, dict[str, Any] | None] = {}  # response.create's, by id
        # what each recent assistant audio item said when, for conversation.item.truncate
        self._trackers: collections.OrderedDict[str, SpokenTracker] = collections.OrderedDict()
        # The vocoder's records come on their own ring and reasoning's on another, whose
        # reader threads race: a reply's first phrase and audio can reach the loop before its
        # RESPONSE_STARTED (a reply made at the caller's pause is released with both at once).
        # Audio names no reply; the vocoder's last PHRASE says whose it is (`_voiced`), and
        # records of a reply not yet started wait in `_voice_ahead` for its start.
        self._started: collections.deque[str] = collections.deque(maxlen=32)
        self._voiced: str | None = None
        self._voice_ahead: list[StageEvent] = []
        self.manual_audio: list[np.ndarray] = []
        self.manual_samples = 0
        self._partial_frame = np.zeros(0, np.int16)
        self._in_rs: Upsampler | None = None
        self._opus: PacketCodec | None = None
        self.closed = asyncio.Event()
        self.close_reason: str | None = None  # why it ended, once it has
        self._pending_events: list[dict[str, Any]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self.audio_in_frames = 0
        self.frame_arrivals: collections.deque[float] = collections.deque(maxlen=3000)
        self.interrupted_at: collections.deque[float] = collections.deque(maxlen=100)

    # -- wiring ----------------------------------------------------------------------------

    def bind(self, transport: Transport) -> None:
        """Attach the transport; events sent before it existed go out now, in order."""
        self.transport = transport
        pending, self._pending_events = self._pending_events, []
        for event in pending:
            transport.send_event(event)

    def send(self, event: dict[str, Any]) -> None:
        if self.closed.is_set():
            return
        if self.transport is None:
            self._pending_events.append(event)
        else:
            self.transport.send_event(event)

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def start(self) -> None:
        """Greet the client (session.created) and hand the stages the session's settings."""
        self._apply_settings()
        self.send(ev.event("session.created", session=self.config.to_json(self.call_id)))

    def _apply_settings(self) -> None:
        c = self.config
        self.link.apply_settings(
            self.session, SessionSettings(c.instructions or None, c.audio_out, c.token_cap)
        )

    # -- caller audio ----------------------------------------------------------------------

    def feed_audio(self, pcm16k: np.ndarray) -> None:
        """Caller audio, PCM16 mono 16 kHz, in pieces of any length."""
        if len(self._partial_frame):
            pcm16k = np.concatenate([self._partial_frame, pcm16k])
        whole = len(pcm16k) - len(pcm16k) % FRAME_SAMPLES_16K
        self._partial_frame = pcm16k[whole:].copy()
        for start in range(0, whole, FRAME_SAMPLES_16K):
            self._caller_frame(pcm16k[start : start + FRAME_SAMPLES_16K])

    def _caller_frame(self, frame: np.ndarray) -> None:
        self.audio_in_frames += 1
        if self.config.turn_detection is None:
            if self.manual_samples < MANUAL_BUFFER_S * CALLER_RATE:
                self.manual_audio.append(frame)
                self.manual_samples += len(frame)
            return
        for vad_event in self.vad.feed(frame):
            if isinstance(vad_event, SpeechStarted):
                self._speech_started(vad_event)
            elif isinstance(vad_event, SpeechStopped):
                self._speech_stopped(vad_event.audio_end_ms, self._td_create_response())
                return
            elif isinstance(vad_event, SpeechPaused):
                # the encoder transcribes what it has: everything the caller said, up to now
                if (rest := self.chunker.flush()) is not None:
                    self.link.send_audio(self.session, rest)
                self.link.turn_paused(self.session, self.turn_id, self._td_create_response())
            elif isinstance(vad_event, SpeechResumed):
                self.link.turn_resumed(self.session, self.turn_id)
        self._hold_for_barge_in()
        if self.vad.in_speech:
            for chunk in self.chunker.push(frame):
                self.link.send_audio(self.session, chunk)

    def _hold_for_barge_in(self) -> None:
        """A barge-in is decided onset_ms after the caller's first voiced frame: the agent
        goes quiet from that frame on, and plays on, nothing lost, if it was not one."""
        td = self.config.turn_detection
        held = (
            self.hold_on_voice
            and td is not None
            and td.interrupt_response
            and self.response is not None
            and not self.vad.in_speech
            and self.vad.voiced_run > 0
        )
        if self.transport is not None:
            self.transport.hold(held)

    def _td_create_response(self) -> bool:
        td = self.config.turn_detection
        return td is not None and td.create_response

    def _speech_started(self, started: SpeechStarted) -> None:
        self.metrics.vad_events.labels("speech_started").inc()
        td = self.config.turn_detection
        if td is not None and td.interrupt_response:
            self.interrupt("barge_in", unstarted=True)
        self._begin_turn(started.audio_start_ms)
        for chunk in self.chunker.push(started.prefix):
            self.link.send_audio(self.session, chunk)
        self.send(
            ev.event(
                "input_audio_buffer.speech_started",
                audio_start_ms=started.audio_start_ms,
                item_id=self.turn_items[self.turn_id],
            )
        )

    def _begin_turn(self, audio_start_ms: int) -> None:
        self.turn_id += 1
        self.turn_items[self.turn_id] = ev.new_id("item")
        self.link.speech_started(self.session, self.turn_id, audio_start_ms)
        self.chunker.reset()

    def _speech_stopped(self, audio_end_ms: int, create_response: bool) -> None:
        self.metrics.vad_events.labels("speech_stopped").inc()
        rest = self.chunker.flush()
        if rest is not None:
            self.link.send_audio(self.session, rest)
        self.speech_stopped_ns = self.link.speech_stopped(
            self.session, self.turn_id, audio_end_ms, create_response
        )
        self.reply_asked = self.reply_asked or create_response
        item_id = self.turn_items[self.turn_id]
        if self.config.turn_detection is not None:
            self.send(
                ev.event(
                    "input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms, item_id=item_id
                )
            )
        self._commit_item(item_id)

    def _commit_item(self, item_id: str) -> None:
        self.awaiting_transcript.add(self.turn_id)
        item = Item(item_id, "user", [{"type": "input_audio", "transcript": None}], "completed")
        previous = self.items.add(item)
        self.send(
            ev.event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous)
        )
        self.send(
            ev.event("conversation.item.added", previous_item_id=previous, item=item.to_json())
        )

    def append_audio(self, audio_b64: Any) -> None:
        """input_audio_buffer.append: base64 PCM16 mono 24 kHz, or one 20 ms Opus packet."""
        if not isinstance(audio_b64, str):
            raise ProtocolError("audio must be a base64 string", param="audio")
        try:
            raw = base64.b64decode(audio_b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ProtocolError(
                f"audio is not valid base64: {exc}", param="audio", code="invalid_audio"
            ) from None
        if self.config.input_format == OPUS:
            try:
                self.feed_audio(self.opus.decode(raw))
            except ValueError as exc:
                raise ProtocolError(
                    f"audio/opus: {exc}; the packet was dropped",
                    param="audio",
                    code="invalid_audio",
                ) from None
            return
        if len(raw) % 2:
            raise ProtocolError(
                "audio/pcm is 16-bit samples: an odd number of bytes cannot be it",
                param="audio",
                code="invalid_audio",
            )
        pcm = np.frombuffer(raw, dtype="<i2").astype(np.int16)
        self.feed_audio(self._input_resampler.convert(pcm))

    @property
    def opus(self) -> PacketCodec:
        """This session's libopus coder for the audio/opus format (made on first use)."""
        if self._opus is None:
            self._opus = PacketCodec(CALLER_RATE, OUTPUT_RATE)
        return self._opus

    @property
    def _input_resampler(self) -> Upsampler:
        """24 kHz audio/pcm from a WebSocket client down to the caller rate."""
        if self._in_rs is None:
            self._in_rs = Upsampler(INPUT_RATE, CALLER_RATE)
        return self._in_rs

    def commit_audio(self) -> None:
        """input_audio_buffer.commit: the buffered audio is a user turn."""
        if self.config.turn_detection is not None:
            if not self.vad.in_speech:
                raise ProtocolError(
                    "the input audio buffer is empty: server_vad commits turns by itself",
                    code="input_audio_buffer_commit_empty",
                )
            end_ms = self.vad.audio_ms
            self.vad.reset()
            self._speech_stopped(end_ms, self._td_create_response())
            return
        if self.manual_samples < CALLER_RATE // 10:
            raise ProtocolError(
                f"the input audio buffer holds {self.manual_samples / 16:.0f} ms of audio; "
                "a commit needs at least 100 ms",
                code="input_audio_buffer_commit_empty",
            )
        audio = np.concatenate(self.manual_audio)
        self.manual_audio, self.manual_samples = [], 0
        self._begin_turn(0)
        for start in range(0, len(audio), 3200):
            self.link.send_audio(self.session, audio[start : start + 3200])
        self._speech_stopped(len(audio) // 16, False)

    def clear_audio(self) -> None:
        """input_audio_buffer.clear."""
        self.manual_audio, self.manual_samples = [], 0
        self._partial_frame = np.zeros(0, np.int16)
        self.vad.reset()
        self.chunker.reset()
        self.send(ev.event("input_audio_buffer.cleared"))

    # -- barge-in and cancel: the one place ------------------------------------------------

    def interrupt(
        self,
        reason: str,
        heard_samples: int | None = None,
        *,
        purge: bool = True,
        unstarted: bool = False,
    ) -> None:
        """Stop the agent now: drop queued audio, purge every stage, ask each to ack.
        `heard_samples` (at the vocoder's rate) overrides what the transport says was
        played, for a client that reports it (conversation.item.truncate). `purge` False:
        the stages have moved on by themselves (a reply they started supersedes this one), so
        playback stops and the client is told, but nothing is cancelled: a cancel would purge
        the new reply as well. `unstarted`: with no reply playing, a reply that a turn's end
        asked for and that has not started is cancelled too (the client never heard of it),
        so that it cannot start over the caller. Only once the turn's transcript is here: the
        encoder is done with the turn, and a cancel purges none of it (reasoning may read the
        transcript after the cancel: it keeps it, unanswered, rings.survives_cancel). A reply
        that starts before that, while the caller speaks, is stopped as it starts
        (`on_stage_event`, link.stop_response)."""
        response = self.response
        if response is None and unstarted and self.reply_asked and not self.awaiting_transcript:
            self.reply_asked = False
            cancel_id, t = self.link.cancel(self.session, None, "", reason)
            self._voice_ahead.clear()
            self.cancels[cancel_id] = t
            self.log.info("a reply not yet started cancelled (%s)", reason)
            return
        if response is None or self.transport is None:
            return
        self.response = None
        self.transport.clear()
        self.interrupted_at.append(time.monotonic())
        if heard_samples is None:
            heard_samples = self.transport.heard_samples(response)
        heard = response.tracker.heard(heard_samples) if response.audio else response.text
        if purge:
            self.reply_asked = False
            cancel_id, t = self.link.cancel(self.session, response.response_id, heard, reason)
            self._voice_ahead.clear()  # of the epoch just cancelled: its reply never starts
            self.cancels[cancel_id] = t
            self.pending_cancels[cancel_id] = PendingCancel(response.response_id, t)
        if reason == "barge_in":
            self.metrics.barge_ins.inc()
        if self.transport.kind == "webrtc" and response.audio:
            self.send(ev.event("output_audio_buffer.cleared", response_id=response.response_id))
        part = response.item.content[0]
        part["transcript" if response.audio else "text"] = heard
        if response.audio and response.samples:
            self.send(
                ev.event(
                    "conversation.item.truncated",
                    item_id=response.item.id,
                    content_index=0,
                    audio_end_ms=heard_samples * 1000 // self.vocoder_rate,
                )
            )
        if not response.generated:
            response.item.status = "incomplete"
            # barge_in, or superseded: the stages started the reply to the caller's newer turn
            by = "client_cancelled" if reason.startswith("client") else "turn_detected"
            self._response_done(response, "cancelled", {"type": "cancelled", "reason": by})
        self.log.info("reply %s cut (%s); caller heard %r", response.response_id, reason, heard)

    # -- stage events ----------------------------------------------------------------------

    def on_stage_event(self, event: StageEvent) -> None:
        if self.closed.is_set():
            return
        m, kind = event.msg, event.kind
        if kind in (Kind.PHRASE, Kind.AUDIO_OUT, Kind.AUDIO_DONE) and self._ahead_of_start(event):
            return
        if kind is Kind.AUDIO_OUT:
            self._agent_audio(event)
        elif kind is Kind.TRANSCRIPT:
            self._transcript(m.turn_id, m.text, m.final)
        elif kind is Kind.RESPONSE_STARTED:
            asked = self.reply_asked
            self._response_started(m.response_id, m.audio, event.t_ns)
            self._started.append(m.response_id)
            ahead, self._voice_ahead = self._voice_ahead, []
            td = self.config.turn_detection
            if asked and td is not None and td.interrupt_response and self.vad.in_speech:
                # the reply to the caller's last turn started after they spoke again (too soon
                # for `interrupt(unstarted=True)`): stopped unheard, and without a cancel,
                # which would purge the turn they are in
                self.link.stop_response(self.session, m.response_id)
                self.interrupt("barge_in", purge=False)
            elif ahead and self._voiced == m.response_id:
                for early in ahead:
                    self.on_stage_event(early)
        elif kind is Kind.TEXT_DELTA:
            if self._current(m.response_id):
                self._text_delta(self.response, m.text)
        elif kind is Kind.PHRASE:
            if self._current(m.response_id):
                self.response.tracker.phrase(m.text)
        elif kind is Kind.RESPONSE_DONE:
            if self._current(m.response_id):
                self._text_done(self.response, m.text, m.status)
        elif kind is Kind.AUDIO_DONE:
            if self._current(m.response_id):
                self._audio_done(self.response)
        elif kind is Kind.CANCEL_ACK:
            self._cancel_ack(m.cancel_id, m.stage, m.t_ns, m.kv_usage)
        elif kind is Kind.ERROR:
            self.metrics.stage_errors.labels(m.stage).inc()
            self.send(ev.error(f"{m.stage}: {m.message}", code=m.code, type_="server_error"))

    def _ahead_of_start(self, event: StageEvent) -> bool:
        """Keep a vocoder record whose reply has not started here yet; True when kept."""
        if event.kind is not Kind.AUDIO_OUT:
            reply = event.msg.response_id  # a PHRASE or AUDIO_DONE names its reply
            if reply != self._voiced:
                self._voiced, self._voice_ahead = reply, []  # a reply never started is let go
        if self._voiced is None or self._voiced in self._started:
            return False
        if len(self._voice_ahead) >= VOICE_AHEAD_MAX:
            self.log.warning("reply %s never started; its audio is dropped", self._voiced)
            self._voice_ahead.clear()
        self._voice_ahead.append(event)
        self.metrics.voice_ahead.inc()
        return True

    def _current(self, response_id: str) -> bool:
        return self.response is not None and self.response.response_id == response_id

    def _transcript(self, turn_id: int, text: str, final: bool) -> None:
        item_id = self.turn_items.get(turn_id)
        if item_id is None:
            return
        if not final:
            # The encoder sends its whole current guess; Realtime deltas are additions. Send
            # what the guess added; a guess that revises earlier words waits for `completed`.
            said = self._partials.get(turn_id, "")
            if text.startswith(said) and len(text) > len(said):
                self._partials[turn_id] = text
                self._transcription_event("delta", item_id, delta=text[len(said) :])
            return
        self._partials.pop(turn_id, None)
        if not text and turn_id == self.turn_id:
            self.reply_asked = False  # nothing was said: reasoning answers nothing
        self._transcription_event("completed", item_id, transcript=text)
        self.awaiting_transcript.discard(turn_id)
        if item_id in self.items:
            item = self.items.get(item_id)
            item.content[0]["transcript"] = text
            self.send(ev.event("conversation.item.done", item=item.to_json()))
        if self.deferred_create is not None and not self.awaiting_transcript:
            params, event_id = self.deferred_create
            self.deferred_create = None
            self._create_response(params, event_id)

    def _transcription_event(self, name: str, item_id: str, **fields: str) -> None:
        if self.config.transcription is not None:
            self.send(
                ev.event(
                    f"conversation.item.input_audio_transcription.{name}",
                    item_id=item_id,
                    content_index=0,
                    **fields,
                )
            )

    def _response_started(self, response_id: str, audio: bool, t_ns: int) -> None:
        self.reply_asked = False
        if self.response is not None:  # the stages stopped it for this one already
            self.interrupt("superseded", purge=False)
        metadata = self._metadata.pop(response_id, None)
        item = Item(
            ev.new_id("item"),
            "assistant",
            [
                {"type": "output_audio", "transcript": ""}
                if audio
                else {"type": "output_text", "text": ""}
            ],
            "in_progress",
        )
        response = self.response = ActiveResponse(response_id, item, t_ns, audio, metadata)
        if audio:
            self._trackers[item.id] = response.tracker
            while len(self._trackers) > 32:
                self._trackers.popitem(last=False)
        self.send(
            ev.event(
                "response.created",
                response=ev.response_obj(
                    response_id, "in_progress", audio=audio, metadata=metadata
                ),
            )
        )
        previous = self.items.add(item)
        self.send(
            ev.event(
                "response.output_item.added",
                response_id=response_id,
                output_index=0,
                item=item.to_json(),
            )
        )
        self.send(
            ev.event("conversation.item.added", previous_item_id=previous, item=item.to_json())
        )
        self.send(
            ev.event(
                "response.content_part.added",
                **self._where(response),
                part=self._part(response, ""),
            )
        )

    @staticmethod
    def _where(response: ActiveResponse) -> dict[str, Any]:
        return {
            "response_id": response.response_id,
            "item_id": response.item.id,
            "output_index": 0,
            "content_index": 0,
        }

    @staticmethod
    def _part(response: ActiveResponse, text: str) -> dict[str, Any]:
        return (
            {"type": "audio", "transcript": text}
            if response.audio
            else {"type": "text", "text": text}
        )

    def _text_delta(self, response: ActiveResponse, text: str) -> None:
        response.text += text
        name = "output_audio_transcript" if response.audio else "output_text"
        self.send(ev.event(f"response.{name}.delta", **self._where(response), delta=text))

    def _text_done(self, response: ActiveResponse, text: str, status: str) -> None:
        """The reasoning stage finished the reply's text (the audio may still be coming)."""
        response.text = text
        response.text_done = True
        if response.audio:
            response.item.content[0]["transcript"] = text
            self.send(
                ev.event(
                    "response.output_audio_transcript.done",
                    **self._where(response),
                    transcript=text,
                )
            )
            if status == "completed" and not response.audio_done:
                return  # AUDIO_DONE finishes it
        else:
            response.item.content[0]["text"] = text
            self.send(ev.event("response.output_text.done", **self._where(response), text=text))
        self._finish(response, status)

    def _audio_done(self, response: ActiveResponse) -> None:
        self.send(ev.event("response.output_audio.done", **self._where(response)))
        response.audio_done = True
        if response.text_done:
            self._finish(response, "completed")
        # else its RESPONSE_DONE, still on reasoning's ring, finishes it with the whole text

    def _finish(self, response: ActiveResponse, status: str) -> None:
        if response.generated:
            return  # finished already (a failed reply's audio still ended)
        response.generated = True
        self.send(
            ev.event(
                "response.content_part.done",
                **self._where(response),
                part=self._part(response, response.text),
            )
        )
        response.item.status = "completed" if status == "completed" else "incomplete"
        self.send(
            ev.event(
                "response.output_item.done",
                response_id=response.response_id,
                output_index=0,
                item=response.item.to_json(),
            )
        )
        self.send(ev.event("conversation.item.done", item=response.item.to_json()))
        self._response_done(response, status, None)
        if response.audio and self.transport is not None:
            self.transport.finish(response)
        elif self.response is response:
            self.response = None

    def _response_done(
        self, response: ActiveResponse, status: str, details: dict[str, Any] | None
    ) -> None:
        self.send(
            ev.event(
                "response.done",
                response=ev.response_obj(
                    response.response_id,
                    status,
                    audio=response.audio,
                    item=response.item.to_json(),
                    status_details=details,
                    metadata=response.metadata,
                ),
            )
        )
        self.send(ev.rate_limits())

    def _agent_audio(self, event: StageEvent) -> None:
        response = self.response
        if response is None or not response.audio or self.transport is None:
            return  # a reply that was cut: its stragglers are dropped
        if self._voiced is not None and self._voiced != response.response_id:
            return  # the rest of a reply this one superseded
        pcm = np.frombuffer(event.msg, dtype=np.int16)
        response.tracker.audio(len(pcm))
        if not response.first_audio_ns:
            response.first_audio_ns = time.monotonic_ns()
            turn_ms = None
            if self.speech_stopped_ns:
                turn_ms = (response.first_audio_ns - self.speech_stopped_ns) / 1e6
                self.metrics.turn_latency.observe(turn_ms / 1000)
                self.speech_stopped_ns = 0
            first_ms = (response.first_audio_ns - response.started_ns) / 1e6
            self.metrics.time_to_first_audio.observe(first_ms / 1000)
            self.send(
                ev.event(
                    "omni.response.first_audio",
                    response_id=response.response_id,
                    turn_latency_ms=None if turn_ms is None else round(turn_ms, 1),
                    time_to_first_audio_ms=round(first_ms, 1),
                )
            )
        self.transport.play(response, pcm)
        response.samples += len(pcm)

    def playback_done(self, response_id: str) -> None:
        """The transport played a finished reply to its end."""
        if self._current(response_id):
            self.response = None

    def _cancel_ack(self, cancel_id: int, stage: str, t_ns: int, kv: float | None) -> None:
        sent = self.cancels.get(cancel_id)
        if sent is not None:
            self.metrics.cancel_latency.labels(stage).observe((t_ns - sent) / 1e9)
        if kv is not None:
            self.metrics.kv_usage.set(kv)
        pending = self.pending_cancels.get(cancel_id)
        if pending is None:
            return
        pending.acks[stage] = t_ns
        if kv is not None:
            pending.kv_usage = kv
        if set(pending.acks) >= set(STAGES):
            del self.pending_cancels[cancel_id]
            self.send(
                ev.event(
                    "omni.response.cancelled",
                    response_id=pending.response_id,
                    cancel_latency_ms=round(
                        (max(pending.acks.values()) - pending.sent_ns) / 1e6, 2
                    ),
                    stages_ms={
                        s: round((t - pending.sent_ns) / 1e6, 2) for s, t in pending.acks.items()
                    },
                    kv_cache_usage=pending.kv_usage,
                )
            )

    # -- client events ---------------------------------------------------------------------

    def on_client_message(self, message: Any) -> None:
        """One client event as received (JSON text); every failure becomes an `error` event."""
        if isinstance(message, bytes) or len(message) > MAX_EVENT_BYTES:
            self.send(ev.error("events must be JSON text of at most 16 MiB", code="invalid_event"))
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
        event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
        handler = self._handlers.get(data["type"])
        try:
            if handler is None:
                raise ProtocolError(
                    f"unknown or unsupported event type {data['type']!r}",
                    param="type",
                    code="unknown_event",
                )
            handler(self, data, event_id)
        except ProtocolError as exc:
            self.send(ev.error(str(exc), code=exc.code, param=exc.param, event_id=event_id))
        except Exception as exc:  # one bad event must never take the session down
            self.log.exception("handling %s failed", data["type"])
            self.send(
                ev.error(
                    f"{type(exc).__name__}: {exc}",
                    code="internal_error",
                    type_="server_error",
                    event_id=event_id,
                )
            )

    def _on_session_update(self, data: dict[str, Any], event_id: str | None) -> None:
        had_vad = self.config.turn_detection is not None
        self.config.apply(data.get("session"))
        td = self.config.turn_detection
        if td is not None:
            self.vad.update(
                threshold=td.threshold,
                prefix_padding_ms=td.prefix_padding_ms,
                silence_duration_ms=td.silence_duration_ms,
            )
        if had_vad != (td is not None):
            self.vad.reset()
            self.manual_audio, self.manual_samples = [], 0
        self._apply_settings()
        self.send(ev.event("session.updated", session=self.config.to_json(self.call_id)))

    def _on_append(self, data: dict[str, Any], event_id: str | None) -> None:
        if self.transport is not None and self.transport.kind == "webrtc":
            raise ProtocolError(
                "on a WebRTC call the caller's audio comes over its media track",
                param="type",
                code="unsupported",
            )
        self.append_audio(data.get("audio"))

    def _on_commit(self, data: dict[str, Any], event_id: str | None) -> None:
        self.commit_audio()

    def _on_clear(self, data: dict[str, Any], event_id: str | None) -> None:
        self.clear_audio()

    def _on_item_create(self, data: dict[str, Any], event_id: str | None) -> None:
        item = item_from_client(data.get("item"))
        previous = data.get("previous_item_id")
        if previous is not None and not isinstance(previous, str):
            raise ProtocolError("previous_item_id must be a string", param="previous_item_id")
        before = self.items.add(item, previous)
        self._sync_history()
        self.send(ev.event("conversation.item.added", previous_item_id=before, item=item.to_json()))
        self.send(ev.event("conversation.item.done", item=item.to_json()))

    def _on_item_retrieve(self, data: dict[str, Any], event_id: str | None) -> None:
        item = self.items.get(data.get("item_id"))
        self.send(ev.event("conversation.item.retrieved", item=item.to_json()))

    def _on_item_delete(self, data: dict[str, Any], event_id: str | None) -> None:
        item = self.items.get(data.get("item_id"))
        if self.response is not None and self.response.item is item:
            raise ProtocolError(
                "the item is being generated: cancel the response first", param="item_id"
            )
        self.items.delete(item.id)
        self._sync_history()
        self.send(ev.event("conversation.item.deleted", item_id=item.id))

    def _on_item_truncate(self, data: dict[str, Any], event_id: str | None) -> None:
        """Cut an assistant audio item to what the client played (`audio_end_ms`)."""
        item = self.items.get(data.get("item_id"))
        if item.role != "assistant" or item.content[0].get("type") != "output_audio":
            raise ProtocolError("only an assistant audio item can be truncated", param="item_id")
        if data.get("content_index", 0) != 0:
            raise ProtocolError("content_index must be 0", param="content_index")
        end_ms = data.get("audio_end_ms")
        if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0:
            raise ProtocolError("audio_end_ms must be an integer >= 0", param="audio_end_ms")
        response = self.response if self.response and self.response.item is item else None
        tracker = response.tracker if response else self._trackers.get(item.id)
        if tracker is None:
            raise ProtocolError("the item has no audio to truncate", param="item_id")
        length_ms = tracker.samples * 1000 // self.vocoder_rate
        if end_ms > length_ms and (response is None or response.generated):
            raise ProtocolError(
                f"audio_end_ms {end_ms} is beyond the item's audio ({length_ms} ms)",
                param="audio_end_ms",
            )
        played = end_ms * self.vocoder_rate // 1000
        if response is not None:
            # a reply still being made or played: stop it there; interrupt() announces the
            # truncation and the cancel carries the heard text to the reasoning stage
            self.interrupt("client_truncate", played)
            return
        item.content[0]["transcript"] = tracker.heard(played)
        self._sync_history()
        self.send(
            ev.event(
                "conversation.item.truncated",
                item_id=item.id,
                content_index=0,
                audio_end_ms=end_ms,
            )
        )

    def _on_response_create(self, data: dict[str, Any], event_id: str | None) -> None:
        params = parse_response_create(data.get("response"), self.config)
        if self.response is not None and not self.response.generated:
            raise ProtocolError(
                "a response is in progress: cancel it first, or wait for response.done",
                code="conversation_already_has_active_response",
            )
        if self.awaiting_transcript:
            self.deferred_create = (params, event_id)  # sent once the turn's text is known
            return
        self._create_response(params, event_id)

    def _create_response(self, params: ResponseParams, event_id: str | None) -> None:
        # a reply still playing stops first, so that its cancel precedes the new reply
        self.interrupt("superseded")
        response_id = ev.new_id("resp")
        self._metadata[response_id] = params.metadata
        self.link.create_response(
            self.session,
            response_id,
            instructions=params.instructions,
            audio=params.audio,
            max_output_tokens=params.max_output_tokens,
        )

    def _on_response_cancel(self, data: dict[str, Any], event_id: str | None) -> None:
        wanted = data.get("response_id")
        if self.response is None or self.response.generated:
            raise ProtocolError(
                "there is no response in progress", code="response_cancel_not_active"
            )
        if wanted is not None and wanted != self.response.response_id:
            raise ProtocolError(
                f"response {wanted!r} is not in progress", param="response_id", code="not_found"
            )
        self.interrupt("client_cancel")

    def _on_output_clear(self, data: dict[str, Any], event_id: str | None) -> None:
        if self.transport is not None and self.transport.kind != "webrtc":
            raise ProtocolError(
                "output_audio_buffer.clear is for WebRTC calls; over a WebSocket the client "
                "holds the audio (use response.cancel and conversation.item.truncate)",
                param="type",
                code="unsupported",
            )
        self.interrupt("client_clear")

    _handlers: ClassVar[
        dict[str, Callable[[RealtimeSession, dict[str, Any], str | None], None]]
    ] = {
        "session.update": _on_session_update,
        "input_audio_buffer.append": _on_append,
        "input_audio_buffer.commit": _on_commit,
        "input_audio_buffer.clear": _on_clear,
        "conversation.item.create": _on_item_create,
        "conversation.item.retrieve": _on_item_retrieve,
        "conversation.item.delete": _on_item_delete,
        "conversation.item.truncate": _on_item_truncate,
        "response.create": _on_response_create,
        "response.cancel": _on_response_cancel,
        "output_audio_buffer.clear": _on_output_clear,
    }

    def _sync_history(self) -> None:
        self.link.set_history(self.session, self.items.history())

    # -- teardown --------------------------------------------------------------------------

    async def close(self, reason: str) -> None:
        """Tear the session down and free its stage state; safe to call twice."""
        if self.closed.is_set():
            return
        self.closed.set()
        self.close_reason = reason
        self.log.info("session closed: %s", reason)
        self.response = None
        if self.transport is not None:
            self.transport.clear()
        self.link.close_session(self.session)  # the reasoning stage aborts its request
        self.on_closed(self)
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()
        if self.transport is not None:
            with contextlib.suppress(Exception):
                await self.transport.close()
