"""Bridges: one direction of a crossing link, ring to ring across hosts (docs/scaling.md).

Every process still talks to a ring. On the producing host a `RingToWire` thread pops the ring
and sends each record over a ZeroMQ PUSH socket; on the consuming host a `WireToRing` thread
receives it on a PULL socket and pushes it into that host's ring with the record's own epoch
and flags. So `PipelineLink`, the stages and the supervisor's pushes do not know whether their
peer is on their host. One connection per direction keeps a ring's FIFO order.

What the rings guarantee holds across the hop:
- epochs: with a `control` (the consuming host's mirror of the sender's control segment) each
  record raises its session's epoch there before it is pushed, so what a cancel made stale is
  skipped at pop on this host too, and records a cancel purged on the sending host never left;
- backpressure: buffering is bounded end to end (source ring, send high-water mark, the
  sockets, receive high-water mark, destination ring): a consumer that falls behind fills the
  source ring and its producer's push times out, as on one host;
- nothing is lost silently: frames are numbered per connection, and a gap, a frame that does
  not decode, or `dead_after_s` without a frame (the sender heartbeats when idle) is a dead
  link, reported once to `on_down`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from shm import Control, PeerDiedError, Record, Ring
from stages import wire
from stages.messages import Kind
from stages.wire import WireError, WireKind

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often a blocked thread looks at its stop flag
HEARTBEAT_S = 0.1  # an idle sender's heartbeat
DEAD_AFTER_S = 0.5  # a receiver that hears nothing for this long calls the link dead
HWM = 256  # frames queued in each socket: "full" still means "behind by about a ring"


@dataclass(frozen=True)
class LinkTiming:
    """A crossing link's liveness (`cluster.heartbeat_ms`, `cluster.dead_after_ms`): how often
    an idle sender says it is there, and how long its receiver hears nothing before it calls
    the link dead and fails the calls on it."""

    heartbeat_s: float = HEARTBEAT_S
    dead_after_s: float = DEAD_AFTER_S


DEFAULT_TIMING = LinkTiming()


class RingToWire:
    """Pops `ring` and sends each record to the `WireToRing` at `endpoint` (tcp://host:port).

    The first frame is a HELLO naming the link and this sender's `incarnation`. While
    `link_down()` is in force the records popped are dropped and counted, so that a producer
    never blocks on a dead host; a slow but live consumer blocks the sends instead."""

    def __init__(
        self,
        ring: Ring,
        endpoint: str,
        *,
        link: str,
        incarnation: str,
        context: zmq.Context | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        hwm: int = HWM,
        socket_buffer: int = 0,
    ) -> None:
        self.ring, self.endpoint, self.link, self.incarnation = ring, endpoint, link, incarnation
        self.heartbeat_s = heartbeat_s
        self.sent = 0  # records sent (frames after the HELLO, heartbeats apart)
        self.dropped = 0  # records popped while the link was down
        self._stop = threading.Event()
        self._down = threading.Event()
        self._socket = (context or zmq.Context.instance()).socket(zmq.PUSH)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)  # queue only for a connected peer
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDTIMEO, int(POLL_S * 1000))
        if socket_buffer:
            self._socket.setsockopt(zmq.SNDBUF, socket_buffer)
        self._thread = threading.Thread(target=self._run, name=f"to-wire-{link}", daemon=True)

    def start(self) -> None:
        self._socket.connect(self.endpoint)
        self._thread.start()

    def link_down(self) -> None:
        """The far end is dead: drop what is popped until `link_up()`."""
        self._down.set()

    def link_up(self) -> None:
        self._down.clear()

    def stop(self) -> None:
        """Tell the far end (best effort), end the thread and close the socket."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2 * max(POLL_S, self.heartbeat_s) + 1)
        self._socket.close(linger=0)

    def _send(self, parts: list[bytes | memoryview]) -> bool:
        """Send one frame, waiting while the peer is behind; False when given up (stopping, or
        the link is down)."""
        while True:
            try:
                self._socket.send_multipart(parts, copy=True)
                return True
            except zmq.Again:
                if self._stop.is_set() or self._down.is_set():
                    return False

    def _run(self) -> None:
        seq = 0
        if not self._send(wire.hello(self.link, self.incarnation, time.monotonic_ns())):
            return
        while not self._stop.is_set():
            try:
                view = self.ring.pop_view(timeout=self.heartbeat_s)
            except PeerDiedError as exc:
                logger.warning("%s: %s; waiting for it to be restarted", self._thread.name, exc)
                self._stop.wait(POLL_S)
                continue
            if view is None:
                now = time.monotonic_ns()
                self._send(wire.encode(WireKind.HEARTBEAT, 0, 0, 0, seq, now, b""))
                continue
            with view:
                if self._down.is_set():
                    self.dropped += 1
                    continue
                parts = wire.encode(
                    view.kind, view.flags, view.session, view.epoch, seq + 1, view.t_ns,
                    view.payload,
                )  # fmt: skip
                if self._send(parts):
                    seq += 1
                    self.sent += 1
                else:
                    self.dropped += 1
        goodbye = wire.encode(WireKind.LINK_DOWN, 0, 0, 0, seq, time.monotonic_ns(), b"")
        with contextlib.suppress(zmq.Again):  # else the far end calls it dead by its silence
            self._socket.send_multipart(goodbye, flags=zmq.NOBLOCK)


class WireToRing:
    """Receives one link's frames on a PULL socket bound to `address` (a free port is taken:
    `endpoint` names it) and pushes each record into `ring`.

    It takes frames from the first sender whose HELLO names this `link`, or, after
    `expect(incarnation)`, only from that incarnation. `on_down(reason)` is called on this
    thread, once each time the link goes down; a new accepted HELLO brings it back up."""

    def __init__(
        self,
        ring: Ring,
        address: str,
        *,
        link: str,
        on_down: Callable[[str], None],
        control: Control | None = None,
        context: zmq.Context | None = None,
        dead_after_s: float = DEAD_AFTER_S,
        hwm: int = HWM,
        socket_buffer: int = 0,
    ) -> None:
        self.ring, self.link, self.control = ring, link, control
        self.on_down, self.dead_after_s = on_down, dead_after_s
        self.received = 0  # records pushed into the ring
        # sessions opened through this link and not closed: a stage host's record of the calls
        # a gateway host it loses had open there (stages.crossing.close_sessions)
        self.sessions: set[int] = set()
        self.refused = 0  # frames from no accepted sender
        self.up = False
        self.down_reason: str | None = None
        self._expected: str | None = None
        self._seq = 0
        self._heard = 0.0
        self._stop = threading.Event()
        self._socket = (context or zmq.Context.instance()).socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        if socket_buffer:
            self._socket.setsockopt(zmq.RCVBUF, socket_buffer)
        self._socket.bind(f"tcp://{address}:*")
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name=f"from-wire-{link}", daemon=True)

    def expect(self, incarnation: str) -> None:
        """Take frames only from the sender that says it is `incarnation` (the one the plan
        placed): a stale sender, cut off and back, is refused."""
        self._expected = incarnation

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2 * POLL_S + 1)
        self._socket.close(linger=0)

    def _went_down(self, reason: str) -> None:
        if not self.up:
            return
        self.up, self.down_reason = False, reason
        logger.warning("link %s is down: %s", self.link, reason)
        try:
            self.on_down(reason)
        except Exception:  # the receiver goes on, ready for the sender's return
            logger.exception("link %s: on_down failed", self.link)

    def _hello(self, frame: Record) -> None:
        hello = wire.read_hello(frame)
        if hello.link != self.link:
            raise WireError(f"a HELLO for link {hello.link!r} on link {self.link!r}")
        if self._expected is not None and hello.incarnation != self._expected:
            self.refused += 1
            logger.warning(
                "link %s: refused sender %s (expecting %s)",
                self.link,
                hello.incarnation,
                self._expected,
            )
            return
        self.up, self.down_reason, self._seq = True, None, 0

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        wait_ms = int(min(POLL_S, self.dead_after_s / 5) * 1000)
        while not self._stop.is_set():
            if not poller.poll(wait_ms):
                silent = time.monotonic() - self._heard
                if self.up and silent > self.dead_after_s:
                    self._went_down(f"nothing from the sender for {silent * 1000:.0f} ms")
                continue
            parts = self._socket.recv_multipart(copy=True)
            self._heard = time.monotonic()
            try:
                self._frame(wire.decode(parts))
            except WireError as exc:
                self._went_down(str(exc))

    def _frame(self, frame: Record) -> None:
        if frame.kind == WireKind.HELLO:
            self._hello(frame)
            return
        if not self.up:
            self.refused += 1
            return
        if frame.kind == WireKind.LINK_DOWN:
            self._went_down("the sender closed the link")
        elif frame.kind == WireKind.HEARTBEAT:
            if frame.seq != self._seq:
                raise WireError(f"a heartbeat after frame {frame.seq}, {self._seq} came")
        elif frame.seq != self._seq + 1:
            raise WireError(f"frame {frame.seq} after frame {self._seq}: frames were lost")
        else:
            self._seq = frame.seq
            if self.control is not None:
                self.control.advance(frame.session, frame.epoch)
            self._push(frame)
            if frame.kind == Kind.SESSION_OPEN:
                self.sessions.add(frame.session)
            elif frame.kind == Kind.SESSION_CLOSE:
                self.sessions.discard(frame.session)

    def _push(self, frame: Record) -> None:
        """Into the ring, waiting while it is full: meanwhile nothing is read, the socket's
        queue fills and the sender's sends wait in turn."""
        while not self.ring.push(
            frame.payload,
            session=frame.session,
            kind=frame.kind,
            epoch=frame.epoch,
            flags=frame.flags,
            timeout=POLL_S,
        ):
            if self._stop.is_set():
                return
        self.received += 1
