"""The reasoning stage's session state against the order its records arrive in, with no engine
and no rings: a session's turns come on the encoder's ring, its open and close on the
gateway's, and reader threads race."""

from __future__ import annotations

import threading

from stages.config import PipelineConfig
from stages.messages import Kind, SessionClose, SessionOpen, Transcript
from stages.reasoning import ReasoningStage
from stages.worker import Inbound
from tests.stages.stage_events import Epochs

SESSION, EPOCH = 5, 7


class Dispatching(ReasoningStage):
    """Only the dispatch of records: no rings and no engine (Stage.__init__ attaches rings)."""

    def __init__(self) -> None:
        self.config = PipelineConfig.model_validate({})
        self.stop = threading.Event()
        self.control = Epochs(EPOCH)
        self.sessions = {}
        self._tasks = set()

    def give(self, src: str, kind: Kind, msg, epoch: int = EPOCH) -> None:
        self._dispatch(Inbound(src, kind, SESSION, epoch, 0, msg))


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
