"""Waiting on the stages' events at the gateway's end of the rings, for the pipeline tests."""

from __future__ import annotations

import time

from stages.link import EventQueues, StageEvent
from stages.messages import Kind


def wait_for(events: EventQueues, session: int, kind: Kind, timeout: float = 30) -> StageEvent:
    """The session's next event of `kind`; an ERROR on the way fails the test."""
    deadline = time.monotonic() + timeout
    while True:
        ev = events.next(session, max(0.01, deadline - time.monotonic()))
        if ev.kind is kind:
            return ev
        assert ev.kind is not Kind.ERROR, ev.msg
