"""The reasoning stage's session state against the order its records arrive in, with no engine
and no rings: a session's turns come on the encoder's ring, its open and close on the
gateway's, and reader threads race."""

from __future__ import annotations

import asyncio
import threading

from stages.config import PipelineConfig
from stages.envelope import Envelope
from stages.messages import (
    Cancel,
    Kind,
    ResponseRelease,
    ResponseStop,
    SessionClose,
    SessionOpen,
    Transcript,
)
from stages.prepared import EarlyReply, HeldBack
from stages.reasoning import ReasoningStage, Response
from tests.stages.stage_events import Epochs, recording_ends

SESSION, EPOCH = 5, 7


class NotedTasks:
    """Stands in for stages.tasks.Tasks: notes each task's name and runs nothing."""

    def __init__(self) -> None:
        self.spawned: list[str] = []

    def spawn(self, coro, name: str) -> None:
        self.spawned.append(name)
        coro.close()


class Dispatching(ReasoningStage):
    """Only the dispatch of records: no rings (stage_events.recording_ends) and no engine;
    what it would send, stop and cancel is noted."""

    def __init__(self) -> None:
        config = PipelineConfig.model_validate({})
        super().__init__(config, recording_ends("reasoning", Epochs(EPOCH)), threading.Event())
        self.tasks = NotedTasks()
        self.spawned = self.tasks.spawned
        self.cancelled: list[Response | None] = []

    @property
    def sent(self) -> list[object]:
        return [msg for out in self.ends.outputs.values() for _, msg, _ in out.sent]

    def _cancel(self, session, state, response, msg, stamps, prefills=None):
        self.cancelled.append(response)
        return asyncio.sleep(0)

    def give(self, src: str, kind: Kind, msg, epoch: int = EPOCH) -> None:
        self._dispatch(Envelope(src, kind, SESSION, epoch, 0, 0, msg))


def test_a_turn_heard_before_its_sessions_open_is_kept() -> None:
    stage = Dispatching()
    stage.give("encoder", Kind.TRANSCRIPT, Transcript(1, "what time is it", final=False))
    state = stage.sessions[SESSION]
    stage.give("gateway", Kind.SESSION_OPEN, SessionOpen(instructions="Answer in one word."))
    assert stage.sessions[SESSION] is state
    assert state.conversation.prompt() == [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "what time is it"},
    ]


def test_the_next_holders_open_and_a_close_start_afresh() -> None:
    stage = Dispatching()
    stage.give("encoder", Kind.TRANSCRIPT, Transcript(1, "hello", final=False))
    stage.give("gateway", Kind.SESSION_CLOSE, SessionClose())
    assert SESSION not in stage.sessions

    stage.give("encoder", Kind.TRANSCRIPT, Transcript(1, "hello", final=False))
    stage.control.current = EPOCH + 2  # released and claimed again
    stage.give("gateway", Kind.SESSION_OPEN, SessionOpen(), epoch=EPOCH + 2)
    state = stage.sessions[SESSION]
    assert state.epoch == EPOCH + 2 and state.conversation.messages == []


def test_a_cancel_stops_the_reply_it_was_sent_for_not_one_begun_after() -> None:
    stage = Dispatching()
    state = stage._state(SESSION, EPOCH)
    old = state.response = Response("resp_old", "req-1", EPOCH)
    stage.give("gateway", Kind.CANCEL, Cancel(1, "resp_old"), epoch=EPOCH + 1)
    assert stage.cancelled == [old]

    # a new turn's reply, begun after the cancel, was handled before it
    state.response = Response("resp_new", "req-2", EPOCH + 1)
    stage.give("gateway", Kind.CANCEL, Cancel(2, "resp_old"), epoch=EPOCH + 1)
    assert stage.cancelled[-1] is None and state.response.response_id == "resp_new"


def test_a_cancel_drops_an_early_reply_begun_before_it_only() -> None:
    stage = Dispatching()
    state = stage._state(SESSION, EPOCH)
    early = Response("resp_5_2", "req-3", EPOCH + 1, held=HeldBack())
    state.response, state.early = early, EarlyReply(2, "is it", None, early)
    stage.give("gateway", Kind.CANCEL, Cancel(3, None), epoch=EPOCH + 1)
    assert state.early is not None and stage.sent == []

    stage.give("gateway", Kind.CANCEL, Cancel(4, None), epoch=EPOCH + 2)
    assert state.early is None and early.dropped
    assert stage.sent == [ResponseRelease("resp_5_2", keep=False)]


def test_a_final_transcript_from_before_a_cancel_is_kept_not_answered() -> None:
    """The caller spoke again while their last turn was being transcribed: the gateway's
    barge-in cancel came first, and the turn's final transcript outlives it."""
    stage = Dispatching()
    stage.give("encoder", Kind.TRANSCRIPT, Transcript(1, "what is the time", final=True))
    assert stage.spawned and stage.sessions[SESSION].response is not None  # answered
    stage.spawned.clear()

    stage.control.current = EPOCH + 1  # the barge-in's cancel
    stage.give("gateway", Kind.CANCEL, Cancel(1, None), epoch=EPOCH + 1)
    stage.give("encoder", Kind.TRANSCRIPT, Transcript(2, "and in Paris", final=True))
    state = stage.sessions[SESSION]
    assert state.conversation.messages[-1] == {"role": "user", "content": "and in Paris"}
    assert not [name for name in stage.spawned if name.startswith("respond-")]

    # a partial of that turn, or a speculative start, is of no use now
    stage.give("encoder", Kind.TRANSCRIPT, Transcript(2, "and in", final=False))
    stage.give("encoder", Kind.TRANSCRIPT, Transcript(2, "and", final=True, speculative=True))
    assert state.conversation.messages[-1] == {"role": "user", "content": "and in Paris"}
    assert state.early is None


def test_how_each_reply_made_at_the_pause_ended_is_counted() -> None:
    """A turn ended as it was at the pause (released), one the caller went on with
    (transcript differed), a pause made again, and a turn answered with none made."""
    stage = Dispatching()
    counted = stage._prepared.totals

    def paused(turn: int, text: str) -> None:
        stage.give("encoder", Kind.TRANSCRIPT, Transcript(turn, text, True, speculative=True))

    def ended(turn: int, text: str) -> None:
        stage.give("encoder", Kind.TRANSCRIPT, Transcript(turn, text, final=True))
        stage.sessions[SESSION].response = None  # the reply done: the next turn is free

    paused(1, "what time is it")
    ended(1, "what time is it")
    paused(2, "and in")
    paused(2, "and in Paris")
    ended(2, "and in Paris tomorrow")
    ended(3, "thanks")
    assert dict(counted) == {
        "released": 1,
        "made_again": 1,
        "transcript_differed": 1,
        "turn_answered_without_one": 1,
    }
    stage.sessions[SESSION].response = Response("resp_busy", "req-9", EPOCH)
    paused(4, "hold on")  # a reply still running: none is made
    assert counted["not_made_reply_running"] == 1


def test_a_reply_stopped_unheard_leaves_no_trace_in_the_history() -> None:
    """It started while the caller spoke again: the gateway stops it without a cancel."""
    stage = Dispatching()
    state = stage._state(SESSION, EPOCH)
    state.conversation.add("user", "what is the time")
    reply = state.response = Response("resp_5_1", "req-1", EPOCH)
    stage.give("gateway", Kind.RESPONSE_STOP, ResponseStop("resp_5_0"))  # not this one
    assert state.response is reply and not stage.spawned

    stage.give("gateway", Kind.RESPONSE_STOP, ResponseStop("resp_5_1"))
    assert state.response is None and reply.dropped and stage.spawned == ["stop-5"]
    reply.record(state.conversation, "It is noon.")  # what its task would do as it ends
    assert state.conversation.messages == [{"role": "user", "content": "what is the time"}]

    # one that had finished generating, and was recorded, is taken back out
    done = state.response = Response("resp_5_2", "req-2", EPOCH)
    done.finished = True
    done.record(state.conversation, "It is noon.")
    stage.give("gateway", Kind.RESPONSE_STOP, ResponseStop("resp_5_2"))
    assert state.conversation.messages == [{"role": "user", "content": "what is the time"}]


class OneWordEngine:
    """Stands in for stages.backends.llm_vllm.VllmEngine: every reply is one word."""

    async def generate_pieces(
        self, request_id: str, prompt, sampling=None, tools=None, template=None, usage=None
    ):
        yield "Noon.", [1], True

    def prompt_budget(self, max_output_tokens=None) -> int:
        return 1000

    def prompt_tokens(self, messages, tools=None, template=None) -> int:
        return sum(len(m["content"]) for m in messages)

    async def abort(self, request_id: str) -> None:
        return None


async def test_an_early_reply_released_before_its_task_ran_is_not_held_by_the_vocoder() -> None:
    """The turn ended as it was at the pause before the early reply's task first ran: what
    it makes goes out as it is made, and the vocoder is not told to hold it (a RESPONSE_RELEASE
    it got before the reply's start would never come again)."""
    from stages.messages import ResponseStarted, TextDelta
    from stages.tasks import Tasks

    stage = Dispatching()
    stage.tasks, stage.engine = Tasks(), OneWordEngine()
    stage.give("encoder", Kind.TRANSCRIPT, Transcript(1, "what time is it", True, speculative=True))
    stage.give("encoder", Kind.TRANSCRIPT, Transcript(1, "what time is it", final=True))
    done, running = await asyncio.wait(list(stage.tasks), timeout=5)
    assert done and not running
    sent = stage.sent
    started = [m for m in sent if isinstance(m, ResponseStarted)]
    assert started and not any(m.held for m in started), started
    assert ResponseRelease("resp_5_1", keep=True) in sent
    assert any(isinstance(m, TextDelta) and m.text == "Noon." for m in sent)


async def test_a_reply_whose_tools_cannot_be_rendered_fails_naming_the_setting() -> None:
    """A model whose chat template lists no tools and is no ChatML one: the reply with tools
    ends failed, its end naming the setting (no `error` of its own), and the session goes on."""
    from stages.messages import Error, ResponseDone, SessionSettings, Tool, Tools
    from stages.tasks import Tasks

    class PlainTemplate:
        chat_template = "[INST] {{ messages }} [/INST]"

    stage = Dispatching()
    stage.tasks, stage.engine = Tasks(), OneWordEngine()
    stage.engine.tokenizer = PlainTemplate()
    tools = Tools([Tool("get_time")], "required")
    stage.give("gateway", Kind.SESSION_SETTINGS, SessionSettings(tools=tools))
    stage.give("encoder", Kind.TRANSCRIPT, Transcript(1, "what time is it", final=True))
    done, running = await asyncio.wait(list(stage.tasks), timeout=5)
    assert done and not running
    [finished] = [m for m in stage.sent if isinstance(m, ResponseDone)][-1:]
    assert finished.status == "failed" and finished.error == "tool_template"
    assert "reasoning.tools.chat_template" in finished.error_message
    assert not [m for m in stage.sent if isinstance(m, Error)]


async def test_a_reply_that_may_call_but_talks_stops_at_the_words_cap() -> None:
    """A reply with tools gets the tools' larger token cap for a call's JSON; words stop at
    the reply's own cap (reasoning.sampling.max_tokens, 64 here), and the request is ended."""
    from stages.backends.tool_parsing import Words
    from stages.messages import ResponseDone, TextDelta
    from stages.tasks import Tasks

    class Rambling:
        closed = False

        async def generate_pieces(self, request_id, prompt, sampling, tools, template, usage):
            try:
                for i in range(500):
                    yield "word ", [i], False
            finally:
                Rambling.closed = True  # the request aborted, not left to run

    class Talks:  # ToolCalls as a reply that never calls
        calling = whole = False

        def feed(self, text, token_ids, finished):
            return [Words(text)]

        def finish(self):
            return [], []

    stage = Dispatching()
    stage.tasks, stage.engine = Tasks(), Rambling()
    prompt = [{"role": "user", "content": "talk"}]
    stage._prepare = lambda session, state, options: (Talks(), prompt, None, None, None)
    stage.give("encoder", Kind.TRANSCRIPT, Transcript(1, "talk to me", final=True))
    done, running = await asyncio.wait(list(stage.tasks), timeout=5)
    assert done and not running
    deltas = [m for m in stage.sent if isinstance(m, TextDelta)]
    assert len({d.index for d in deltas}) == 64 and Rambling.closed
    [finished] = [m for m in stage.sent if isinstance(m, ResponseDone)][-1:]
    assert finished.status == "completed" and finished.text == "word " * 64
