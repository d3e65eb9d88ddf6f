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
import collections
import concurrent.futures
import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway import events as ev
from gateway.config import EchoCancelConfig, ToolsConfig, TurnsConfig
from gateway.conversation import Conversation
from gateway.echo import AudioProcessing, EchoCanceller, PlayedAudio, audio_processing
from gateway.echo import worker as echo_worker
from gateway.metrics import GatewayMetrics
from gateway.protocol import ResponseParams, SessionConfig
from gateway.session import client_events, stop
from gateway.session.intake import Intake
from gateway.session.interruptions import Interruptions
from gateway.session.outbox import Outbox, Transport
from gateway.session.replies import Replies
from gateway.session.reply import Reply
from gateway.session.spans import session_spans
from gateway.session.stop import Cancels
from gateway.session.tool_use import SessionTools
from gateway.session.turns import CallerTurns
from gateway.tools import ToolChoice
from gateway.turns.idle import IdleTimer
from gateway.turns.interruption import InterruptionPolicy
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
    from gateway.prompt_limit import PromptLimit
    from gateway.tracing import Tracing
    from gateway.turns.models import TurnModels

logger = logging.getLogger(__name__)

# gateway.media.echo_cancel's key for a transport kind
TRANSPORT_KEYS = {"twilio": "phone"}


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
        turns: TurnsConfig | None = None,
        turn_models: TurnModels | None = None,
        tracing: Tracing | None = None,
        tools: ToolsConfig | None = None,
        speech_in: bool = False,
        prompt_limit: PromptLimit | None = None,
        echo_cancel: EchoCancelConfig | None = None,
    ) -> None:
        """`turns`: the gateway's turn-taking section (its defaults without one);
        `turn_models`: the process's classifier and end-of-turn model (webrtcvad and no
        semantic_vad without); `tracing`: the process's OpenTelemetry traces (gateway.tracing),
        if on; `tools`: the gateway's rules for function and MCP tools; `speech_in`: the
        reasoning model hears the turns (reasoning.speech_in), not their transcripts;
        `prompt_limit`: instructions and tools checked against the model's context;
        `echo_cancel`: which transports' caller audio goes through the echo canceller."""
        self.call_id, self.link, self.session = call_id, link, session
        self.vocoder_rate, self.metrics, self.config = vocoder_rate, metrics, config
        self.on_closed, self.speech_in = on_closed, speech_in
        self.log = CallLog(logger, {"call": call_id, "session": session})
        self.outbox = Outbox(call_id, config)
        self.items = Conversation()
        self.tasks = Tasks()
        turns = turns or TurnsConfig()
        self.spans = session_spans(tracing, call_id, session, config, self.outbox, vocoder_rate)
        self.turns = CallerTurns(
            link,
            session,
            config,
            self.outbox,
            self.items,
            self,
            metrics,
            turns,
            models=turn_models,
            spawn=self.spawn,
            spans=self.spans,
        )
        self.turn_models, self.prompt_limit = turn_models, prompt_limit
        self.idle = IdleTimer(self._idle_timeout)
        self.replies = Replies(
            self.outbox,
            self.items,
            metrics,
            vocoder_rate,
            self.turns.take_speech_stopped_ns,
            self.spans,
        )
        self.cancels = Cancels(link, session, self.outbox, metrics, self.spans)
        self.interruptions = Interruptions(
            InterruptionPolicy(turns.interruptions),
            config,
            self.turns,
            self.replies,
            self.cancels,
            self.outbox,
            metrics,
            self.log,
            answer=self._answer,
            sync_history=self.sync_history,
        )
        self.tools = SessionTools(
            tools or ToolsConfig(),
            self.outbox,
            self.items,
            self.replies,
            self.spawn,
            settings_changed=self.apply_settings,
            follow_up=self._follow_up,
        )
        self.intake = Intake(
            lambda: (self.config.input_format, self.config.input_rate),
            vocoder_rate,
            self.feed_audio,
            self.spawn,
            dispatch=lambda message: client_events.dispatch(self, message),
            refuse=lambda message: self.outbox.error(message, code="too_many_events"),
        )
        self.echo_cancel = echo_cancel or EchoCancelConfig()
        # the agent's audio as the caller was played it, and the canceller that takes it out
        # of the caller's audio: set by `configure_audio` while the session wants them
        self.played: PlayedAudio | None = None
        self.echo: EchoCanceller | None = None
        self.deferred_create: tuple[ResponseParams, str | None] | None = None
        self._history_due = False  # edits not yet sent to the reasoning stage (sync_history)
        self.closed = asyncio.Event()
        self.close_reason: str | None = None  # why it ended, once it has
        self.frame_arrivals: collections.deque[float] = collections.deque(maxlen=3000)

    @property
    def transport(self) -> Transport | None:
        return self.outbox.transport

    @property
    def reply(self) -> Reply | None:
        """The reply the caller hears (started, until played to its end or cut)."""
        return self.replies.current

    # -- wiring ----------------------------------------------------------------------------

    def bind(self, transport: Transport) -> None:
        """Attach the transport; events sent before it existed go out now, in order."""
        self.outbox.bind(transport)
        self.configure_audio()

    def configure_audio(self) -> None:
        """The caller's audio processing as the session's settings and transport ask
        (gateway.echo.audio_processing); a change starts a fresh canceller."""
        transport = self.transport
        if transport is None:
            return
        default = getattr(self.echo_cancel, TRANSPORT_KEYS.get(transport.kind, transport.kind))
        wanted = audio_processing(
            default, self.config.noise_reduction, self.echo_cancel.noise_suppression
        )
        current: AudioProcessing | None = self.echo.processing if self.echo else None
        if wanted == current:
            return
        if wanted is not None and wanted.echo:
            self.played = self.played or PlayedAudio(transport.played_rate)
        else:
            self.played = None
        self.echo = None if wanted is None else EchoCanceller(wanted, self.played)
        self.log.info("caller audio processing: %s", wanted or "none")

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

    # -- the caller ------------------------------------------------------------------------

    def feed_audio(self, pcm16k: np.ndarray) -> None:
        """Caller audio, PCM16 mono 16 kHz, in pieces of any length."""
        if self.echo is None:
            self.turns.feed(pcm16k)
            return
        # through the canceller on its thread, back here in order (gateway.echo.worker)
        canceller, loop = self.echo, asyncio.get_running_loop()
        job = echo_worker().submit(canceller.cancel, *canceller.take(pcm16k))
        job.add_done_callback(
            lambda done: loop.call_soon_threadsafe(self._cancelled, done, canceller)
        )

    def _cancelled(
        self, done: concurrent.futures.Future[np.ndarray], canceller: EchoCanceller
    ) -> None:
        self.metrics.echo_cancel_seconds.inc(canceller.busy_s - canceller.counted_s)
        canceller.counted_s = canceller.busy_s
        if self.closed.is_set():
            return
        try:
            pcm16k = done.result()
        except Exception:  # a bad frame is dropped; the call goes on
            self.log.exception("the echo canceller failed on a frame")
            return
        self.turns.feed(pcm16k)

    def on_client_message(self, message: Any) -> None:
        """One client event as received (JSON text); every failure becomes an `error` event.
        While a long append is being taken in, later events wait for it, in order."""
        self.intake.event(message)

    # what the caller's turns mean for the reply (turns.TurnListener); a sound over the agent
    # is the interruptions' to decide

    def speech_onset(self) -> bool:
        self.idle.disarm()
        return self.interruptions.onset()

    def maybe_speaking(self, unsure: bool) -> None:
        self.interruptions.unsure(unsure)

    def voiced(self, turn_id: int, voiced_ms: int) -> None:
        self.interruptions.voiced(turn_id, voiced_ms)

    def turn_ended(self, create_response: bool) -> None:
        if create_response:
            self.replies.ask_for_turn()

    def transcribed(self, turn_id: int, text: str) -> None:
        if turn_id in self.turns.provisional:
            self.interruptions.settle(turn_id, text)
            return
        if not text and turn_id == self.turns.turn_id and not self.speech_in:
            self.replies.forget_asked()  # nothing was said: reasoning answers nothing
        if self.deferred_create is not None and not self.turns.transcribing:
            params, event_id = self.deferred_create
            self.deferred_create = None
            self.create_response(params, event_id)

    def _answer(self, text: str) -> None:
        """Answer the words that interrupted the agent (reasoning was not sent them)."""
        response_id = ev.new_id("resp")
        self.replies.ask(response_id, None)
        self.flush_history()
        self.link.create_response(self.session, response_id, text=text)

    def arm_idle(self, after_s: float = 0.0) -> None:
        """The agent's reply has been heard (or will have been in `after_s`): the caller has
        idle_timeout_ms to say something."""
        if not self.closed.is_set():
            detector = self.turns.detector
            self.idle.arm(self.config.turn_detection, detector.audio_ms, after_s)

    def _idle_timeout(self, from_ms: int) -> None:
        busy = self.replies.current or self.replies.turn_asked or self.replies.created
        if self.closed.is_set() or self.turns.detector.in_speech or busy:
            return
        item_id = ev.new_id("item")
        self.outbox.timeout_triggered(from_ms, self.turns.detector.audio_ms, item_id)
        self.turns.commit_item(item_id, "")
        self.create_response(ResponseParams(), None)

    # -- replies -------------------------------------------------------------------------------

    def create_response(self, params: ResponseParams, event_id: str | None) -> None:
        """Ask the stages for a reply (response.create, once the last turn's text is in)."""
        self.idle.disarm()
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
                    replies.text_done(reply, msg)
            case CancelAck():
                self.cancels.acked(msg.cancel_id, msg.stage, msg.t_ns, msg.kv_usage)
            case Error():
                self.metrics.stage_errors.labels(msg.stage).inc()
                if msg.code == STAGE_RESTARTED:  # the supervisor's words, for the client
                    message = f"{msg.stage}: {msg.message}"
                else:  # a stage's own: what its exception said stays in the server's log
                    self.log.warning("%s stage error %s: %s", msg.stage, msg.code, msg.message)
                    message = f"the {msg.stage} stage failed ({msg.code}); see the server's log"
                self.outbox.error(message, code=msg.code, type_="server_error")
                if msg.code == STAGE_RESTARTED:
                    self._stage_lost({"type": "server_error", "code": msg.code, "message": message})

    def _stage_lost(self, error: dict[str, Any]) -> None:
        """A stage died under the session and was purged of it: its replies end failed, and
        the turns it was transcribing end with nothing heard."""
        self.interruptions.paused = None
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
        if asked and self.interruptions.interrupts and self.turns.detector.in_speech:
            # the reply to the caller's last turn started after they spoke again (too soon
            # for a barge-in to cancel it): stopped unheard, and without a cancel, which
            # would purge the turn they are in
            stop.stop_unheard(self.replies, self.link, self.session, self.log)
        else:
            for early in ahead:
                self.on_stage_event(early)

    # -- teardown --------------------------------------------------------------------------

    async def close(self, reason: str) -> None:
        """Tear the session down and free its stage state; safe to call twice."""
        if self.closed.is_set():
            return
        self.closed.set()
        self.outbox.closed = True
        self.close_reason = reason
        self.log.info("session closed: %s", reason)
        self.idle.disarm()
        self.spans.close()
        self.replies.current = self.replies.finishing = None
        self.intake.close()
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
