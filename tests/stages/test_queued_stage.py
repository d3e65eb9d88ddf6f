"""The model loop of a queued stage (stages.stage.QueuedStage), with the stage's rings left
out: records waiting in its inbox and the pumps between them; and which state a session's
open, close or cancel ends (stages.stops)."""

from __future__ import annotations

import threading

import pytest

from stages.config import PipelineConfig
from stages.envelope import Envelope
from stages.messages import Cancel, Kind, SessionClose, SessionOpen
from stages.stage import QueuedStage
from stages.stops import stop_of
from tests.stages.stage_events import Epochs, recording_ends


class Recorder(QueuedStage):
    """Handles records by noting them; each pump notes how many it saw handled."""

    def __init__(self, pumps: int) -> None:
        config = PipelineConfig.model_validate({})
        super().__init__(config, recording_ends("encoder", Epochs(0)), threading.Event())
        self.handled: list[tuple[Kind, int]] = []
        self.seen_at_pump: list[int] = []
        self.pumps_left = pumps

    def handle(self, item) -> None:
        self.handled.append((item.kind, item.session))

    def on_stop(self, session, stop) -> None:
        self.handled.append((Kind.CANCEL if stop.cancel else Kind.SESSION_CLOSE, session))

    def pump(self) -> float | None:
        self.seen_at_pump.append(len(self.handled))
        self.pumps_left -= 1
        if self.pumps_left == 0:
            self.stop.set()
        return 0.0


def inbound(kind: Kind, session: int) -> Envelope:
    msg = Cancel(1) if kind is Kind.CANCEL else None
    return Envelope("reasoning", kind, session, epoch=0, seq=0, t_ns=0, msg=msg)


def test_every_waiting_record_is_handled_before_the_next_pump() -> None:
    stage = Recorder(pumps=2)
    for session in range(500):  # a reply's text comes a token at a time, from every session
        stage.deliver(inbound(Kind.TEXT_DELTA, session))
    stage.deliver(inbound(Kind.CANCEL, 7))
    stage.run()
    assert stage.seen_at_pump[0] == 501
    assert stage.handled[0] == (Kind.CANCEL, 7)  # urgent records still go first
    assert [s for _, s in stage.handled[1:]] == list(range(500))  # the rest in order


WRAP = 1 << 32


@pytest.mark.parametrize(
    "kind, record_epoch, state_epoch, ends",
    [
        (Kind.SESSION_OPEN, 7, 5, True),  # an earlier holder's state
        (Kind.SESSION_OPEN, 7, 7, False),  # the new holder's, handled before its open
        (Kind.CANCEL, 7, 6, True),  # the reply the cancel was sent for
        (Kind.CANCEL, 7, 7, False),  # the reply asked for right after the cancel
        (Kind.CANCEL, 7, 8, False),  # one after a later cancel
        (Kind.SESSION_CLOSE, 7, 7, True),
        (Kind.SESSION_CLOSE, 7, 6, True),
        (Kind.SESSION_CLOSE, 7, 9, False),  # the next holder's
        (Kind.CANCEL, 1, WRAP - 1, True),  # the epoch wrapped between them
        (Kind.CANCEL, WRAP - 1, 1, False),
    ],
)
def test_what_an_open_close_or_cancel_ends(kind, record_epoch, state_epoch, ends) -> None:
    msg = {Kind.SESSION_OPEN: SessionOpen(), Kind.SESSION_CLOSE: SessionClose()}.get(kind)
    item = Envelope("gateway", kind, 0, record_epoch, 0, 0, msg or Cancel(1))
    stop = stop_of(item)
    assert stop is not None and stop.ends(state_epoch) is ends
