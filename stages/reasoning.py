"""The reasoning stage: final transcripts in, text deltas out, from one vLLM engine for all
sessions (continuous batching). Each session keeps its conversation; a cancelled reply is
remembered only as far as the caller heard it.

A reply can start early, on the transcript of the turn so far when the caller pauses
(gateway.prepare_reply_ms): its records for the gateway are held back until the final
transcript comes, then sent at once if the turn ended as it was, or the request is aborted if
the caller went on. The vocoder gets them as they come and makes the reply's first audio
meanwhile, held back too, until a RESPONSE_RELEASE says which way the turn went."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shm import epoch_older
from stages.config import TINY_CHAT_MODEL, ReasoningConfig
from stages.messages import (
    Cancel,
    History,
    Kind,
    Msg,
    ResponseCreate,
    ResponseDone,
    ResponseRelease,
    ResponseStarted,
    SessionSettings,
    TextDelta,
    Transcript,
    Truncate,
)
from stages.passlog import LatencyLog
from stages.rings import GATEWAY
from stages.worker import Inbound, Stage, StageSpec, ends_state

logger = logging.getLogger(__name__)


def resolve_model(config: ReasoningConfig) -> str:
    """The model path or id to load; the built-in tiny model is built on first use."""
    if config.model != TINY_CHAT_MODEL:
        return config.model
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
class Conversation:
    system_prompt: str
    max_messages: int
    messages: list[dict[str, str]] = field(default_factory=list)

    def add(self, role: str, text: str) -> dict[str, str] | None:
        """Append a message (none for empty text); returns it, to take it back by identity."""
        if not text:
            return None
        message = {"role": role, "content": text}
        self.messages.append(message)
        del self.messages[: max(0, len(self.messages) - self.max_messages)]
        return message

    def take_back(self, message: dict[str, str] | None) -> None:
        """Remove a message `add` returned (if the history still holds it)."""
        for i, m in enumerate(self.messages):
            if m is message:
                del self.messages[i]
                return

    def replace(self, history: History) -> None:
        self.messages = []
        for m in history.messages:
            self.add(m.role, m.text)

    def prompt(self, instructions: str | None = None) -> list[dict[str, str]]:
        system = {"role": "system", "content": instructions or self.system_prompt}
        return [system, *self.messages]


@dataclass
class Response:
    response_id: str
    request_id: str
    epoch: int
    task: asyncio.Task[None] | None = None
    text: str = ""
    finished: bool = False
    recorded: bool = False  # its text is in the conversation (once, whoever stops it)
    recorded_as: dict[str, str] | None = None  # the message that holds it
    # an early reply's records for the gateway, kept back until its turn ends (None: sent as
    # they come); the vocoder's go at once, its audio is kept back there
    held: list[Msg] | None = None
    dropped: bool = False  # an early reply dropped: its task's last records go nowhere

    def record(self, conversation: Conversation, text: str) -> None:
        if not self.recorded:
            self.recorded = True
            self.recorded_as = conversation.add("assistant", text)


@dataclass
class EarlyReply:
    """A reply started at the caller's pause, on the transcript of the turn so far: released
    if the turn ends with the same transcript, dropped (request aborted, its user and any
    assistant message taken back) if the caller goes on."""

    turn_id: int
    text: str
    asked: dict[str, str] | None  # the user message it answers
    response: Response


@dataclass
class SessionState:
    conversation: Conversation
    epoch: int  # the session's epoch when this state was made (see worker.ends_state)
    settings: SessionSettings = field(default_factory=SessionSettings)
    response: Response | None = None
    early: EarlyReply | None = None


@dataclass(frozen=True)
class ReplyOptions:
    """How one reply is made: the session's settings with its response.create's overrides."""

    instructions: str | None = None
    audio: bool = True
    paced: bool = True
    max_output_tokens: int | None = None

    @classmethod
    def of(cls, settings: SessionSettings, create: ResponseCreate | None = None) -> ReplyOptions:
        if create is None:
            return cls(settings.instructions, settings.audio, True, settings.max_output_tokens)
        return cls(
            create.instructions if create.instructions is not None else settings.instructions,
            create.audio if create.audio is not None else settings.audio,
            create.paced,
            create.max_output_tokens
            if create.max_output_tokens is not None
            else settings.max_output_tokens,
        )


class ReasoningStage(Stage):
    name = "reasoning"

    def __init__(self, spec: StageSpec, stop: threading.Event) -> None:
        super().__init__(spec, stop)
        self.sessions: dict[int, SessionState] = {}
        self._request_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cancel_hops = _CancelHops()

    def load(self) -> dict[str, Any]:
        from stages.backends.llm_vllm import ReasoningEngine

        cfg = self.config.reasoning
        self._loop = asyncio.new_event_loop()
        model = resolve_model(cfg)
        self.engine = self._loop.run_until_complete(
            ReasoningEngine.start(model, cfg.engine_args, cfg.sampling)
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

    async def _shutdown_engine(self) -> None:
        self.engine.shutdown()  # blocks the loop for its few seconds: nothing else is served

    async def _run_until_stopped(self) -> None:
        stopped = asyncio.Event()
        loop = asyncio.get_running_loop()

        def on_sigterm() -> None:
            self.stop.set()
            stopped.set()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        if not self.stop.is_set():
            await stopped.wait()
        for state in self.sessions.values():
            await self._stop_response(state)

    def deliver(self, item: Inbound) -> None:
        """Reader thread -> event loop."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, item)

    # -- on the event loop -----------------------------------------------------------------

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _dispatch(self, item: Inbound) -> None:
        s = item.session
        if self.is_stale(item):
            return
        if item.kind in (Kind.SESSION_OPEN, Kind.SESSION_CLOSE):
            # swap the state now, so records that follow in the ring find the new session;
            # only stopping the old reply's request waits
            old = self.sessions.get(s)
            if old is not None and not ends_state(item, old.epoch):
                # the new holder's turn came first, on the encoder's ring: keep it
                if item.kind is Kind.SESSION_OPEN and item.msg.instructions:
                    old.conversation.system_prompt = item.msg.instructions
                return
            self.sessions.pop(s, None)
            if item.kind is Kind.SESSION_OPEN:
                conversation = self._new_conversation(item.msg.instructions)
                self.sessions[s] = SessionState(conversation, item.epoch)
            if old is not None and old.response is not None:
                self._spawn(self._stop(old.response), f"stop-{s}")
        elif item.kind is Kind.CANCEL:
            # the reply the CANCEL found, if it began before it (a new turn's, on the encoder's
            # ring, can come first); by the time the task runs, a new turn may have started
            # another (or the session been closed and reopened), which it must not touch
            state = self.sessions.get(s)
            response = state.response if state else None
            if response is not None and not ends_state(item, response.epoch):
                response = None
            early = state.early if state else None
            if early is not None and ends_state(item, early.response.epoch):
                state.early = None  # never released: never heard
                self._drop_early(s, state, early)
                response = None if response is early.response else response
            stamps = [item.t_ns, time.monotonic_ns()]  # pushed, read; _cancel adds the rest
            self._spawn(self._cancel(s, state, response, item.msg, stamps), f"cancel-{s}")
        elif item.kind is Kind.TRANSCRIPT:
            msg: Transcript = item.msg
            state = self._state(s, item.epoch)
            if epoch_older(item.epoch, self.control.epoch(s)):
                # a final transcript of a turn the caller spoke on after: a cancel came while it
                # was being made (rings.survives_cancel). Its words are kept, not answered; the
                # turn the caller is in now is answered with them.
                if msg.text:
                    state.conversation.add("user", msg.text)
                return
            early, state.early = state.early, None
            if msg.speculative:
                if early is not None:
                    self._drop_early(s, state, early)
                self._start_early(s, state, msg, item.epoch)
                return
            if early is not None:
                if (early.turn_id, early.text) == (msg.turn_id, msg.text) and msg.final:
                    self._release(s, early.response)  # the turn ended as it was at the pause
                    return
                self._drop_early(s, state, early)
            state.conversation.add("user", msg.text)
            if msg.final and msg.text and msg.create_response:
                options = ReplyOptions.of(state.settings)
                self._start(s, state, f"resp_{s}_{msg.turn_id}", msg.turn_id, item.epoch, options)
        elif item.kind is Kind.TURN_RESUMED:
            state = self._state(s, item.epoch)
            early = state.early
            if early is not None and early.turn_id == item.msg.turn_id:
                state.early = None
                self._drop_early(s, state, early)
        elif item.kind is Kind.RESPONSE_CREATE:
            create: ResponseCreate = item.msg
            state = self._state(s, item.epoch)
            if create.text:
                state.conversation.add("user", create.text)
            options = ReplyOptions.of(state.settings, create)
            self._start(s, state, create.response_id, -1, item.epoch, options)
        elif item.kind is Kind.RESPONSE_STOP:
            state = self.sessions.get(s)
            response = state.response if state else None
            if response is None or response.response_id != item.msg.response_id:
                return  # it ended, or the next began, meanwhile
            self._drop_unheard(s, state, response, f"stop-{s}")
        elif item.kind is Kind.TRUNCATE:
            self._truncate(self._state(s, item.epoch), item.msg)
        elif item.kind is Kind.HISTORY:
            self._state(s, item.epoch).conversation.replace(item.msg)
        elif item.kind is Kind.SESSION_SETTINGS:
            self._state(s, item.epoch).settings = item.msg

    # -- replies started early, at the caller's pause -----------------------------------------

    def _start_early(self, session: int, state: SessionState, msg: Transcript, epoch: int) -> None:
        if not (msg.text and msg.create_response) or state.response is not None:
            return  # nothing to answer, or a reply still running that this must not stop
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
        moment the turn ends (docs/benchmarks.md, "Preparing the reply")."""
        held, response.held = response.held or [], None
        out: list[Msg] = []
        for msg in held:
            if isinstance(msg, TextDelta) and out and isinstance(out[-1], TextDelta):
                out[-1] = msgspec.structs.replace(out[-1], text=out[-1].text + msg.text)
            else:
                out.append(msg)
        for msg in out:
            self.send(GATEWAY, session, msg, epoch=response.epoch)
        release = ResponseRelease(response.response_id, keep=True)
        self.send("vocoder", session, release, epoch=response.epoch)

    def _drop_early(self, session: int, state: SessionState, early: EarlyReply) -> None:
        state.conversation.take_back(early.asked)
        response = early.response
        if response.held is not None:  # never released: the vocoder drops what it made
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
        self._spawn(self._stop(response), task_name)

    def _state(self, session: int, epoch: int) -> SessionState:
        state = self.sessions.get(session)
        if state is None:  # a session whose SESSION_OPEN we missed (e.g. after a restart)
            state = SessionState(self._new_conversation(None), epoch)
            self.sessions[session] = state
        return state

    def _new_conversation(self, instructions: str | None) -> Conversation:
        cfg = self.config.reasoning
        return Conversation(instructions or cfg.system_prompt, cfg.max_history_messages)

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
        response.held = [] if held else None
        state.response = response
        response.task = self._spawn(
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
        if previous is not None:  # one reply at a time per session
            await self._stop(previous)
            previous.record(state.conversation, previous.text)
        started = ResponseStarted(response.response_id, turn_id, options.audio, options.paced)
        held = response.held is not None
        self._emit(session, response, "vocoder", msgspec.structs.replace(started, held=held))
        self._emit(session, response, GATEWAY, started)
        prompt = state.conversation.prompt(options.instructions)
        sampling = (
            {"max_tokens": options.max_output_tokens}
            if options.max_output_tokens is not None
            else None
        )
        status, first_ns, index = "completed", 0, 0
        submitted_ns = time.monotonic_ns()
        try:
            async for text in self.engine.generate(response.request_id, prompt, sampling):
                if not first_ns:
                    first_ns = time.monotonic_ns()
                response.text += text
                since_submit = first_ns - submitted_ns if index == 0 else 0
                delta = TextDelta(response.response_id, text, index, since_submit)
                index += 1
                self._emit(session, response, "vocoder", delta)
                self._emit(session, response, GATEWAY, delta)
        except asyncio.CancelledError:
            raise  # _cancel answers for a cancelled reply
        except Exception as exc:
            status = "failed"
            self.error(session, "generation_failed", f"{type(exc).__name__}: {exc}")
        response.finished = True
        response.record(state.conversation, response.text)
        done = ResponseDone(response.response_id, status, response.text, index, first_ns)
        self._emit(session, response, "vocoder", done)
        self._emit(session, response, GATEWAY, done)
        if state.response is response:
            state.response = None

    def _emit(self, session: int, response: Response, dst: str, msg: Msg) -> None:
        if response.dropped:
            return
        if response.held is not None and dst == GATEWAY:
            response.held.append(msg)
        else:
            self.send(dst, session, msg, epoch=response.epoch)

    async def _stop(self, response: Response) -> None:
        """Cancel the reply's task; generate() turns that into a vLLM abort (KV freed)."""
        task = response.task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.engine.abort(response.request_id)  # idempotent; covers a task not yet run

    async def _stop_response(self, state: SessionState) -> None:
        if state.response is not None:
            await self._stop(state.response)
            state.response = None

    async def _cancel(
        self,
        session: int,
        state: SessionState | None,
        response: Response | None,
        msg: Cancel,
        stamps: list[int],
    ) -> None:
        seq, usage = self.engine.kv_stats_seq(), self.engine.kv_usage()
        sent_seq = None
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
            self._truncate(state, Truncate(msg.response_id, msg.spoken_text))
        kv = await self.engine.kv_usage_after_abort(seq, usage, sent_seq=sent_seq)
        self.ack(session, msg.cancel_id, kv_usage=kv)
        if sent_seq is not None:
            self._cancel_hops.add(stamps)

    def _truncate(self, state: SessionState, msg: Truncate) -> None:
        """Replace the last assistant message with what the caller heard of it."""
        for m in reversed(state.conversation.messages):
            if m["role"] == "assistant":
                if msg.spoken_text:
                    m["content"] = msg.spoken_text
                else:
                    state.conversation.messages.remove(m)
                return


class _CancelHops:
    """Where a cancel of a reply being made spends its time in this stage, a log line a hop
    every 10 s: from the gateway's push to the event loop reading it (ring, reader thread, a
    busy loop), to vLLM's abort sent (the reply's task stopped), to the freed blocks seen (the
    engine's step in flight; see `kv_usage_after_abort`)."""

    HOPS = (
        "CANCEL pushed to read on the event loop",
        "read to vLLM's abort sent",
        "abort sent to freed blocks seen",
    )

    def __init__(self) -> None:
        self.logs = [LatencyLog(f"cancel of a reply being made: {hop}") for hop in self.HOPS]

    def add(self, stamps: list[int]) -> None:
        """As the ack goes out: `stamps` are pushed, read and abort sent (monotonic ns)."""
        stamps = [*stamps, time.monotonic_ns()]
        for log, start, end in zip(self.logs, stamps, stamps[1:], strict=False):
            log.add((end - start) / 1e9)


async def _settle(tasks: set[asyncio.Task[Any]]) -> None:
    """Wait for cancelled tasks to finish (gather must run inside the loop that owns them)."""
    await asyncio.gather(*tasks, return_exceptions=True)
