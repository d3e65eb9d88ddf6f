"""Stages placed by Ray on another node: a real multi-node cluster on this machine (a head and
two raylets, each a process tree of its own on its own loopback address), the encoder and the
vocoder in group "b", which asks for the `vocoder` resource both raylets advertise; reasoning
and the gateway's end in this process. Every record between the hosts crosses TCP through
stages.bridge. A full turn, a barge-in acknowledged by every stage, and the node carrying "b"
lost at once: its call fails, Ray places "b" on the other node and the next call is answered."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest
import ray

from gateway.app import gateway_of
from gateway.client import RealtimeCall
from shm import list_segments
from stages.cluster import ClusterSupervisor
from stages.config import ClusterConfig
from stages.driver import TurnResult, speak_turn
from stages.link import EventQueues, PipelineLink
from stages.loopback_cluster import LoopbackCluster
from stages.messages import STAGE_RESTARTED, Kind
from stages.supervisor import StageStartError
from tests.gateway.test_call_e2e import speech48k, voiced_frames
from tests.serving import serving_gateway
from tests.stages.conftest import tiny_with_long_replies
from tests.stages.stage_events import cancel_acks, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SENTENCE = "what is the weather like today in paris"
NODES = ("127.0.0.2", "127.0.0.3")
DEAD_AFTER_MS = 1000


@pytest.fixture(scope="module")
def cluster() -> Iterator[LoopbackCluster]:
    with LoopbackCluster() as cluster:
        for address in NODES:
            cluster.add_node(address, {"vocoder": 1})
        yield cluster


@pytest.fixture(scope="module")
def supervisor(cluster: LoopbackCluster) -> Iterator[ClusterSupervisor]:
    placement = ClusterConfig(
        address=cluster.address,
        groups={"b": {"stages": ["encoder", "vocoder"], "resources": {"vocoder": 1}}},
        # a link heard from 5 heartbeats late is not dead: the suite's other work can starve
        # a stage host of both cores for half a second
        dead_after_ms=DEAD_AFTER_MS,
    )
    supervisor = ClusterSupervisor(tiny_with_long_replies(), placement)
    prefix = supervisor.names.prefix
    with supervisor:
        supervisor.start()
        yield supervisor
    left = [s for s in list_segments() if prefix in s]
    assert not left, f"segments left behind: {left}"


@pytest.fixture(scope="module")
def events() -> EventQueues:
    return EventQueues()


@pytest.fixture
def link(supervisor: ClusterSupervisor, events: EventQueues) -> Iterator[PipelineLink]:
    """The gateway's end of the rings, for one test (a served gateway reads them otherwise)."""
    link = PipelineLink(supervisor.names, events)
    yield link
    link.close()


def answered_turn(link: PipelineLink, events: EventQueues, make_speech) -> TurnResult:
    """A spoken turn in a session of its own, heard and answered in the vocoder's voice."""
    session = link.open_session()
    try:
        result = speak_turn(link, events, session, make_speech(SENTENCE).pcm16)
    finally:
        link.close_session(session)
    assert result.transcript and result.audio
    return result


def test_ray_places_the_group_on_a_node_that_has_its_resource(
    supervisor: ClusterSupervisor,
) -> None:
    host = supervisor.hosts["b"]
    assert host.address in NODES  # not the head, which advertises no `vocoder`
    assert set(supervisor.stages) == {"reasoning"}
    assert set(host.info) == {"encoder", "vocoder"}
    assert supervisor.stage_info("vocoder")["sample_rate"] > 0
    assert supervisor.healthy


def test_a_group_no_node_can_take_is_refused_naming_what_is_missing(
    cluster: LoopbackCluster, supervisor: ClusterSupervisor
) -> None:
    placement = ClusterConfig(
        address=cluster.address,
        groups={"g": {"stages": ["vocoder"], "resources": {"vocoder_xl": 1}}},
    )
    with pytest.raises(StageStartError, match=r"cluster group g.*advertises vocoder_xl"):
        ClusterSupervisor(tiny_with_long_replies(), placement).start()


def test_a_turn_crosses_to_the_stage_host_and_back(
    supervisor: ClusterSupervisor, link: PipelineLink, events: EventQueues, make_speech
) -> None:
    result = answered_turn(link, events, make_speech)
    assert {e.src for e in result.events} >= {"encoder", "reasoning", "vocoder"}
    links = supervisor.links
    assert links is not None
    assert links.outbound[("gateway", "encoder")].sent >= 5
    assert links.inbound[("encoder", "reasoning")].received >= 1
    assert links.inbound[("vocoder", "gateway")].received >= 1


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
        result = speak_turn(link, events, session, make_speech(SENTENCE).pcm16, turn_id=2)
        assert result.transcript and result.audio
        assert all(e.epoch > old_epoch for e in result.events)
    finally:
        link.close_session(session)


def test_a_stage_dying_on_the_stage_host_fails_its_calls_and_is_restarted_there(
    supervisor: ClusterSupervisor, link: PipelineLink, events: EventQueues, make_speech
) -> None:
    """The stage host's mirror holds no sessions: the ones its link from the gateway saw
    opened are failed, the error crossing back to the gateway."""
    host = supervisor.hosts["b"]
    pid = ray.get(host.actor.ready.remote())["pids"]["vocoder"]
    session = link.open_session()
    try:
        link.create_response(session, "resp_long", text="tell me a long story")
        wait_for(events, session, Kind.AUDIO_OUT)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        ev = events.next(session, 5)
        while ev.kind is not Kind.ERROR:
            ev = events.next(session, 5)
        waited = time.monotonic() - t0
        assert ev.msg.stage == "vocoder" and ev.msg.code == STAGE_RESTARTED
        assert waited < 1.5, f"the call heard of it after {waited:.2f} s"
    finally:
        link.close_session(session)
    deadline = time.monotonic() + 60
    while not (
        (ready := ray.get(host.actor.ready.remote()))["healthy"] and ready["pids"]["vocoder"] != pid
    ):
        assert time.monotonic() < deadline, "the vocoder was not restarted on its host"
        time.sleep(0.1)
    answered_turn(link, events, make_speech)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_webrtc_call_is_answered_and_barged_in_on_across_the_hop(
    supervisor: ClusterSupervisor, make_speech
) -> None:
    """A caller over WebRTC (aiortc, real Opus) to the gateway served on this host: heard by
    the encoder and answered in the vocoder's voice from the other node, then talked over."""
    async with serving_gateway(supervisor.config, supervisor) as (base, app):
        cancels = gateway_of(app).metrics.cancel_latency
        call = await RealtimeCall.connect(base)
        try:
            await call.next_event("session.created")
            call.microphone.play(speech48k(make_speech(SENTENCE)))
            heard = await call.next_event(
                "conversation.item.input_audio_transcription.completed", timeout=60
            )
            assert heard["transcript"]
            await call.next_event("output_audio_buffer.started", timeout=60)
            started = call.speaker.arrivals[-1]
            call.microphone.play(speech48k(make_speech("stop please I have another question")))
            await call.next_event("output_audio_buffer.cleared", timeout=10)
            # every stage, two of them across the hop, acknowledged the barge-in's cancel
            deadline = time.monotonic() + 10
            while (acked := _acked(cancels)) != {"encoder", "reasoning", "vocoder"}:
                assert time.monotonic() < deadline, f"acknowledged by {acked} only"
                await asyncio.sleep(0.05)  # polling the gateway's metrics
        finally:
            await call.close()
    assert voiced_frames(call, since=started), "no agent voice reached the caller"


def _acked(histogram) -> set[str]:
    """The stages with a cancel acknowledged in `histogram` (the gateway's cancel latency)."""
    return {
        sample.labels["stage"]
        for metric in histogram.collect()
        for sample in metric.samples
        if sample.name.endswith("_count") and sample.value > 0
    }


def test_a_lost_node_fails_its_call_and_ray_places_the_group_on_the_other(
    cluster: LoopbackCluster,
    supervisor: ClusterSupervisor,
    link: PipelineLink,
    events: EventQueues,
    make_speech,
) -> None:
    host = supervisor.hosts["b"]
    lost_address = host.address
    session = link.open_session()
    try:
        link.create_response(session, "resp_long", text="tell me a long story")
        wait_for(events, session, Kind.AUDIO_OUT)
        killed = cluster.kill_node(lost_address)  # raylet, actor, stage processes: at once
        t0 = time.monotonic()
        assert len(killed) >= 4
        lost = set()
        while lost != {"encoder", "vocoder"}:
            ev = events.next(session, 5)
            if ev.kind is Kind.ERROR:
                assert ev.msg.code == STAGE_RESTARTED and "host (b)" in ev.msg.message
                lost.add(ev.msg.stage)
        waited = time.monotonic() - t0
        assert waited < DEAD_AFTER_MS / 1000 + 1.0, f"the call heard of it after {waited:.2f} s"
        print(f"\nthe call heard its stages' host was lost after {waited * 1e3:.0f} ms")
    finally:
        link.close_session(session)
    # Ray restarts the actor on the other node; the supervisor brings it up and reconnects
    deadline = time.monotonic() + 120
    while not (host.restarts == 1 and supervisor.healthy):
        assert time.monotonic() < deadline, "group b did not come back on the other node"
        time.sleep(0.1)
    back = time.monotonic() - t0
    print(f"group b back on {host.address} {back:.1f} s after its node was lost")
    assert host.address != lost_address and host.address in NODES
    answered_turn(link, events, make_speech)
