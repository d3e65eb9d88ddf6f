"""A stage role run as several processes: reasoning and the vocoder with two replicas each,
real processes (two vLLM engines) and rings, each session served by one replica of each and
isolated from the other's failure."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from gateway.config import load_config
from stages.link import EventQueues, PipelineLink
from stages.messages import Kind
from stages.rings import RingNames, RingSet, attach_ends, role_of
from stages.supervisor import Supervisor
from tests.stages.stage_events import cancel_acks, wait_for

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"


def test_ring_names_expand_the_replicas() -> None:
    names = RingNames.fresh({"vocoder": 3})
    assert names.stages == ("encoder", "reasoning", "vocoder", "vocoder.1", "vocoder.2")
    assert [names.instance_for("vocoder", s) for s in range(5)] == [
        "vocoder",
        "vocoder.1",
        "vocoder.2",
        "vocoder",
        "vocoder.1",
    ]
    assert names.instance_for("reasoning", 7) == "reasoning"
    links = set(names.links)
    for replica in names.instances("vocoder"):
        assert {("reasoning", replica), ("gateway", replica), (replica, "gateway")} <= links
    assert not any(role_of(a) == role_of(b) for a, b in links)  # replicas never talk
    assert len(links) == 8 + 2 * 3  # the 8 links of one of each, plus 3 per extra vocoder
    assert RingNames.fresh({"vocoder": 1}).replicas == ()  # one is no replica at all
    with pytest.raises(ValueError, match="replicas of 'supervisor'"):
        RingNames.fresh({"supervisor": 2})


@pytest.mark.parametrize("wake_yield", [False, True])
def test_the_config_says_whether_every_producer_yields_to_the_consumer_it_wakes(
    wake_yield: bool,
) -> None:
    config = load_config(TINY, {"experiments.wake_yield": wake_yield})
    names = RingNames.fresh(wake_yield=config.experiments.wake_yield)
    rings = RingSet(names, config)
    try:
        ends = attach_ends(names, "reasoning")
        assert set(ends.outputs) == {"gateway", "vocoder"} and ends.inputs
        assert all(o.ring.wake_yield is wake_yield for o in ends.outputs.values())
        assert not any(ring.wake_yield for ring in ends.inputs.values())  # a consumer's end
        ends.close()
    finally:
        rings.close()


def test_every_replicated_role_takes_its_share_of_the_sessions() -> None:
    config = load_config(TINY, {"reasoning.replicas": 2, "vocoder.replicas": 3})
    names = RingNames.of(config, gateways=2)
    assert names.stages == (
        "encoder",
        "reasoning",
        "reasoning.1",
        "vocoder",
        "vocoder.1",
        "vocoder.2",
    )
    # each gateway's sessions spread over both reasoning engines
    for first in (0, 1):
        owners = [names.instance_for("reasoning", s) for s in range(first, 8, 2)]
        assert owners == ["reasoning", "reasoning.1"] * 2
    links = set(names.links)
    for engine in ("reasoning", "reasoning.1"):
        assert {("encoder", engine), ("gateway.1", engine), (engine, "vocoder.2")} <= links


def test_gateway_processes_own_strides_that_replicas_split() -> None:
    names = RingNames.fresh({"gateway": 2, "vocoder": 2})
    assert names.gateways == ("gateway", "gateway.1")
    assert names.gateway_stride("gateway.1") == (1, 2)
    owners = [names.instance_for("gateway", s) for s in range(8)]
    assert owners == ["gateway", "gateway.1"] * 4
    # each gateway's sessions (0, 2, 4, 6 and 1, 3, 5, 7) spread over both vocoders
    for first in (0, 1):
        assert [names.instance_for("vocoder", s) for s in range(first, 8, 2)] == [
            "vocoder",
            "vocoder.1",
        ] * 2
    links = set(names.links)
    for gw in names.gateways:
        assert {(gw, "encoder"), ("reasoning", gw), ("vocoder.1", gw)} <= links
    assert names.stages == ("encoder", "reasoning", "vocoder", "vocoder.1")  # no gateway


@pytest.fixture(scope="module")
def config():
    return load_config(
        TINY,
        {
            "vocoder.replicas": 2,
            "reasoning.replicas": 2,
            "reasoning.sampling": {"max_tokens": 96, "ignore_eos": True},
            "vocoder.max_lead_ms": 600_000,
        },
    )


def two_sessions_on_different_replicas(link: PipelineLink) -> tuple[int, int]:
    a, b = link.open_session(), link.open_session()
    for role in ("reasoning", "vocoder"):
        assert {link.names.instance_for(role, s) for s in (a, b)} == {role, f"{role}.1"}
    return a, b


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_each_session_is_spoken_by_its_replica_and_cancelled_there(
    supervisor: Supervisor, link: PipelineLink, events: EventQueues
) -> None:
    assert set(supervisor.stages) == {"encoder", "reasoning", "reasoning.1", "vocoder", "vocoder.1"}
    a, b = two_sessions_on_different_replicas(link)
    try:
        for s in (a, b):
            link.create_response(s, f"resp-{s}", text="say something")
        for s in (a, b):
            started = wait_for(events, s, Kind.RESPONSE_STARTED)
            assert started.src == link.names.instance_for("reasoning", s)
            audio = wait_for(events, s, Kind.AUDIO_OUT)
            assert audio.src == link.names.instance_for("vocoder", s)
        for s in (a, b):
            cancel_id, _ = link.cancel(s, f"resp-{s}")
            acks = cancel_acks(events, s, cancel_id)
            # the replica acks as "vocoder": the gateway waits for one ack per role
            assert acks == {"encoder", "reasoning", "vocoder"}
    finally:
        link.close_session(a)
        link.close_session(b)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_dead_replica_fails_only_its_own_sessions(
    supervisor: Supervisor, link: PipelineLink, events: EventQueues, restarted: threading.Event
) -> None:
    a, b = two_sessions_on_different_replicas(link)
    victim_name = link.names.instance_for("vocoder", b)
    survivor = a
    try:
        for s in (a, b):
            link.create_response(s, f"long-{s}", text="talk for a while")
            wait_for(events, s, Kind.AUDIO_OUT)
        victim = supervisor.stages[victim_name].process.pid
        os.kill(victim, signal.SIGKILL)
        error = wait_for(events, b, Kind.ERROR)
        assert error.msg.code == "stage_restarted" and error.msg.stage == "vocoder"
        assert restarted.wait(60), f"{victim_name} was not restarted"
        assert supervisor.stages[victim_name].process.pid != victim
        # the other replica's session was not touched: its reply runs to the end
        deadline = time.monotonic() + 60
        seen = [events.next(survivor, 60)]
        while seen[-1].kind is not Kind.AUDIO_DONE:
            seen.append(events.next(survivor, max(0.01, deadline - time.monotonic())))
        assert seen[-1].msg.response_id == f"long-{survivor}"
        assert not [e.msg for e in seen if e.kind is Kind.ERROR]
    finally:
        link.close_session(a)
        link.close_session(b)
