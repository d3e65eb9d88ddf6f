"""Waiting on the stages' events at the gateway's end of the rings, for the pipeline tests;
and stand-ins for a stage's ring ends (the control segment, its outboxes), for tests of one
stage's loop without rings."""

from __future__ import annotations

import time
from typing import Any

from stages.envelope import Envelope
from stages.link import EventQueues
from stages.messages import Kind, Msg
from stages.rings import Ends, RingNames


def wait_for(events: EventQueues, session: int, kind: Kind, timeout: float = 30) -> Envelope:
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
        seen.append(f"{ev.src}:{ev.kind.name}")


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


class RecordingOutbox:
    """Stands in for a stages.rings.RingWriter: notes (session, record, epoch) in order, a record
    being a message or the bytes of a raw push (audio)."""

    def __init__(self, dst: str) -> None:
        self.dst = dst
        self.sent: list[tuple[int, Msg | bytes, int | None]] = []

    def send(
        self, session: int, msg: Msg, *, epoch: int | None = None, timeout: float | None = 5.0
    ) -> bool:
        self.sent.append((session, msg, epoch))
        return True

    def push(
        self,
        session: int,
        kind: Kind,
        payload: Any,
        *,
        epoch: int | None = None,
        timeout: float | None = 5.0,
        keep: bool = False,
    ) -> bool:
        self.sent.append((session, bytes(payload), epoch))
        return True


def recording_ends(instance: str, control: Epochs) -> Ends:
    """A stage's ends with no rings: no inputs, a RecordingOutbox to each destination."""
    names = RingNames.fresh()
    outputs = {dst: RecordingOutbox(dst) for src, dst in names.links if src == instance}
    return Ends(instance, names, control, {}, outputs)  # type: ignore[arg-type]
