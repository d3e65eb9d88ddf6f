"""Property tests: the ring against a pure-Python model of its layout, wrap and purge rules."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shm import HEADER_SIZE, Control, Ring, segment_name

CAPACITY = 512
SESSIONS = 3


def align8(n: int) -> int:
    return (n + 7) & ~7


@dataclass
class Queued:
    seq: int
    session: int
    epoch: int
    payload: bytes
    end: int  # stream position just past the record


class RingModel(RuleBasedStateMachine):
    """Pushes, pops and cancels in any order; the C ring must agree with the model on what
    fits, what comes out, and how many bytes are in use."""

    @initialize()
    def setup(self) -> None:
        self.control = Control.create(segment_name("test-prop-ctl"), SESSIONS)
        self.ring = Ring.create(segment_name("test-prop"), CAPACITY, control=self.control)
        self.head = self.tail = 0
        self.seq = 0
        self.queue: list[Queued] = []
        self.epochs = [0] * SESSIONS
        self.skipped = 0

    @rule(
        size=st.integers(0, CAPACITY // 2 - HEADER_SIZE),
        session=st.integers(0, SESSIONS - 1),
        fill=st.binary(min_size=1, max_size=1),
    )
    def push(self, size: int, session: int, fill: bytes) -> None:
        payload = fill * size
        total = align8(HEADER_SIZE + size)
        contiguous = CAPACITY - self.head % CAPACITY
        gap = contiguous if contiguous < total else 0
        fits = gap + total <= CAPACITY - (self.head - self.tail)
        assert self.ring.push(payload, session=session, kind=1) is fits
        if fits:
            self.head += gap + total
            self.queue.append(Queued(self.seq, session, self.epochs[session], payload, self.head))
            self.seq += 1

    @rule()
    def pop(self) -> None:
        expected = None
        while self.queue:
            q = self.queue.pop(0)
            self.tail = q.end
            if q.epoch < self.epochs[q.session]:
                self.skipped += 1
                continue
            expected = q
            break
        rec = self.ring.pop(timeout=0)
        if expected is None:
            assert rec is None
        else:
            assert rec is not None
            assert (rec.seq, rec.session, rec.epoch, rec.payload) == (
                expected.seq,
                expected.session,
                expected.epoch,
                expected.payload,
            )

    @rule(session=st.integers(0, SESSIONS - 1))
    def cancel(self, session: int) -> None:
        self.epochs[session] += 1
        assert self.control.cancel(session) == self.epochs[session]

    @precondition(lambda self: hasattr(self, "ring"))
    @invariant()
    def stats_agree(self) -> None:
        stats = self.ring.stats()
        assert stats["bytes_used"] == self.head - self.tail <= CAPACITY
        assert stats["pushed"] == self.seq
        assert stats["skipped"] == self.skipped

    def teardown(self) -> None:
        if hasattr(self, "ring"):
            self.ring.close()
            self.control.close()


TestRingModel = RingModel.TestCase
TestRingModel.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
