"""The model loop of a queued stage (stages.worker.QueuedStage), with the stage's rings left
out: records waiting in its inbox and the pumps between them."""

from __future__ import annotations

import itertools
import queue
import threading

from stages.messages import Kind
from stages.worker import Inbound, QueuedStage


class Recorder(QueuedStage):
    """Handles records by noting them; each pump notes how many it saw handled."""

    def __init__(self, pumps: int) -> None:  # no rings: Stage.__init__ attaches them
        self.stop = threading.Event()
        self.inbox = queue.PriorityQueue()
        self._order = itertools.count()
        self.handled: list[tuple[Kind, int]] = []
        self.seen_at_pump: list[int] = []
        self.pumps_left = pumps

    def is_stale(self, item) -> bool:
        return False

    def handle(self, item) -> None:
        self.handled.append((item.kind, item.session))

    def pump(self) -> float | None:
        self.seen_at_pump.append(len(self.handled))
        self.pumps_left -= 1
        if self.pumps_left == 0:
            self.stop.set()
        return 0.0


def inbound(kind: Kind, session: int) -> Inbound:
    return Inbound(src="reasoning", kind=kind, session=session, epoch=0, t_ns=0, msg=None)


def test_every_waiting_record_is_handled_before_the_next_pump() -> None:
    stage = Recorder(pumps=2)
    for session in range(500):  # a reply's text comes a token at a time, from every session
        stage.deliver(inbound(Kind.TEXT_DELTA, session))
    stage.deliver(inbound(Kind.CANCEL, 7))
    stage.run()
    assert stage.seen_at_pump[0] == 501
    assert stage.handled[0] == (Kind.CANCEL, 7)  # urgent records still go first
    assert [s for _, s in stage.handled[1:]] == list(range(500))  # the rest in order
