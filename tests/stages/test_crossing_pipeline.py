"""A pipeline across two hosts: the encoder and the vocoder on host "b" (a process tree of its
own, its links received on 127.0.0.2), reasoning and the gateway's end on the gateway's host.
Every record between the two crosses TCP through stages.bridge; each process still talks to a
ring. A full turn, a barge-in acknowledged by every stage, and host b lost all at once."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from shm import list_segments
from stages.driver import speak_turn
from stages.host import TwoHosts, two_hosts
from stages.link import EventQueues, PipelineLink
from stages.messages import STAGE_RESTARTED, Kind
from tests.stages.conftest import tiny_with_long_replies
from tests.stages.stage_events import cancel_acks, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SENTENCE = "what is the weather like today in paris"
FAR = "b"


@pytest.fixture(scope="module")
def config():
    return tiny_with_long_replies()


@pytest.fixture(scope="module")
def hosts(config) -> Iterator[TwoHosts]:
    with two_hosts(config, {"encoder": FAR, "vocoder": FAR}) as hosts:
        names = hosts.here.names
        assert set(hosts.here.stages) == {"reasoning"}
        yield hosts
    left = [s for s in list_segments() if names.prefix in s]
    assert not left, f"segments left behind: {left}"


@pytest.fixture(scope="module")
def events() -> EventQueues:
    return EventQueues()


@pytest.fixture(scope="module")
def link(hosts: TwoHosts, events: EventQueues) -> Iterator[PipelineLink]:
    link = PipelineLink(hosts.here.names, events)
    yield link
    link.close()


def test_a_turn_crosses_to_the_far_host_and_back(
    hosts: TwoHosts, link: PipelineLink, events: EventQueues, make_speech
) -> None:
    session = link.open_session()
    try:
        result = speak_turn(link, events, session, make_speech(SENTENCE).pcm16)
    finally:
        link.close_session(session)
    assert result.transcript and result.audio
    assert {e.src for e in result.events} >= {"encoder", "reasoning", "vocoder"}
    links = hosts.here.links
    assert links is not None
    # the caller's audio went out to the encoder, the transcript and the voice came back
    assert links.outbound[("gateway", "encoder")].sent >= 5
    assert links.inbound[("encoder", "reasoning")].received >= 1
    assert links.inbound[("vocoder", "gateway")].received >= 1
    print(f"\nacross the hop: hops {result.hops_ms()}")


def test_a_barge_in_is_acknowledged_by_every_stage_across_the_hop(
    link: PipelineLink, events: EventQueues, make_speech
) -> None:
    session = link.open_session()
    try:
        link.create_response(session, "resp_long", text="tell me a long story")
        wait_for(events, session, Kind.AUDIO_OUT)
        old_epoch = link.control.epoch(session)
        t0 = time.monotonic()
        cancel_id, _ = link.cancel(session, "resp_long", spoken_text="Once upon")
        assert cancel_acks(events, session, cancel_id) == {"encoder", "reasoning", "vocoder"}
        print(f"\ncancel to the last ack across the hop: {(time.monotonic() - t0) * 1e3:.2f} ms")
        # the next turn is answered, and nothing of the old epoch arrives again
        result = speak_turn(link, events, session, make_speech(SENTENCE).pcm16, turn_id=2)
        assert result.transcript and result.audio
        assert all(e.epoch > old_epoch for e in result.events)
    finally:
        link.close_session(session)


def test_a_far_host_lost_fails_its_calls_and_the_gateway_host_goes_on(
    hosts: TwoHosts, link: PipelineLink, events: EventQueues
) -> None:
    session = link.open_session()
    try:
        link.create_response(session, "resp_long", text="tell me a long story")
        wait_for(events, session, Kind.AUDIO_OUT)
        killed = hosts.lose_far_host()  # supervisor, stages, bridges: all at once
        t0 = time.monotonic()
        assert len(killed) >= 3
        lost = set()
        while lost != {"encoder", "vocoder"}:
            ev = events.next(session, 5)
            if ev.kind is Kind.ERROR:
                assert ev.msg.code == STAGE_RESTARTED and f"host ({FAR})" in ev.msg.message
                lost.add(ev.msg.stage)
        waited = time.monotonic() - t0
        assert waited < 1.5, f"the calls heard of it after {waited:.2f} s"
        print(f"\nthe call heard its stages' host was lost after {waited * 1e3:.0f} ms")
    finally:
        link.close_session(session)
    # the gateway's host goes on: reasoning still answers a new call (in text: no voice now)
    other = link.open_session()
    try:
        link.create_response(other, "resp_text", text="say something")
        assert wait_for(events, other, Kind.TEXT_DELTA).src == "reasoning"
    finally:
        link.close_session(other)
