"""Which records a cancel purges, through the real C ring: a turn's final transcript is kept."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shm import Control, Ring, segment_name
from stages.messages import TextDelta, Transcript, decode
from stages.rings import Outbox


@pytest.fixture
def outbox() -> Iterator[tuple[Outbox, Ring, Control]]:
    with (
        Control.create(segment_name("test-ctl"), 64) as control,
        Ring.create(segment_name("test-ring"), 1 << 16, control=control) as ring,
    ):
        yield Outbox(ring, "encoder", "reasoning"), ring, control


def test_a_cancel_keeps_a_turns_final_transcript_and_purges_the_rest(outbox) -> None:
    out, ring, control = outbox
    said = Transcript(2, "and tomorrow", final=True)
    for msg in (
        Transcript(2, "and to", final=False),  # a partial: superseded by the final anyway
        Transcript(2, "and", final=True, speculative=True),  # an early start's: dropped
        said,
        TextDelta("resp_4_1", "Sure", 0),
    ):
        assert out.send(4, msg)
    control.cancel(4)  # the caller spoke again while the turn was being transcribed

    kept = [decode(r.kind, r.payload) for r in iter(lambda: ring.pop(0), None)]
    assert kept == [said]


def test_a_reply_stop_goes_through_the_ring_as_it_was_sent(outbox) -> None:
    from stages.messages import Kind, ResponseStop

    out, ring, _ = outbox
    assert out.send(4, ResponseStop("resp_4_2"))
    (record,) = iter(lambda: ring.pop(0), None)
    assert record.kind == Kind.RESPONSE_STOP
    assert decode(record.kind, record.payload) == ResponseStop("resp_4_2")
