"""The reasoning stage: final transcripts in, text deltas out, from one vLLM engine for all
sessions (continuous batching). Each session keeps its conversation; a cancelled reply is
remembered only as far as the caller heard it.

A reply can start early, on the transcript of the turn so far when the caller pauses
(stages.prepared): its records for the gateway are held back until the final transcript says
which way the turn went; the vocoder gets them as they come.

Under speech-in (reasoning.speech_in), a turn is its audio tower's rows, not its transcript:
they come window by window as the caller speaks, each window's prefilled (stages.speech_in),
and the reply starts when the last rows come; the transcript comes after, for the history's
text.

A dead vLLM engine (its engine core process gone) ends this stage with an error, so that the
supervisor restarts it and tells its sessions, instead of failing every later turn."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from shm import epoch_older
from stages.config import TINY_CHAT_MODEL, PipelineConfig, ReasoningConfig
from stages.conversation import ChatHistory
from stages.envelope import Envelope
from stages.messages import (
    AudioEmbeddings,
    Cancel,
    History,
    Msg,
    ResponseCreate,
    ResponseDone,
    ResponseRelease,
    ResponseStarted,
    SessionOpen,
    SessionSettings,
    TextDelta,
    ToolArguments,
    ToolCall,
    ToolCallStarted,
    Tools,
    Transcript,
    Truncate,
)
from stages.passlog import CancelHops, CountLog
from stages.prepared import EarlyReply, HeldBack
from stages.rings import GATEWAY, Ends
from stages.speech_in import EmbeddedPrompt, SpokenTurn, rows_tensor, speech_in_model
from stages.stage import Stage
from stages.stops import Stop
from stages.tasks import Tasks, cancel_and_wait

if TYPE_CHECKING:
    from stages.backends.llm_vllm import VllmEngine
    from stages.backends.tool_parsing import ToolCalls

ENGINE_CHECK_S = 1.0  # how often an idle stage looks at the engine's health

logger = logging.getLogger(__name__)


def resolve_model(config: ReasoningConfig) -> str:
    """The model path or id to load; the built-in tiny model is built on first use."""
    if config.model != TINY_CHAT_MODEL:
        from stages.backends import bundled

        return bundled.resolve(config.model)
    from stages.backends.tiny_chat_model import ensure_tiny_chat_model

    path = ensure_tiny_chat_model()
    logger.warning(
        "reasoning: using %s, a tiny RANDOM-WEIGHT chat model built locally (%s): replies are "
        "gibberish; set reasoning.model to a real chat model for real answers",
        TINY_CHAT_MODEL,
        path,
    )
    return str(path)


@dataclass
class Response:
    response_id: str
    request_id: str
    epoch: int
    task: asyncio.Task[None] | None = None
    text: str = ""
    finished: bool = False
    recorded: bool = False  # its text is in the conversation (once, whoever stops it)
    recorded_as: dict[str, Any] | None = None  # the message that holds it
    # an early reply's records for the gateway, kept back until its turn ends (None: a reply
    # made as its turn ended); the vocoder's go at once, its audio is kept back there
    held: HeldBack[Msg] | None = None
    dropped: bool = False  # an early reply dropped: its task's last records go nowhere

    def record(
        self, conversation: ChatHistory, text: str, tool_calls: list[ToolCall] | None = None
    ) -> None:
        if not self.recorded:
            self.recorded = True
            self.recorded_as = conversation.add("assistant", text, tool_calls)


@dataclass
class SessionState:
    conversation: ChatHistory
    epoch: int  # the session's epoch when this state was made (see worker.ends_state)
    settings: SessionSettings = field(default_factory=SessionSettings)
    response: Response | None = None
    early: EarlyReply | None = None
    spoken: SpokenTurn | None = None  # speech-in: the turn whose rows are coming
    text_turns: set[int] = field(default_factory=set)  # speech-in turns their words carry


@dataclass(frozen=True)
class ReplyOptions:
    """How one reply is made: the session's settings with its response.create's overrides."""

    instructions: str | None = None
    audio: bool = True
    paced: bool = True
    max_output_tokens: int | None = None
    tools: Tools = field(default_factory=Tools)

    @classmethod
    def of(cls, settings: SessionSettings, create: ResponseCreate | None = None) -> ReplyOptions:
        if create is None:
            return cls(
                settings.instructions,
                settings.audio,
                True,
                settings.max_output_tokens,
                settings.tools,
            )
        return cls(
            create.instructions if create.instructions is not None else settings.instructions,
            create.audio if create.audio is not None else settings.audio,
            create.paced,
            create.max_output_tokens
            if create.max_output_tokens is not None
            else settings.max_output_tokens,
            create.tools if create.tools is not None else settings.tools,
        )

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools.tools) and self.tools.choice != "none"


class ReasoningStage(Stage):
    name = "reasoning"

    def __init__(self, config: PipelineConfig, ends: Ends, stop: threading.Event) -> None:
        super().__init__(config, ends, stop)
        self.sessions: dict[int, SessionState] = {}
        self._request_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.tasks = Tasks()
        self._cancel_hops = CancelHops()
        # whether the replies made at the pause were the ones heard: a turn answered without
        # one waited for its transcript, first tokens and first audio after it ended
        self._prepared = CountLog("replies made at the pause", "how they ended")
        self._engine_failure: BaseException | None = None
        self._wake: asyncio.Event | None = None
        self._tool_template_found: tuple[str | None] | None = None
        self._tool_parser_class: Any = None
        self.embedded: EmbeddedPrompt | None = None  # speech-in's prompts
        self._prefills = CountLog("speech-in prefills", "positions found cached")

    def load(self) -> dict[str, Any]:
        from stages.backends.llm_vllm import VllmEngine

        cfg = self.config.reasoning
        self._loop = asyncio.new_event_loop()
        speech_in = speech_in_model(cfg)
        engine_args = dict(cfg.engine_args)
        if speech_in is not None:
            # the language model alone, its user turns audio rows (stages.speech_in)
            model = speech_in.language_model()
            engine_args["enable_prompt_embeds"] = True
        else:
            model = resolve_model(cfg)
        self.engine: VllmEngine = self._loop.run_until_complete(
            VllmEngine.start(model, engine_args, cfg.sampling)
        )
        if speech_in is not None:
            import torch

            # this process's tensor work is copying rows into prompts, on the event loop that
            # also reads vLLM's outputs: one thread, not a pool spinning on every core
            torch.set_num_threads(1)
            assert cfg.speech_in is not None
            hidden = self.engine.hidden_size
            dtype = getattr(torch, cfg.speech_in.dtype)
            self.embedded = EmbeddedPrompt(self.engine.tokenizer, speech_in.layout, hidden, dtype)
            logger.info(
                "reasoning: speech-in, %s's language model (%s), prefill while speaking: %s",
                speech_in.family,
                model,
                cfg.speech_in.prefill_while_speaking,
            )
        return {"model": model}

    def run(self) -> None:
        assert self._loop is not None
        loop = self._loop
        try:
            loop.run_until_complete(self._run_until_stopped())
        finally:
            try:
                # on the loop: vLLM closes its sockets there, and only when its loop runs (else
                # the shutdown waited for them until the supervisor killed the stage, 15 s)
                loop.run_until_complete(self._shutdown_engine())
                # let vLLM's output handler and our tasks see their cancellation before the
                # loop goes away
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                loop.run_until_complete(_settle(pending))
            finally:
                loop.close()
        if self._engine_failure is not None:
            raise self._engine_failure  # a non-zero exit: the supervisor restarts the stage

    async def _shutdown_engine(self) -> None:
        self.engine.shutdown()  # blocks the loop for its few seconds: nothing else is served

    async def _run_until_stopped(self) -> None:
        """Until SIGTERM (or the stop flag, which the supervisor watch sets), or until the
        engine dies."""
        wake = self._wake = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_sigterm() -> None:
            self.stop.set()
            wake.set()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        while not self.stop.is_set() and self._engine_failure is None:
            if self.engine.dead:
                self._engine_died(self.engine.dead_error())
                break
            try:
                await asyncio.wait_for(wake.wait(), ENGINE_CHECK_S)
            except TimeoutError:
                continue
        for state in self.sessions.values():
            if state.response is not None:
                await self._stop(state.response)
                state.response = None

    def _engine_died(self, exc: BaseException) -> None:
        if self._engine_failure is None:
            logger.error("reasoning: the vLLM engine died (%s); the stage stops", exc)
            self._engine_failure = exc
            self.cannot_serve(f"the vLLM engine died: {exc}")  # its shutdown takes seconds
        if self._wake is not None:
            self._wake.set()

    def deliver(self, env: Envelope) -> None:
        """Reader thread -> event loop."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, env)

    # -- on the event loop -----------------------------------------------------------------

    def _dispatch(self, env: Envelope) -> None:
        if self.is_stale(env):
            return
        try:
            self.route(env)
        except Exception as exc:  # this session's turn fails; the others go on
            logger.exception("reasoning: %s for session %d failed", env.kind.name, env.session)
            self.error(env.session, "internal_error", f"{type(exc).__name__}: {exc}")

    def on_stop(self, session: int, stop: Stop) -> None:
        state = self.sessions.get(session)
        ended: Response | None = None  # the reply a cancel cuts, to record as heard
        prefills: list[str] = []  # speech-in: the prefill requests a stop ends
        if state is not None and state.spoken is not None and stop.ends(state.spoken.epoch):
            prefills = self._end_prefill(state.spoken)
            state.spoken = None
        if state is not None and stop.ends_session(state.epoch):
            # swap the state now, so records that follow in the ring find the new session;
            # only stopping the old reply's request waits
            del self.sessions[session]
            if state.response is not None:
                self.tasks.spawn(self._stop(state.response), f"stop-{session}")
            state = None
        elif state is not None:
            early = state.early
            if early is not None and stop.ends_prepared(early.turn_id, early.response.epoch):
                state.early = None  # never released: never heard
                self._drop_early(session, state, early)
                self._prepared.add("caller_went_on")
            response = state.response
            if response is not None and stop.ends_reply(response.response_id, response.epoch):
                if stop.unheard:
                    self._drop_unheard(session, state, response, f"stop-{session}")
                else:
                    ended = response
                    if stop.cancel is not None and stop.cancel.spoken_text is not None:
                        # recorded now, so a message that follows the cancel in the ring
                        # (the caller's words that interrupted it) comes after it
                        response.record(state.conversation, stop.cancel.spoken_text)
        if stop.cancel is not None:
            # by the time the task runs, a new turn may have started another reply (or the
            # session been closed and reopened), which it must not touch
            stamps = [stop.pushed_ns, time.monotonic_ns()]  # _cancel adds the rest
            self.tasks.spawn(
                self._cancel(session, state, ended, stop.cancel, stamps, prefills),
                f"cancel-{session}",
            )
        elif prefills:
            self.tasks.spawn(self._abort(prefills), f"stop-prefills-{session}")

    def handle(self, env: Envelope) -> None:
        s, msg = env.session, env.msg
        match msg:
            case AudioEmbeddings():
                self._spoken(s, msg, env.epoch)
            case Transcript() if self.embedded is not None and self._transcribes(s, msg):
                pass  # speech-in: the turn was its rows; its words join them in the history
            case Transcript():
                self._transcript(s, msg, env.epoch)
            case ResponseCreate():
                state = self._state(s, env.epoch)
                if msg.text:
                    state.conversation.add("user", msg.text)
                options = ReplyOptions.of(state.settings, msg)
                self._start(s, state, msg.response_id, -1, env.epoch, options)
            case SessionOpen():
                state = self.sessions.get(s)
                if state is None:
                    conversation = self._new_conversation(msg.instructions)
                    self.sessions[s] = SessionState(conversation, env.epoch)
                elif msg.instructions:
                    # the new holder's turn came first, on the encoder's ring: keep it
                    state.conversation.system_prompt = msg.instructions
            case Truncate():
                self._state(s, env.epoch).conversation.truncate(msg.spoken_text)
            case History():
                self._state(s, env.epoch).conversation.replace(msg)
            case SessionSettings():
                self._state(s, env.epoch).settings = msg

    def _transcript(self, session: int, msg: Transcript, epoch: int) -> None:
        state = self._state(session, epoch)
        if epoch_older(epoch, self.control.epoch(session)):
            # a final transcript of a turn the caller spoke on after: a cancel came while it
            # was being made (stages.stops.survives_cancel). Its words are kept, not answered;
            # the turn the caller is in now is answered with them.
            if msg.text:
                state.conversation.add("user", msg.text)
            return
        early, state.early = state.early, None
        if msg.speculative:
            if early is not None:
                self._drop_early(session, state, early)
                self._prepared.add("made_again")
            self._start_early(session, state, msg, epoch)
            return
        if early is not None:
            if msg.final and early.answers(msg.turn_id, msg.text):
                self._release(session, early.response)  # the turn ended as it was at the pause
                self._prepared.add("released")
                return
            self._drop_early(session, state, early)
            self._prepared.add("transcript_differed")
        state.conversation.add("user", msg.text)
        if msg.final and msg.text and msg.create_response:
            if early is None:
                self._prepared.add("turn_answered_without_one")
            options = ReplyOptions.of(state.settings)
            self._start(
                session, state, f"resp_{session}_{msg.turn_id}", msg.turn_id, epoch, options
            )

    # -- replies started early, at the caller's pause (stages.prepared) ----------------------

    def _start_early(self, session: int, state: SessionState, msg: Transcript, epoch: int) -> None:
        if not (msg.text and msg.create_response):
            return  # nothing to answer
        if state.response is not None:
            self._prepared.add("not_made_reply_running")  # one this must not stop
            return
        asked = state.conversation.add("user", msg.text)
        response_id = f"resp_{session}_{msg.turn_id}"
        options = ReplyOptions.of(state.settings)
        self._start(session, state, response_id, msg.turn_id, epoch, options, held=True)
        assert state.response is not None
        state.early = EarlyReply(msg.turn_id, msg.text, asked, state.response)

    def _release(self, session: int, response: Response) -> None:
        """Send what an early reply made so far; from now on it streams as any reply does.

        The text made so far goes as one delta, not dozens: each delta is an event on the
        caller's data channel and a feed of the vocoder's phrase splitter, all due at the
        moment the turn ends."""

        def send(held: list[Msg]) -> None:
            out: list[Msg] = []
            for msg in held:
                if isinstance(msg, TextDelta) and out and isinstance(out[-1], TextDelta):
                    out[-1] = msgspec.structs.replace(out[-1], text=out[-1].text + msg.text)
                else:
                    out.append(msg)
            for msg in out:
                self.send(GATEWAY, session, msg, epoch=response.epoch)

        if response.held is not None:
            response.held.release(send)
        release = ResponseRelease(response.response_id, keep=True)
        self.send("vocoder", session, release, epoch=response.epoch)

    def _drop_early(self, session: int, state: SessionState, early: EarlyReply) -> None:
        state.conversation.take_back(early.asked)
        response = early.response
        if response.held is not None and response.held.holding:
            # never released: the vocoder drops what it made
            release = ResponseRelease(response.response_id, keep=False)
            self.send("vocoder", session, release, epoch=response.epoch)
        self._drop_unheard(session, state, response, f"drop-early-{session}")

    def _drop_unheard(
        self, session: int, state: SessionState, response: Response, task_name: str
    ) -> None:
        """Stop a reply nobody heard: nothing more of it goes out, it is not (or no longer) in
        the history, and its vLLM request is aborted."""
        if response.recorded:  # it had finished: its answer goes too
            state.conversation.take_back(response.recorded_as)
        response.recorded = True  # and is never recorded now
        if state.response is response:
            state.response = None
        response.dropped = True
        self.tasks.spawn(self._stop(response), task_name)

    def _state(self, session: int, epoch: int) -> SessionState:
        state = self.sessions.get(session)
        if state is None:  # a session whose SESSION_OPEN we missed (e.g. after a restart)
            state = SessionState(self._new_conversation(None), epoch)
            self.sessions[session] = state
        return state

    def _new_conversation(self, instructions: str | None) -> ChatHistory:
        cfg = self.config.reasoning
        return ChatHistory(
            instructions or cfg.system_prompt,
            cfg.max_history_messages,
            examples=cfg.example_messages,
        )

    def _start(
        self,
        session: int,
        state: SessionState,
        response_id: str,
        turn_id: int,
        epoch: int,
        options: ReplyOptions,
        held: bool = False,
    ) -> None:
        previous = state.response
        response = Response(response_id, f"{response_id}-{next(self._request_ids)}", epoch)
        response.held = HeldBack() if held else None
        state.response = response
        response.task = self.tasks.spawn(
            self._respond(session, state, response, previous, turn_id, options),
            f"respond-{response.request_id}",
        )

    async def _respond(
        self,
        session: int,
        state: SessionState,
        response: Response,
        previous: Response | None,
        turn_id: int,
        options: ReplyOptions,
    ) -> None:
        from stages.backends.llm_vllm import EngineDeadError, PromptUsage

        if previous is not None:  # one reply at a time per session
            await self._stop(previous)
            previous.record(state.conversation, previous.text)
        started = ResponseStarted(
            response.response_id, turn_id, options.audio, options.paced, tools=options.calls_tools
        )
        # released already if its turn ended before this task ran: the vocoder holds nothing
        held = response.held is not None and response.held.holding
        self._emit(session, response, "vocoder", msgspec.structs.replace(started, held=held))
        self._emit(session, response, GATEWAY, started)
        status, first_ns, index = "completed", 0, 0
        calls: ToolCalls | None = None
        usage, audio_rows, failure, told = PromptUsage(), 0, "", ""
        try:
            calls, prompt, sampling, tools, template = self._prepare(session, state, options)
            submitted_ns = time.monotonic_ns()
            request_id = response.request_id
            if isinstance(prompt, dict):  # speech-in: made already, its turns audio rows
                audio_rows = prompt["prompt_is_token_ids"].count(False)
                pieces = self.engine.generate_prompt(request_id, prompt, sampling, usage)
            else:
                pieces = self.engine.generate_pieces(
                    request_id, prompt, sampling, tools, template, usage
                )
            # one cap for what a reply says: the tools' larger one (its `sampling`) is for the
            # JSON of a call, so a reply that may call but talks stops at the words' cap
            words_cap = self._words_cap(options) if calls is not None else None
            tokens = 0
            async with contextlib.aclosing(pieces) as stream:  # a break aborts the request
                async for text, token_ids, finished in stream:
                    if not first_ns:
                        first_ns = time.monotonic_ns()
                    tokens += len(token_ids)
                    said = self._said(session, response, calls, text, token_ids, finished)
                    if said:
                        response.text += said
                        since_submit = first_ns - submitted_ns if index == 0 else 0
                        delta = TextDelta(response.response_id, said, index, since_submit)
                        index += 1
                        self._emit(session, response, "vocoder", delta)
                        self._emit(session, response, GATEWAY, delta)
                    if words_cap is not None and tokens >= words_cap and not calls.calling:
                        break
                    if calls is not None and calls.whole:
                        break  # the one call it had to make is written
        except asyncio.CancelledError:
            raise  # _cancel answers for a cancelled reply
        except EngineDeadError as exc:
            status, failure = "failed", "engine_dead"  # the reply's end says so
            logger.error("reasoning: session %d's reply failed: %s", session, exc)
            self._engine_died(exc)
        except Exception as exc:
            from stages.backends.tool_parsing import ToolTemplateError

            status, failure = "failed", "generation_failed"
            if isinstance(exc, ToolTemplateError):  # the setting to fix, for the client too
                failure, told = "tool_template", str(exc)
            logger.warning(
                "reasoning: session %d's reply failed: %s: %s", session, type(exc).__name__, exc
            )
        response.finished = True
        good, bad = calls.finish() if calls is not None and status == "completed" else ([], [])
        response.record(state.conversation, response.text, good)
        done = ResponseDone(
            response.response_id,
            status,
            response.text,
            usage.output_tokens,
            first_ns,
            input_tokens=usage.prompt_tokens,
            input_audio_tokens=audio_rows,
            cached_tokens=usage.cached_tokens,
            error=failure,
            error_message=told,
        )
        self._emit(session, response, "vocoder", done)
        self._emit(
            session,
            response,
            GATEWAY,
            msgspec.structs.replace(done, tool_calls=good, bad_calls=bad),
        )
        if state.response is response:
            state.response = None

    def _prepare(
        self, session: int, state: SessionState, options: ReplyOptions
    ) -> tuple[
        ToolCalls | None,
        list[dict[str, Any]] | dict[str, Any],
        dict[str, Any] | None,
        list[dict[str, Any]] | None,
        str | None,
    ]:
        """What the reply asks of the engine: (its function calling, the prompt: chat messages,
        or under speech-in the engine's prompt made already, sampling overrides, the tools the
        template lists, the template to list them with)."""
        sampling: dict[str, Any] = {}
        cap = self._cap(options)
        tools, template = self._tools_of(options)
        if cap is not None:
            sampling["max_tokens"] = cap
        if self.embedded is not None:
            engine_prompt = self._speech_prompt(session, state, options)
            calls = None
            if options.calls_tools:
                from stages.backends.tool_parsing import ToolCalls

                messages = [
                    {k: v for k, v in m.items() if k not in ("audio", "turn_id", "transcript")}
                    for m in state.conversation.prompt(options.instructions)
                ]
                calls = ToolCalls(
                    options.tools, messages, self._tool_parser(), self.engine.tokenizer
                )
                sampling.update(calls.sampling())
            return calls, engine_prompt, sampling or None, tools, template
        budget = self.engine.prompt_budget(cap)
        overhead = len(msgspec.json.encode(tools)) if tools else 0
        if dropped := state.conversation.fit(
            options.instructions,
            lambda prompt: self.engine.prompt_tokens(prompt, tools, template),
            budget,
            overhead,
        ):
            logger.debug("session %d: %d oldest messages out, to fit the context", session, dropped)
        prompt = state.conversation.prompt(options.instructions)
        calls = None
        if options.calls_tools:
            from stages.backends.tool_parsing import ToolCalls

            calls = ToolCalls(options.tools, prompt, self._tool_parser(), self.engine.tokenizer)
            sampling.update(calls.sampling())
        return calls, prompt, sampling or None, tools, template

    def _said(
        self,
        session: int,
        response: Response,
        calls: ToolCalls | None,
        text: str,
        token_ids: list[int],
        finished: bool,
    ) -> str:
        """The words of one piece of output, to speak; the calls in it go to the gateway."""
        if calls is None:
            return text
        from stages.backends.tool_parsing import CallArguments, CallStarted, Words

        said = ""
        for piece in calls.feed(text, token_ids, finished):
            match piece:
                case Words(text=words):
                    said += words
                case CallStarted(index=i, call_id=call_id, name=name):
                    started = ToolCallStarted(response.response_id, i, call_id, name)
                    self._emit(session, response, GATEWAY, started)
                case CallArguments(index=i, delta=delta):
                    self._emit(
                        session, response, GATEWAY, ToolArguments(response.response_id, i, delta)
                    )
        return said

    def _words_cap(self, options: ReplyOptions) -> int | None:
        """The tokens a reply may speak: its own cap, or the configured one (None: none)."""
        return options.max_output_tokens or self.config.reasoning.sampling.get("max_tokens")

    def _cap(self, options: ReplyOptions) -> int | None:
        """The reply's token cap: its own, or at least what a function call needs."""
        cap = options.max_output_tokens
        if options.calls_tools:
            cap = max(
                cap or self.config.reasoning.sampling.get("max_tokens") or 0,
                self.config.reasoning.tools.max_tokens,
            )
        return cap

    def _tools_of(self, options: ReplyOptions) -> tuple[list[dict[str, Any]] | None, str | None]:
        """The tools a reply's template lists, and the template (none without tools)."""
        if not options.calls_tools:
            return None, None
        from stages.backends.tool_parsing import chat_tools

        return chat_tools(options.tools), self._tool_template()

    def _tool_template(self) -> str | None:
        """The chat template that lists tools (None: the model's own), found once."""
        if self._tool_template_found is None:
            from stages.backends.tool_parsing import tool_chat_template

            model_template = getattr(self.engine.tokenizer, "chat_template", None)
            self._tool_template_found = (
                tool_chat_template(self.config.reasoning.tools.chat_template, model_template),
            )
        return self._tool_template_found[0]

    def _tool_parser(self) -> Any:
        if self._tool_parser_class is None:
            from stages.backends.tool_parsing import parser_class

            cfg = self.config.reasoning.tools
            self._tool_parser_class = parser_class(cfg.parser, self.engine.tokenizer, cfg.strict)
        return self._tool_parser_class

    def _emit(self, session: int, response: Response, dst: str, msg: Msg) -> None:
        if response.dropped:
            return
        if dst == GATEWAY and response.held is not None and response.held.keep(msg):
            return
        self.send(dst, session, msg, epoch=response.epoch)

    async def _stop(self, response: Response) -> None:
        """Cancel the reply's task; generate() turns that into a vLLM abort (KV freed)."""
        if response.task is not None and response.task is not asyncio.current_task():
            await cancel_and_wait(response.task)
        await self.engine.abort(response.request_id)  # idempotent; covers a task not yet run

    async def _cancel(
        self,
        session: int,
        state: SessionState | None,
        response: Response | None,
        msg: Cancel,
        stamps: list[int],
        prefills: list[str] | None = None,
    ) -> None:
        seq, usage = self.engine.kv_stats_seq(), self.engine.kv_usage()
        sent_seq = None
        if prefills:  # speech-in: the turn's prefills, whose blocks the ack reports freed too
            await self._abort(prefills)
            sent_seq = self.engine.kv_stats_seq()
        if state is not None and response is not None and not response.finished:
            await self._stop(response)
            sent_seq = self.engine.kv_stats_seq()  # the abort is on its way to the engine
            stamps.append(time.monotonic_ns())
            if state.response is response:
                state.response = None
            heard = msg.spoken_text if msg.spoken_text is not None else response.text
            response.record(state.conversation, heard)
        elif state is not None and msg.spoken_text is not None and msg.response_id:
            # the reply had finished generating but was still being spoken
            state.conversation.truncate(msg.spoken_text)
        kv = await self.engine.kv_usage_after_abort(seq, usage, sent_seq=sent_seq)
        self.ack(session, msg, kv_usage=kv)
        if sent_seq is not None:
            self._cancel_hops.add(stamps)

    # -- speech-in: a turn's rows, window by window (stages.speech_in) ----------------------

    def _spoken(self, session: int, msg: AudioEmbeddings, epoch: int) -> None:
        state = self._state(session, epoch)
        if epoch_older(epoch, self.control.epoch(session)):
            return  # a cancel came since: the turn's transcript keeps it (survives_cancel)
        turn = state.spoken
        if turn is None or (turn.turn_id, turn.epoch) != (msg.turn_id, epoch):
            if turn is not None:  # a turn that never ended (dropped in the encoder)
                self.tasks.spawn(self._abort(self._end_prefill(turn)), f"prefills-{session}")
            turn = state.spoken = SpokenTurn(msg.turn_id, epoch)
        rows = rows_tensor(msg) if msg.rows else None
        if msg.speculative:
            self._start_early_spoken(session, state, turn, rows, msg, epoch)
            return
        turn.take(msg, rows)
        speech_in = self.config.reasoning.speech_in
        assert speech_in is not None
        if not msg.final:
            if speech_in.prefill_while_speaking and not turn.broken:
                self._prefill_soon(session, state, turn)
            return
        state.spoken = None
        prefills = self._end_prefill(turn)
        if prefills:
            self.tasks.spawn(self._abort(prefills), f"prefills-{session}")
        early, state.early = state.early, None
        as_paused = early is not None and msg.as_paused and early.turn_id == msg.turn_id
        if as_paused and not turn.broken:
            assert early is not None
            self._release(session, early.response)  # the turn ended as it was at the pause
            self._prepared.add("released")
            return
        if early is not None:
            self._drop_early(session, state, early)
            self._prepared.add("turn_went_on")
        if turn.broken or not turn.windows:
            # a window went missing (or none came): its transcript carries the turn
            state.text_turns.add(msg.turn_id)
            return
        state.conversation.add_audio(turn.rows(), msg.turn_id)
        if msg.create_response:
            if early is None:
                self._prepared.add("turn_answered_without_one")
            options = ReplyOptions.of(state.settings)
            self._start(
                session, state, f"resp_{session}_{msg.turn_id}", msg.turn_id, epoch, options
            )

    def _start_early_spoken(
        self,
        session: int,
        state: SessionState,
        turn: SpokenTurn,
        rows: Any,
        msg: AudioEmbeddings,
        epoch: int,
    ) -> None:
        """The caller paused: the reply is made on the turn so far, held until it ends."""
        early, state.early = state.early, None
        if early is not None:
            self._drop_early(session, state, early)
            self._prepared.add("made_again")
        audio = turn.rows(extra=rows)
        if not msg.create_response or turn.broken or audio is None:
            return
        if state.response is not None:
            self._prepared.add("not_made_reply_running")
            return
        asked = state.conversation.add_audio(audio, msg.turn_id)
        response_id = f"resp_{session}_{msg.turn_id}"
        options = ReplyOptions.of(state.settings)
        self._start(session, state, response_id, msg.turn_id, epoch, options, held=True)
        assert state.response is not None
        state.early = EarlyReply(msg.turn_id, "", asked, state.response)

    def _transcribes(self, session: int, msg: Transcript) -> bool:
        """Speech-in: take a transcript into the history beside its turn's rows; False for
        one that carries its turn itself (the rows went missing, or never came)."""
        if msg.speculative:
            return True  # the gateway's, for its turn-taking: the reply is made on the rows
        state = self.sessions.get(session)
        if state is None:
            return False
        if msg.turn_id in state.text_turns:
            state.text_turns.discard(msg.turn_id)
            return False
        return state.conversation.transcribed(msg.turn_id, msg.text)

    def _prefill_soon(self, session: int, state: SessionState, turn: SpokenTurn) -> None:
        """Prefill the turn so far; a window that comes while one runs waits for it (each
        extends the last one's cached prefix)."""
        if turn.prefill is None or turn.prefill.done():
            turn.prefill = self.tasks.spawn(
                self._prefill(session, state, turn), f"prefill-{session}-{turn.turn_id}"
            )

    async def _prefill(self, session: int, state: SessionState, turn: SpokenTurn) -> None:
        assert self.embedded is not None
        while state.spoken is turn and turn.prefilled < len(turn.windows):
            windows = len(turn.windows)
            options = ReplyOptions.of(state.settings)
            prompt = self._speech_prompt(session, state, options, turn)
            request_id = f"prefill-{session}-{turn.turn_id}-{next(self._request_ids)}"
            turn.prefill_ids.append(request_id)
            try:
                cached = await self.engine.prefill(request_id, prompt)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the reply is made without it
                logger.warning("reasoning: session %d's prefill failed: %s", session, exc)
                return
            turn.prefilled = windows
            whole = len(prompt["prompt_token_ids"])
            self._prefills.add("most" if cached * 2 >= whole else "some" if cached else "none")

    def _speech_prompt(
        self,
        session: int,
        state: SessionState,
        options: ReplyOptions,
        turn: SpokenTurn | None = None,
    ) -> dict[str, Any]:
        """The engine's prompt under speech-in: the conversation (its audio turns as rows),
        fitted to the context; with `turn`, its rows so far as an open user turn, cut after
        them (a prefill's)."""
        assert self.embedded is not None
        tools, template = self._tools_of(options)
        budget = self.engine.prompt_budget(self._cap(options))
        embedded = self.embedded

        def count(messages: list[dict[str, Any]]) -> int:
            extra = [] if turn is None else [self._open_turn(turn)]
            return embedded.count([*messages, *extra], tools, template)

        if dropped := state.conversation.fit(options.instructions, count, budget):
            logger.debug("session %d: %d oldest messages out, to fit the context", session, dropped)
        messages = state.conversation.prompt(options.instructions)
        if turn is None:
            return embedded.render(messages, tools, template)
        messages.append(self._open_turn(turn))
        return embedded.render(messages, tools, template, open_turn=True)

    @staticmethod
    def _open_turn(turn: SpokenTurn) -> dict[str, Any]:
        return {"role": "user", "content": "", "audio": turn.rows(), "turn_id": turn.turn_id}

    def _end_prefill(self, turn: SpokenTurn) -> list[str]:
        """Stop the turn's prefills; the request ids to abort (aborts are idempotent)."""
        if turn.prefill is not None and not turn.prefill.done():
            turn.prefill.cancel()
        turn.prefill = None
        ids, turn.prefill_ids = turn.prefill_ids, []
        return ids

    async def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            await self.engine.abort(request_id)


async def _settle(tasks: set[asyncio.Task[Any]]) -> None:
    """Wait for cancelled tasks to finish (gather must run inside the loop that owns them)."""
    await asyncio.gather(*tasks, return_exceptions=True)
