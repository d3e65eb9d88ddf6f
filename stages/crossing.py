"""What a dead crossing link means for the calls on it (docs/scaling.md, "Failure and
recovery"): what a dead stage or gateway process means on one host. The link's `WireToRing`
does the pushing, from its `on_down`: it is the producer of the ring it pushes into, so the
ring keeps one producer."""

from __future__ import annotations

from collections.abc import Iterable

from shm import Control, Ring
from stages.messages import STAGE_RESTARTED, Error, SessionClose
from stages.rings import GATEWAY, Outbox, RingNames, role_of


def fail_served_sessions(
    names: RingNames, control: Control, ring: Ring, stage: str, gateway: str, message: str
) -> list[int]:
    """`stage` is lost to `gateway`: every open session of `gateway` that `stage` serves is
    cancelled (what was queued for it is purged) and the gateway is told, an `Error` with
    STAGE_RESTARTED through `ring` (stage -> gateway), on which the call goes on without its
    reply. Returns the sessions."""
    role = role_of(stage)
    to_gateway = Outbox(ring, stage, gateway)
    failed = []
    for session in control.open_sessions():
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
    to_stage = Outbox(ring, gateway, stage)
    for session in sessions:
        to_stage.send(session, SessionClose(reason), timeout=1.0)
