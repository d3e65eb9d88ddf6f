"""Which records a cancel purges, through the real C ring: a turn's final transcript is kept."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shm import Control, Ring, segment_name
from stages.messages import TextDelta, Transcript, decode
from stages.rings import RingWriter


@pytest.fixture
def outbox() -> Iterator[tuple[RingWriter, Ring, Control]]:
    with (
        Control.create(segment_name("test-ctl"), 64) as control,
        Ring.create(segment_name("test-ring"), 1 << 16, control=control) as ring,
    ):
        yield RingWriter(ring, "encoder", "reasoning"), ring, control


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


def test_a_pipeline_placed_across_hosts_names_each_hosts_segments_apart() -> None:
    from stages.rings import LOCAL, RingNames

    one = RingNames("pipe-x", (("vocoder", 2),))
    assert one.control == "/pipe-x-control" and one.ring("gateway", "encoder") == (
        "/pipe-x-gateway-encoder"
    )  # a pipeline on one host is named as it always was
    assert one.links_here == one.links and one.stages_here == one.stages

    here = one.placed({"encoder": "b", "vocoder.1": "c"}, LOCAL)
    assert here.host_of("encoder") == "b" and here.host_of("vocoder.1") == "c"
    assert here.host_of("vocoder") == LOCAL and here.host_of("gateway") == LOCAL
    assert here.stages_here == ("reasoning", "vocoder")
    assert here.crossing("gateway", "encoder") and not here.crossing("reasoning", "vocoder")
    b = here.on("b")
    assert b.stages_here == ("encoder",)
    assert set(b.links_here) == {
        ("gateway", "encoder"), ("encoder", "reasoning"), ("encoder", "gateway"),
    }  # fmt: skip
    # each host has its own segment for a crossing link, and its own control
    assert here.ring("gateway", "encoder") != b.ring("gateway", "encoder")
    assert here.control == "/pipe-x-local-control" and b.control == "/pipe-x-b-control"
    assert ("gateway", "encoder") in here.links_here
    assert ("encoder", "reasoning") in here.links_here
    assert not {link for link in here.links_here if "vocoder.1" in link} & set(b.links_here)
    by_role = one.placed({"vocoder": "c"}, "c")
    assert by_role.stages_here == ("vocoder", "vocoder.1")
