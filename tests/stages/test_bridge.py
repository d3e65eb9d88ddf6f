"""stages.bridge: ring, bridge, TCP to 127.0.0.2, bridge, ring, the sender in another process.
What the rings guarantee on one host holds across the hop: order, epochs, the flag that
survives a purge, backpressure, and no loss without a dead link."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import zmq

from shm import FLAG_NO_PURGE, Control, Ring, segment_name
from stages import wire
from stages.bridge import WireToRing
from stages.crossing import close_sessions, fail_served_sessions
from stages.messages import STAGE_RESTARTED, Error, SessionClose, SessionOpen, decode, encode
from stages.rings import RingNames

ADDRESS = "127.0.0.2"  # the far "host": another address of the loopback
DEAD_AFTER_S = 0.3

SENDER = """
import sys
from shm import Control, Ring
from stages.bridge import RingToWire
ring_name, control_name, endpoint, link, incarnation, hwm, buffer = sys.argv[1:8]
control = Control.attach(control_name)
ring = Ring.attach(ring_name, control, role="consumer")
sender = RingToWire(ring, endpoint, link=link, incarnation=incarnation, heartbeat_s=0.05,
                    hwm=int(hwm), socket_buffer=int(buffer))
sender.start()
print("sending", flush=True)
sys.stdin.read()  # until the test is done with it
sender.stop()
print(f"sent {sender.sent} dropped {sender.dropped}", flush=True)
"""


@dataclass
class Downs:
    reasons: list[str] = field(default_factory=list)
    at: list[float] = field(default_factory=list)
    event: threading.Event = field(default_factory=threading.Event)
    then: Callable[[str], None] | None = None  # what the link's owner does about it

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.at.append(time.monotonic())
        if self.then is not None:
            self.then(reason)
        self.event.set()


@dataclass
class Hop:
    control: Control  # the sending host's
    mirror: Control  # the receiving host's copy of it
    source: Ring  # pushed here by the test, popped by the sender process
    dest: Ring  # pushed by the receiver thread, popped by the test
    receiver: WireToRing
    downs: Downs
    sender: subprocess.Popen[str] | None = None

    def start_sender(self, incarnation: str = "one", hwm: int = 256, buffer: int = 0) -> None:
        args = [self.source.name, self.control.name, self.receiver.endpoint, "hop"]
        self.sender = subprocess.Popen(
            [sys.executable, "-c", SENDER, *args, incarnation, str(hwm), str(buffer)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.sender.stdout is not None
        assert self.sender.stdout.readline().strip() == "sending"

    def until(self, received: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while self.receiver.received < received:
            assert time.monotonic() < deadline, f"{self.receiver.received} of {received} came"
            time.sleep(0.005)


@pytest.fixture
def hop(request: pytest.FixtureRequest) -> Iterator[Hop]:
    dest_bytes = getattr(request, "param", 1 << 20)
    with (
        Control.create(segment_name("test-hop-ctl"), 16) as control,
        Control.create(segment_name("test-hop-mirror"), 16) as mirror,
        Ring.create(segment_name("test-hop-src"), 1 << 20, control=control) as source,
        Ring.create(segment_name("test-hop-dst"), dest_bytes, control=mirror) as dest,
    ):
        downs = Downs()
        receiver = WireToRing(
            dest, ADDRESS, link="hop", on_down=downs, control=mirror, dead_after_s=DEAD_AFTER_S
        )
        receiver.start()
        h = Hop(control, mirror, source, dest, receiver, downs)
        try:
            yield h
        finally:
            if h.sender is not None:
                h.sender.kill()
                h.sender.wait(10)
                for pipe in (h.sender.stdin, h.sender.stdout):
                    if pipe is not None:
                        pipe.close()
            receiver.stop()


def test_records_cross_in_order_with_their_kinds_sessions_and_flags(hop: Hop) -> None:
    hop.start_sender()
    sent = [(1 + i % 3, 10 + i % 5, bytes([i]) * (1 + i * 97 % 6400)) for i in range(60)]
    for session, kind, payload in sent:
        assert hop.source.push(payload, session=session, kind=kind, timeout=1)
    hop.until(60)
    got = [hop.dest.pop(1) for _ in sent]
    assert [(r.session, r.kind, r.payload) for r in got if r] == sent
    assert hop.receiver.up and not hop.downs.reasons


def test_a_cancel_between_two_records_makes_the_first_stale_across_the_hop(hop: Hop) -> None:
    hop.start_sender()
    assert hop.source.push(b"before", session=3, kind=31)
    hop.until(1)  # it crossed before the cancel, and waits in the far ring
    epoch = hop.control.cancel(3)
    assert hop.source.push(b"cancel", session=3, kind=52, flags=FLAG_NO_PURGE)
    assert hop.source.push(b"after", session=3, kind=31)
    hop.until(3)
    assert hop.mirror.epoch(3) == epoch
    first, second = hop.dest.pop(1), hop.dest.pop(1)
    assert first is not None and second is not None
    assert (first.payload, first.flags & FLAG_NO_PURGE, second.payload) == (
        b"cancel", FLAG_NO_PURGE, b"after",
    )  # fmt: skip
    assert hop.dest.stats()["skipped"] == 1


@pytest.mark.parametrize("hop", [1 << 14], indirect=True)
def test_a_far_consumer_that_falls_behind_fills_the_source_ring(hop: Hop) -> None:
    hop.start_sender(hwm=2, buffer=4096)
    payload = b"x" * 1000
    pushed = 0
    while hop.source.push(payload, session=1, kind=1, timeout=0.5):
        pushed += 1
        assert pushed < 5000, "the source ring never filled: nothing holds the sender back"
    assert hop.dest.stats()["bytes_used"] > 0 and not hop.downs.reasons
    # the far consumer catches up: everything pushed arrives, in order, nothing dropped
    popped = 0
    while popped < pushed:
        record = hop.dest.pop(5)
        assert record is not None, f"{popped} of {pushed} arrived"
        assert record.payload == payload
        popped += 1
    assert hop.source.push(payload, session=1, kind=1, timeout=1)
    assert hop.dest.pop(5) is not None and not hop.downs.reasons


def test_a_killed_sender_is_a_dead_link_within_dead_after(hop: Hop) -> None:
    hop.start_sender()
    assert hop.source.push(b"one", session=1, kind=31)
    hop.until(1)
    assert hop.sender is not None
    hop.sender.kill()
    killed = time.monotonic()
    assert hop.downs.event.wait(5)
    assert (
        hop.downs.reasons == [hop.downs.reasons[0]]
        and "nothing from the sender" in (hop.downs.reasons[0])
    )
    # silence counts from the last frame heard, a heartbeat (50 ms apart) before the kill
    assert DEAD_AFTER_S - 0.06 <= hop.downs.at[0] - killed < DEAD_AFTER_S + 0.5
    assert not hop.receiver.up


def test_a_sender_that_stops_says_so(hop: Hop) -> None:
    hop.start_sender()
    assert hop.sender is not None and hop.sender.stdin is not None
    hop.sender.stdin.close()
    assert hop.downs.event.wait(5)
    assert hop.downs.reasons == ["the sender closed the link"]
    assert hop.sender.wait(10) == 0


def _raw_sender(hop: Hop, incarnation: str) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(hop.receiver.endpoint)
    socket.send_multipart(wire.hello("hop", incarnation, 0))
    return socket


def test_a_lost_frame_is_a_dead_link_and_nothing_after_it_is_taken(hop: Hop) -> None:
    socket = _raw_sender(hop, "raw")
    try:
        socket.send_multipart(wire.encode(31, 0, 1, 0, 1, 0, b"first"))
        socket.send_multipart(wire.encode(31, 0, 1, 0, 3, 0, b"third"))  # the second is lost
        socket.send_multipart(wire.encode(31, 0, 1, 0, 4, 0, b"fourth"))
        assert hop.downs.event.wait(5)
        assert "frame 3 after frame 1" in hop.downs.reasons[0]
        deadline = time.monotonic() + 5
        while hop.receiver.refused < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert hop.receiver.received == 1 and hop.receiver.refused == 1
        assert hop.dest.pop(0).payload == b"first" and hop.dest.pop(0) is None
    finally:
        socket.close()


def test_a_sender_of_another_incarnation_is_refused(hop: Hop) -> None:
    hop.receiver.expect("new")
    stale = _raw_sender(hop, "old")
    try:
        stale.send_multipart(wire.encode(31, 0, 1, 0, 1, 0, b"stale"))
        deadline = time.monotonic() + 5
        while hop.receiver.refused < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert hop.receiver.refused == 2 and hop.receiver.received == 0
    finally:
        stale.close()
    hop.start_sender(incarnation="new")
    assert hop.source.push(b"fresh", session=1, kind=31)
    hop.until(1)
    assert hop.dest.pop(1).payload == b"fresh"


def test_a_stage_host_that_dies_fails_the_calls_it_served_on_the_gateway_host(hop: Hop) -> None:
    """The receiving end is the gateway host's (vocoder.1 -> gateway.1): the sessions of
    gateway.1 that vocoder.1 serves get an Error, the other calls nothing."""
    names = RingNames("test", (("gateway", 2), ("vocoder", 2)))
    authority = hop.mirror  # the gateway host's control: the ring it reads is checked by it
    sessions = [authority.open_session() for _ in range(8)]
    assert sessions == list(range(8))
    served = [s for s in sessions if s % 2 == 1 and (s // 2) % 2 == 1]  # gateway.1, vocoder.1
    before = {s: authority.epoch(s) for s in sessions}
    for session in sessions:  # the stage host's mirror learned them from the gateway's records
        hop.control.advance(session, before[session])
    hop.downs.then = lambda reason: fail_served_sessions(
        names, authority, hop.dest, "vocoder.1", "gateway.1", f"the vocoder's host: {reason}"
    )
    hop.start_sender()
    assert hop.source.push(b"audio", session=served[0], kind=40)
    hop.until(1)
    assert hop.dest.pop(1).payload == b"audio"
    assert hop.sender is not None
    hop.sender.kill()
    assert hop.downs.event.wait(5)
    errors = []
    while (record := hop.dest.pop(0)) is not None:
        errors.append((record.session, decode(record.kind, record.payload)))
    assert [s for s, _ in errors] == served == [3, 7]
    for _, error in errors:
        assert isinstance(error, Error) and error.code == STAGE_RESTARTED
        assert error.stage == "vocoder" and "nothing from the sender" in error.message
    assert {s for s in sessions if authority.epoch(s) != before[s]} == set(served)


def test_a_stage_host_knows_the_calls_a_gateway_host_had_open_and_closes_them(hop: Hop) -> None:
    hop.start_sender()
    for session, msg in ((1, SessionOpen()), (2, SessionOpen()), (1, SessionClose())):
        kind, payload = encode(msg)
        assert hop.source.push(payload, session=session, kind=kind, flags=FLAG_NO_PURGE)
    hop.until(3)
    assert hop.receiver.sessions == {2}
    for _ in range(3):
        hop.dest.pop(0)
    close_sessions(hop.dest, "gateway", "reasoning", hop.receiver.sessions, "gateway_host_lost")
    record = hop.dest.pop(0)
    assert record is not None and record.session == 2
    assert decode(record.kind, record.payload) == SessionClose("gateway_host_lost")
