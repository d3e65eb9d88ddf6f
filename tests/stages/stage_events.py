"""Waiting on the stages' events at the gateway's end of the rings, for the pipeline tests;
and a stand-in for the control segment, for tests of one stage's loop without rings."""

from __future__ import annotations

import time

from stages.link import EventQueues, StageEvent
from stages.messages import Kind


def wait_for(events: EventQueues, session: int, kind: Kind, timeout: float = 30) -> StageEvent:
    """The session's next event of `kind`; an ERROR on the way fails the test, and a timeout
    names the events that did come."""
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while True:
        try:
            ev = events.next(session, max(0.01, deadline - time.monotonic()))
        except TimeoutError as exc:
            raise TimeoutError(f"{exc} waiting for {kind.name}; came before: {seen}") from None
        if ev.kind is kind:
            return ev
        assert ev.kind is not Kind.ERROR, ev.msg
        seen.append(f"{ev.stage}:{ev.kind.name}")


def cancel_acks(events: EventQueues, session: int, cancel_id: str, roles: int = 3) -> set[str]:
    """The stages that acknowledged the session's cancel `cancel_id`, once all `roles` have."""
    acks: set[str] = set()
    while len(acks) < roles:
        ev = wait_for(events, session, Kind.CANCEL_ACK)
        if ev.msg.cancel_id == cancel_id:
            acks.add(ev.msg.stage)
    return acks


class Epochs:
    """Every session's epoch, as `shm.Control.epoch` reads it; set `current` to move it."""

    def __init__(self, current: int) -> None:
        self.current = current

    def epoch(self, session: int) -> int:
        return self.current
