"""What a dead crossing link means for the calls on it (docs/scaling.md, "Failure and
recovery"): what a dead stage or gateway process means on one host. The link's `WireToRing`
does the pushing, from its `on_down`: it is the producer of the ring it pushes into, so the
ring keeps one producer."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable, Mapping

from shm import Control, Ring
from stages.bridge import DEFAULT_TIMING, LinkTiming, RingToWire, WireToRing
from stages.messages import STAGE_RESTARTED, Error, SessionClose
from stages.rings import GATEWAY, RingNames, RingSet, RingWriter, role_of


def fail_served_sessions(
    names: RingNames,
    control: Control,
    ring: Ring,
    stage: str,
    gateway: str,
    message: str,
    opened: Iterable[int] | None = None,
) -> list[int]:
    """`stage` is lost to `gateway`: every open session of `gateway` that `stage` serves is
    cancelled (what was queued for it is purged) and the gateway is told, an `Error` with
    STAGE_RESTARTED through `ring` (stage -> gateway), on which the call goes on without its
    reply. `opened`: the open sessions, where `control` does not hold them (a stage host's
    mirror: those its link from the gateway saw opened). Returns the sessions."""
    role = role_of(stage)
    to_gateway = RingWriter(ring, stage, gateway)
    failed = []
    for session in control.open_sessions() if opened is None else sorted(opened):
        if names.instance_for(role, session) != stage:
            continue  # served by another replica, which is alive
        if names.instance_for(GATEWAY, session) != gateway:
            continue  # another gateway's: the ring to it says so
        control.cancel(session)
        to_gateway.send(session, Error(role, STAGE_RESTARTED, message), timeout=1.0)
        failed.append(session)
    return failed


def close_sessions(
    ring: Ring, gateway: str, stage: str, sessions: Iterable[int], reason: str
) -> None:
    """`gateway` is lost to `stage`: each of its `sessions` is closed there (the reasoning
    stage aborts the request, freeing its KV blocks), through `ring` (gateway -> stage)."""
    to_stage = RingWriter(ring, gateway, stage)
    for session in sessions:
        to_stage.send(session, SessionClose(reason), timeout=1.0)


class CrossingLinks:
    """One host's ends of the links that cross to other hosts: a `WireToRing` bound on
    `address` for each link into this host, a `RingToWire` for each link out of it once
    `connect` is given the far ends' endpoints. The rings are this host's `RingSet`'s.

    When an inbound link dies its paired outbound link stops sending (dropping what its ring
    holds), and the calls on it are failed (a stage lost to a gateway here) or closed (a
    gateway lost to a stage here)."""

    def __init__(
        self, names: RingNames, rings: RingSet, address: str, timing: LinkTiming = DEFAULT_TIMING
    ) -> None:
        self.names, self.rings, self.address, self.timing = names, rings, address, timing
        self.incarnation = uuid.uuid4().hex
        self.inbound: dict[tuple[str, str], WireToRing] = {}
        self.outbound: dict[tuple[str, str], RingToWire] = {}
        try:
            for src, dst in names.links_here:
                if names.crossing(src, dst) and names.host_of(dst) == names.here:
                    self.inbound[(src, dst)] = WireToRing(
                        rings.rings[(src, dst)],
                        address,
                        link=link_name(src, dst),
                        control=rings.control,
                        on_down=functools.partial(self._down, src, dst),
                        dead_after_s=timing.dead_after_s,
                    )
        except BaseException:
            self.stop()
            raise
        for receiver in self.inbound.values():
            receiver.start()

    @property
    def endpoints(self) -> dict[tuple[str, str], str]:
        """Where each link into this host is received."""
        return {link: receiver.endpoint for link, receiver in self.inbound.items()}

    def connect(self, endpoints: Mapping[tuple[str, str], str]) -> None:
        """Start sending on each link out of this host, to the far host's endpoint for it."""
        names = self.names
        for src, dst in names.links_here:
            if not names.crossing(src, dst) or names.host_of(src) != names.here:
                continue
            if (src, dst) in self.outbound:
                continue
            if (src, dst) not in endpoints:
                raise KeyError(
                    f"no endpoint for link {link_name(src, dst)} (from host {names.host_of(dst)})"
                )
            sender = RingToWire(
                self.rings.rings[(src, dst)],
                endpoints[(src, dst)],
                link=link_name(src, dst),
                incarnation=self.incarnation,
                heartbeat_s=self.timing.heartbeat_s,
            )
            sender.start()
            self.outbound[(src, dst)] = sender

    def reconnect(self, host: str, endpoints: Mapping[tuple[str, str], str]) -> None:
        """`host` came back (restarted, its links received at new endpoints): send on each
        link out of this host to it afresh. What its old senders held was dropped while the
        link was down; the links from it come back up with its first HELLO."""
        for (src, dst), sender in list(self.outbound.items()):
            if self.names.host_of(dst) == host:
                sender.stop()
                del self.outbound[(src, dst)]
        self.connect(endpoints)

    def opened(self, gateway: str, stage: str) -> set[int] | None:
        """The sessions `gateway`, on another host, opened with `stage` here (None: the
        gateway is on this host, whose control segment holds its sessions)."""
        receiver = self.inbound.get((gateway, stage))
        return None if receiver is None else set(receiver.sessions)

    def up(self, host: str) -> bool:
        """Whether every link into this host from `host` has heard its sender."""
        return all(
            receiver.up
            for (src, _), receiver in self.inbound.items()
            if self.names.host_of(src) == host
        )

    def _down(self, src: str, dst: str, reason: str) -> None:
        """Link src -> dst into this host died (on its receiving thread: the producer of the
        ring this pushes into)."""
        if (paired := self.outbound.get((dst, src))) is not None:
            paired.link_down()
        names, ring = self.names, self.rings.rings[(src, dst)]
        host = names.host_of(src)
        if role_of(dst) == GATEWAY:
            message = f"the {role_of(src)}'s host ({host}) stopped answering: {reason}"
            fail_served_sessions(names, self.rings.control, ring, src, dst, message)
        elif role_of(src) == GATEWAY:
            sessions = sorted(self.inbound[(src, dst)].sessions)
            close_sessions(ring, src, dst, sessions, "gateway_host_lost")

    def stop(self) -> None:
        for end in (*self.outbound.values(), *self.inbound.values()):
            end.stop()
        self.outbound.clear()
        self.inbound.clear()


def link_name(src: str, dst: str) -> str:
    return f"{src}>{dst}"
