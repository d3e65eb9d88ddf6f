"""One Realtime session: the coordinator that wires its parts and routes what comes in.

Caller audio goes to `CallerTurns` (VAD, chunks to the encoder, turns and transcripts); stage
records about the agent's reply to `Replies`; stops go through gateway.session.stop; client
events through gateway.session.client_events; everything the client sees through the `Outbox`.
Transport-agnostic: a WebRTC call (gateway.webrtc) and a WebSocket (gateway.websocket) differ
only in how audio and events travel, which their `Transport` hides.

Everything here runs on the event loop. Stage records arrive on ring reader threads and hop
over with `loop.call_soon_threadsafe` (gateway.calls).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway import events as ev
from gateway.config import InterruptionConfig, ToolsConfig
from gateway.conversation import Conversation
from gateway.g711 import G711
from gateway.metrics import GatewayMetrics
from gateway.opus import PacketCodec
from gateway.protocol import (
    G711_FORMATS,
    INPUT_RATE,
    OPUS,
    OUTPUT_RATE,
    ProtocolError,
    ResponseParams,
    SessionConfig,
)
from gateway.resample import CALLER_RATE, Upsampler
from gateway.session import client_events, stop
from gateway.session.interruption import words_that_count
from gateway.session.outbox import Outbox, Transport
from gateway.session.replies import Replies
from gateway.session.reply import Reply
from gateway.session.spans import NO_SPANS, SessionSpans
from gateway.session.stop import Cancels
from gateway.session.tool_use import SessionTools
from gateway.session.turns import CallerTurns
from gateway.tools import ToolChoice
from stages.envelope import Envelope
from stages.link import PipelineLink
from stages.messages import (
    STAGE_RESTARTED,
    AudioDone,
    CancelAck,
    Error,
    Phrase,
    ResponseDone,
    ResponseStarted,
    SessionSettings,
    TextDelta,
    ToolArguments,
    ToolCallStarted,
    Transcript,
)
from stages.tasks import Tasks

if TYPE_CHECKING:
    from gateway.tracing import Tracing
    from gateway.turn_models import TurnModels

logger = logging.getLogger(__name__)


MAX_BACKLOG = 1000  # client events kept waiting behind a long append; past it, refused


class CallLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """Log lines of one session carry its id and pipeline session, as text and as record
    attributes (`call`, `session`) for structured handlers."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = self.extra or {}
        kwargs["extra"] = {**extra, **kwargs.get("extra", {})}
        return f"[call={extra.get('call')} session={extra.get('session')}] {msg}", kwargs


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
        turn_models: TurnModels | None = None,
        end_of_turn_pause_ms: int = 200,
        end_of_turn_sure: float = 0.95,
        interruptions: InterruptionConfig | None = None,
        tracing: Tracing | None = None,
        tools: ToolsConfig | None = None,
    ) -> None:
        """`hold_on_voice`: silence the agent from the caller's first voiced frame until the
        VAD decides whether they are talking over it (GatewayConfig.barge_in_hold).
        `prepare_reply_ms`: silence inside a turn after which the stages start on the reply,
        held until the turn ends (GatewayConfig.prepare_reply_ms; 0: off). `turn_models`:
        the process's VAD classifier and end-of-turn model (webrtcvad and no semantic_vad
        without). `interruptions`: what the caller's voice over the agent does. `tracing`: the
        process's OpenTelemetry traces (gateway.tracing), if on. `tools`: the gateway's
        rules for function and MCP tools."""
        self.call_id = call_id
        self.link = link
        self.session = session
        self.vocoder_rate = vocoder_rate
        self.metrics = metrics
        self.config = config
        self.on_closed = on_closed
        self.hold_on_voice = hold_on_voice
        self.log = CallLog(logger, {"call": call_id, "session": session})
        self.outbox = Outbox(call_id)
        self.items = Conversation()
        self.tasks = Tasks()
        self.interruptions = interruptions or InterruptionConfig()
        self.paused: Reply | None = None  # the reply paused under provisional turns
        self.spans = (
            SessionSpans(tracing, call_id, session, config, self.outbox, vocoder_rate)
            if tracing is not None
            else NO_SPANS
        )
        td = config.turn_detection
        self.turns = CallerTurns(
            link,
            session,
            config,
            self.outbox,
            self.items,
            self,
            metrics,
            prepare_reply_ms,
            voice=turn_models.voice(td.threshold if td else 0.5) if turn_models else None,
            end_of_turn=turn_models.end_of_turn if turn_models else None,
            end_of_turn_pause_ms=end_of_turn_pause_ms,
            end_of_turn_sure=end_of_turn_sure,
            spawn=self.spawn,
            confirm_ms=self.interruptions.confirm_ms,
            spans=self.spans,
        )
        self.turn_models = turn_models
        self._idle: asyncio.TimerHandle | None = None  # idle_timeout_ms, armed
        self._idle_from_ms = 0  # the caller's audio clock when it was armed
        self.replies = Replies(
            self.outbox,
            self.items,
            metrics,
            vocoder_rate,
            self.turns.take_speech_stopped_ns,
            self.spans,
        )
        self.cancels = Cancels(link, session, self.outbox, metrics, self.spans)
        self.tools = SessionTools(
            tools or ToolsConfig(),
            self.outbox,
            self.items,
            self.replies,
            self.spawn,
            settings_changed=self.apply_settings,
            follow_up=self._follow_up,
        )
        self.deferred_create: tuple[ResponseParams, str | None] | None = None
        self._history_due = False  # edits not yet sent to the reasoning stage (sync_history)
        self.closed = asyncio.Event()
        self.close_reason: str | None = None  # why it ended, once it has
        self.frame_arrivals: collections.deque[float] = collections.deque(maxlen=3000)
        self._in_rs: Upsampler | None = None
        self._intake: asyncio.Task[None] | None = None  # a long append being taken in
        self._backlog: collections.deque[Any] = collections.deque()  # events behind it
        self._opus: PacketCodec | None = None
        self._g711: dict[str, G711] = {}

    @property
    def transport(self) -> Transport | None:
        return self.outbox.transport

    @property
    def reply(self) -> Reply | None:
        """The reply the caller hears (started, until played to its end or cut)."""
        return self.replies.current

    @property
    def interrupted_at(self) -> collections.deque[float]:
        return self.replies.interrupted_at

    @property
    def audio_in_frames(self) -> int:
        return self.turns.frames

    # -- wiring ----------------------------------------------------------------------------

    def bind(self, transport: Transport) -> None:
        """Attach the transport; events sent before it existed go out now, in order."""
        self.outbox.bind(transport)

    def send(self, event: dict[str, Any]) -> None:
        self.outbox.send(event)

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        return self.tasks.spawn(coro, name)

    def start(self) -> None:
        """Greet the client (session.created) and hand the stages the session's settings;
        connect to the MCP servers it starts with (a client secret's session)."""
        self.apply_settings()
        self.outbox.session_created(self.config)
        self.tools.sync(self.config.tools)

    def apply_settings(self) -> None:
        c = self.config
        tools = self.tools.for_model(c.tools, strict=False)
        self.link.apply_settings(
            self.session,
            SessionSettings(c.instructions or None, c.audio_out, c.token_cap, tools),
        )

    def sync_history(self) -> None:
        """The client edited the conversation: the reasoning stage gets the whole history
        once the edits of this turn of the event loop are in (a burst of a thousand edits is
        one record, not a thousand ever longer ones), and before any reply is asked for."""
        if self._history_due:
            return
        self._history_due = True
        try:
            asyncio.get_running_loop().call_soon(self.flush_history)
        except RuntimeError:  # no loop running (a unit test driving the session by hand)
            self.flush_history()

    def flush_history(self) -> None:
        if self._history_due and not self.closed.is_set():
            self._history_due = False
            self.link.set_history(self.session, self.items.history())

    # -- caller audio ----------------------------------------------------------------------

    def feed_audio(self, pcm16k: np.ndarray) -> None:
        """Caller audio, PCM16 mono 16 kHz, in pieces of any length."""
        self.turns.feed(pcm16k)

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
        if self.config.input_format in G711_FORMATS:
            # any length: every byte is a sample
            self.feed_audio(self.g711(self.config.input_format).decode(raw))
            return
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
        if len(pcm) <= INPUT_RATE:
            self.feed_audio(self._input_resampler.convert(pcm))
            return
        # Longer: a second at a time, the loop served between (15 MiB is minutes of audio,
        # half a second of VAD work), and the resampler (libswresample) never given more:
        # it sizes its buffers, kept for the session's life, to the largest piece it had
        self._intake = self.spawn(self._take_in(pcm), f"intake-{self.call_id}")

    @property
    def opus(self) -> PacketCodec:
        """This session's libopus coder for the audio/opus format (made on first use)."""
        if self._opus is None:
            self._opus = PacketCodec(CALLER_RATE, OUTPUT_RATE)
        return self._opus

    def g711(self, audio_format: str) -> G711:
        """The call's coder of audio/pcmu or audio/pcma (made on first use)."""
        coder = self._g711.get(audio_format)
        if coder is None:
            coder = self._g711[audio_format] = G711(audio_format, self.vocoder_rate)
        return coder

    @property
    def _input_resampler(self) -> Upsampler:
        """24 kHz audio/pcm from a WebSocket client down to the caller rate."""
        if self._in_rs is None:
            self._in_rs = Upsampler(INPUT_RATE, CALLER_RATE)
        return self._in_rs

    # -- what the caller's turns mean for the reply (turns.TurnListener) --------------------

    def _interrupts(self) -> bool:
        td = self.config.turn_detection
        return td is not None and td.interrupt_response

    def speech_onset(self) -> bool:
        self.disarm_idle()
        if not self._interrupts():
            return False
        reply, transport = self.replies.current, self.transport
        # a WebSocket client plays what it was sent: only a transport that holds the agent's
        # audio itself (WebRTC, a phone stream) can pause it and play on
        if (
            self.interruptions.policy == "provisional"
            and reply is not None
            and reply.audio
            and transport is not None
            and transport.holds_audio
        ):
            if self.paused is None:
                self.paused = reply
                self.log.info("reply %s paused: the caller speaks over it", reply.response_id)
            transport.hold(True)
            return True
        stop.barge_in(self.replies, self.cancels, bool(self.turns.transcribing), self.log)
        return False

    def turn_ended(self, create_response: bool) -> None:
        if create_response:
            self.replies.ask_for_turn()

    def transcribed(self, turn_id: int, text: str) -> None:
        if turn_id in self.turns.provisional:
            self._settle(turn_id, text)
            return
        if not text and turn_id == self.turns.turn_id:
            self.replies.forget_asked()  # nothing was said: reasoning answers nothing
        if self.deferred_create is not None and not self.turns.transcribing:
            params, event_id = self.deferred_create
            self.deferred_create = None
            self.create_response(params, event_id)

    def spoke_on(self, turn_id: int) -> None:
        """The provisional turn went on long enough to be an interruption: the reply is cut
        (the cancel purges the turn too) and the turn begun again, as any turn."""
        self._interrupted()
        self.turns.begin_again()

    def maybe_speaking(self, unsure: bool) -> None:
        """A barge-in is decided some frames after the caller's first voiced one: the agent
        goes quiet from that frame on, and plays on, nothing lost, if it was not one (under
        the provisional policy, until the turn is known not to be one)."""
        if self.transport is not None:
            held = unsure and self.hold_on_voice and self._interrupts()
            held = held or self.paused is not None
            self.transport.hold(held and self.replies.current is not None)

    # -- provisional turns over the agent (gateway.session.interruption) ------------------

    def _settle(self, turn_id: int, text: str) -> None:
        voiced_ms = self.turns.voiced_ms_of.get(turn_id, 0)
        words = words_that_count(text, self.interruptions.backchannels)
        counts = bool(words) and voiced_ms >= self.interruptions.min_speech_ms
        self.log.info(
            "over the agent: %r, %d ms voiced: %s",
            text,
            voiced_ms,
            "an interruption" if counts else "none",
        )
        item_id = self.turns.settle(turn_id, text, counts)
        paused = self.paused
        if counts:
            self._interrupted()
            td = self.config.turn_detection
            if td is not None and td.create_response:
                self._answer(text)
            else:
                self.sync_history()
            return
        self.metrics.false_interruptions.inc()
        if paused is None or self.turns.provisional or self.turns.vad.in_speech:
            return  # another sound over the agent is still to be settled
        self.paused = None
        reply = self.replies.current
        if reply is paused and self.transport is not None:
            self.transport.hold(False)
            self.outbox.interruption_resumed(reply.response_id or "", item_id or "", text)
            self.log.info("reply %s plays on (%r was no interruption)", reply.response_id, text)

    def _interrupted(self) -> None:
        """The caller's sound over the agent was an interruption: the reply paused for it is
        cut where it paused, as a barge-in."""
        paused, self.paused = self.paused, None
        if paused is not None and self.replies.current is paused:
            stop.cut(self.replies, self.cancels, "barge_in", self.log)

    def _answer(self, text: str) -> None:
        """Answer the words that interrupted the agent (reasoning was not sent them)."""
        response_id = ev.new_id("resp")
        self.replies.ask(response_id, None)
        self.flush_history()
        self.link.create_response(self.session, response_id, text=text)

    # -- idle_timeout_ms ---------------------------------------------------------------------

    def arm_idle(self, after_s: float = 0.0) -> None:
        """The agent's reply has been heard (or will have been in `after_s`): the caller has
        idle_timeout_ms to say something."""
        td = self.config.turn_detection
        self.disarm_idle()
        if td is None or td.semantic or not td.idle_timeout_ms or self.closed.is_set():
            return
        self._idle_from_ms = self.turns.vad.audio_ms + int(after_s * 1000)
        loop = asyncio.get_running_loop()
        self._idle = loop.call_later(after_s + td.idle_timeout_ms / 1000, self._idle_timeout)

    def disarm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _idle_timeout(self) -> None:
        self._idle = None
        busy = self.replies.current or self.replies.turn_asked or self.replies.created
        if self.closed.is_set() or self.turns.vad.in_speech or busy:
            return
        item_id = ev.new_id("item")
        self.outbox.timeout_triggered(self._idle_from_ms, self.turns.vad.audio_ms, item_id)
        self.turns.commit_item(item_id, "")
        self.create_response(ResponseParams(), None)

    # -- replies -------------------------------------------------------------------------------

    def create_response(self, params: ResponseParams, event_id: str | None) -> None:
        """Ask the stages for a reply (response.create, once the last turn's text is in)."""
        self.disarm_idle()
        tools = self.tools.for_model(params.tools) if params.tools is not None else None
        # a reply still playing stops first, so that its cancel precedes the new reply; one
        # that called functions plays its words to their end before this one
        if not self.replies.hand_over():
            stop.cut(self.replies, self.cancels, "superseded", self.log)
        response_id = ev.new_id("resp")
        self.replies.ask(response_id, params.metadata)
        self.flush_history()
        self.link.create_response(
            self.session,
            response_id,
            instructions=params.instructions,
            audio=params.audio,
            max_output_tokens=params.max_output_tokens,
            tools=tools,
        )

    def _follow_up(self, choice: str) -> None:
        """A reply that reads the MCP calls' answers, with the session's tools."""
        if self.closed.is_set() or self.replies.active():
            return
        tools = dataclasses.replace(self.config.tools, choice=ToolChoice(choice))
        self.sync_history()
        self.create_response(ResponseParams(tools=tools), None)

    def playback_done(self, response_id: str) -> None:
        """The transport played a finished reply to its end (a WebSocket client: was sent
        it all, and plays the rest itself)."""
        reply, transport = self.replies.current_for(response_id), self.transport
        if reply is not None and transport is not None:
            unheard = max(0, reply.samples - transport.heard_samples(reply))
            self.arm_idle(unheard / self.vocoder_rate)
        self.replies.played(response_id)

    # -- stage records -----------------------------------------------------------------------

    def on_stage_event(self, env: Envelope) -> None:
        if self.closed.is_set():
            return
        replies, msg = self.replies, env.msg
        match msg:
            case memoryview() | bytes():  # AUDIO_OUT
                if not self._ahead_of_start(env, None):
                    replies.audio(np.frombuffer(msg, dtype=np.int16))
            case Phrase():
                ahead = self._ahead_of_start(env, msg.response_id)
                if not ahead and (reply := replies.current_for(msg.response_id)):
                    replies.phrase(reply, msg.text)
            case AudioDone():
                ahead = self._ahead_of_start(env, msg.response_id)
                if not ahead and (reply := replies.current_for(msg.response_id)):
                    replies.audio_done(reply)
            case Transcript() if msg.speculative:  # the turn so far, at the caller's pause
                self.turns.words_judged(msg.turn_id, msg.finished)
            case Transcript():
                self.spans.transcript(msg, env.t_ns)
                self.turns.transcript(msg.turn_id, msg.text, msg.final)
            case ResponseStarted():
                self._response_started(msg, env.t_ns)
            case TextDelta():
                if reply := replies.current_for(msg.response_id):
                    self.spans.text_delta(reply, msg, env.t_ns)
                    replies.text_delta(reply, msg.text)
            case ToolCallStarted():
                if reply := replies.current_for(msg.response_id):
                    self.tools.call_started(reply, msg.index, msg.call_id, msg.name)
            case ToolArguments():
                if reply := replies.current_for(msg.response_id):
                    replies.call_arguments(reply, msg.index, msg.delta)
            case ResponseDone():
                if reply := replies.current_for(msg.response_id):
                    for call in msg.tool_calls:
                        self.tools.call_made(reply, call.call_id, call.arguments)
                    for bad in msg.bad_calls:
                        self.tools.call_bad(reply, bad.index, bad.name, bad.reason)
                    replies.text_done(reply, msg.text, msg.status)
            case CancelAck():
                self.cancels.acked(msg.cancel_id, msg.stage, msg.t_ns, msg.kv_usage)
            case Error():
                self.metrics.stage_errors.labels(msg.stage).inc()
                message = f"{msg.stage}: {msg.message}"
                self.outbox.error(message, code=msg.code, type_="server_error")
                if msg.code == STAGE_RESTARTED:
                    self._stage_lost({"type": "server_error", "code": msg.code, "message": message})

    def _stage_lost(self, error: dict[str, Any]) -> None:
        """A stage died under the session and was purged of it: its replies end failed, and
        the turns it was transcribing end with nothing heard."""
        self.paused = None
        stop.lost(self.replies, error, self.log)
        self.turns.lost_transcripts()

    def _ahead_of_start(self, env: Envelope, response_id: str | None) -> bool:
        """Keep a vocoder record whose reply has not started here yet; True when kept."""
        kept = self.replies.voice_ahead.keep(env, response_id)
        if kept:
            self.metrics.voice_ahead.inc()
        return kept

    def _response_started(self, msg: ResponseStarted, t_ns: int) -> None:
        asked = self.replies.turn_asked is not None
        if self.replies.current is not None:  # the stages stopped it for this one already
            stop.let_go(self.replies, "superseded", self.log)
        self.replies.start(msg.response_id, msg.turn_id, msg.audio, msg.tools, t_ns)
        ahead = self.replies.voice_ahead.started(msg.response_id)
        if asked and self._interrupts() and self.turns.vad.in_speech:
            # the reply to the caller's last turn started after they spoke again (too soon
            # for a barge-in to cancel it): stopped unheard, and without a cancel, which
            # would purge the turn they are in
            stop.stop_unheard(self.replies, self.link, self.session, self.log)
        else:
            for early in ahead:
                self.on_stage_event(early)

    # -- client events -----------------------------------------------------------------------

    def on_client_message(self, message: Any) -> None:
        """One client event as received (JSON text); every failure becomes an `error` event.
        While a long append is being taken in, later events wait for it, in order."""
        if self._intake is None:
            client_events.dispatch(self, message)
        elif len(self._backlog) < MAX_BACKLOG:
            self._backlog.append(message)
        else:
            self.outbox.error(
                f"more than {MAX_BACKLOG} events came while a long input_audio_buffer.append "
                "was taken in: this one was dropped",
                code="too_many_events",
            )

    @property
    def taking_in(self) -> bool:
        """A long append is still being fed to the VAD, a second at a time."""
        return self._intake is not None

    async def _take_in(self, pcm: np.ndarray) -> None:
        try:
            for start in range(0, len(pcm), INPUT_RATE):
                self.feed_audio(self._input_resampler.convert(pcm[start : start + INPUT_RATE]))
                await asyncio.sleep(0)  # the other calls on this loop, between seconds
        finally:
            self._intake = None
            while self._backlog and self._intake is None and not self.closed.is_set():
                client_events.dispatch(self, self._backlog.popleft())

    # -- teardown --------------------------------------------------------------------------

    async def close(self, reason: str) -> None:
        """Tear the session down and free its stage state; safe to call twice."""
        if self.closed.is_set():
            return
        self.closed.set()
        self.outbox.closed = True
        self.close_reason = reason
        self.log.info("session closed: %s", reason)
        self.disarm_idle()
        self.spans.close()
        self.replies.current = self.replies.finishing = None
        # coders' native buffers go now, not at a collection
        self._in_rs = self._opus = None
        self._g711.clear()
        transport = self.transport
        if transport is not None:
            transport.clear()
        try:
            self.link.close_session(self.session)  # the reasoning stage aborts its request
        finally:
            self.on_closed(self)
            await self.tools.close()
            await self.tasks.close()
            if transport is not None:
                try:
                    await transport.close()
                except Exception:
                    self.log.exception("closing the transport failed")
