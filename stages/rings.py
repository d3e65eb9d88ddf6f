"""The ring topology: one ring per direction per pair of processes, plus the control segment.

```
gateway ─▶ encoder ─▶ reasoning ─▶ vocoder ─▶ gateway
   │  ╲────────────────▲  ╲──────────────────▲
   ╰──────────────────────────────▶ vocoder  (control: cancel, session open/close)
encoder ─▶ gateway (transcripts)   reasoning ─▶ gateway (text deltas)
```
The supervisor creates (and owns) every segment; each process attaches to its own ends.

A role may run as several processes (`vocoder.replicas`, `gateway.processes`): instances
`vocoder`, `vocoder.1`, ... each with its own rings (SPSC stays SPSC). Gateway k of n hands out
the session ids k, k + n, k + 2n, ... (`Control.open_session(k, n)`), so a session's id says
which gateway owns it; a stage role's replicas split each gateway's sessions between them,
`(session // n) % replicas`. Senders name the role; `RingNames.instance_for` picks the ring.
Acknowledgements and errors carry the role, so the gateway sees one vocoder whatever the count.

Across hosts (docs/scaling.md) each instance has a host (`RingNames.hosts`; unnamed: the
gateway's) and each host its own segments, named with the host: a link within a host is a ring
as above; a crossing link is a ring on each of its two hosts joined by bridges
(stages.bridge). `RingNames.on(host)` is one host's view of the pipeline; a process attaches
its ends on its own host and does not know which of its peers are elsewhere.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace

from shm import FLAG_NO_PURGE, Control, Ring, segment_name
from stages.config import PipelineConfig
from stages.messages import Kind, Msg, encode
from stages.stops import survives_cancel

GATEWAY = "gateway"
STAGES = ("encoder", "reasoning", "vocoder")
LINKS: tuple[tuple[str, str], ...] = (
    (GATEWAY, "encoder"),
    (GATEWAY, "reasoning"),
    (GATEWAY, "vocoder"),
    ("encoder", "reasoning"),
    ("encoder", GATEWAY),
    ("reasoning", "vocoder"),
    ("reasoning", GATEWAY),
    ("vocoder", GATEWAY),
)
AUDIO_LINKS = {(GATEWAY, "encoder"), ("vocoder", GATEWAY)}
SPEECH_IN_LINK = ("encoder", "reasoning")
LOCAL = "local"  # the host of every instance not placed elsewhere: the gateway's


def role_of(instance: str) -> str:
    """'vocoder.2' -> 'vocoder'."""
    return instance.partition(".")[0]


@dataclass(frozen=True)
class RingNames:
    """Segment names and process instances of one pipeline; picklable, handed to every stage
    process. `replicas`: roles that run as several processes, with their counts. `wake_yield`:
    every producer yields its CPU to the consumer it wakes (experiments.wake_yield)."""

    prefix: str
    replicas: tuple[tuple[str, int], ...] = ()
    wake_yield: bool = False
    hosts: tuple[tuple[str, str], ...] = ()  # instance -> host, for those not on LOCAL
    host: str = ""  # the host whose segments these names are ("": the one host there is)

    @classmethod
    def of(cls, config: PipelineConfig, gateways: int = 1) -> RingNames:
        """Fresh names for `config`'s pipeline served by `gateways` gateway processes."""
        replicas = {
            "reasoning": config.reasoning.replicas,
            "vocoder": config.vocoder.replicas,
            GATEWAY: gateways,
        }
        return cls.fresh(replicas, wake_yield=config.experiments.wake_yield)

    @classmethod
    def fresh(
        cls, replicas: Mapping[str, int] | None = None, *, wake_yield: bool = False
    ) -> RingNames:
        counts = tuple(sorted((r, n) for r, n in (replicas or {}).items() if n != 1))
        for role, n in counts:
            if role not in (GATEWAY, *STAGES) or n < 1:
                raise ValueError(f"cannot run {n} replicas of {role!r}")
        return cls(segment_name("pipe")[1:], counts, wake_yield)

    def placed(self, hosts: Mapping[str, str], host: str) -> RingNames:
        """These names with instances placed on hosts (by instance, or by role for all its
        instances; the rest are on LOCAL), seen from `host`."""
        by_instance = {
            i: hosts.get(i, hosts.get(role, LOCAL))
            for role in (GATEWAY, *STAGES)
            for i in self.instances(role)
        }
        return replace(
            self,
            hosts=tuple(sorted((i, h) for i, h in by_instance.items() if h != LOCAL)),
            host=host,
        )

    def on(self, host: str) -> RingNames:
        """The same pipeline seen from `host`."""
        return replace(self, host=host)

    def host_of(self, instance: str) -> str:
        return dict(self.hosts).get(instance, LOCAL)

    @property
    def here(self) -> str:
        """The host these names are for (LOCAL when there is one)."""
        return self.host or LOCAL

    def _segment(self, name: str) -> str:
        return f"/{self.prefix}-{name}" if not self.hosts else f"/{self.prefix}-{self.here}-{name}"

    @property
    def control(self) -> str:
        """This host's control segment: the gateway host's holds the epochs; another host's
        is its mirror, raised by the records that cross (stages.bridge)."""
        return self._segment("control")

    def ring(self, src: str, dst: str) -> str:
        """The ring of link src -> dst on this host."""
        return self._segment(f"{src}-{dst}")

    def crossing(self, src: str, dst: str) -> bool:
        """Whether link src -> dst joins two hosts."""
        return self.host_of(src) != self.host_of(dst)

    @property
    def links_here(self) -> tuple[tuple[str, str], ...]:
        """The links with an end on this host: each has a ring here."""
        here = self.here
        return tuple((a, b) for a, b in self.links if here in (self.host_of(a), self.host_of(b)))

    def count(self, role: str) -> int:
        return dict(self.replicas).get(role, 1)

    def instances(self, role: str) -> tuple[str, ...]:
        return (role, *(f"{role}.{k}" for k in range(1, self.count(role))))

    @property
    def stages(self) -> tuple[str, ...]:
        """Every stage process of the pipeline, replicas included."""
        return tuple(i for role in STAGES for i in self.instances(role))

    @property
    def stages_here(self) -> tuple[str, ...]:
        """The stage processes on this host."""
        return tuple(i for i in self.stages if self.host_of(i) == self.here)

    @property
    def links(self) -> tuple[tuple[str, str], ...]:
        """Every ring: LINKS between roles, for every pair of their instances."""
        return tuple(
            (a, b) for src, dst in LINKS for a in self.instances(src) for b in self.instances(dst)
        )

    @property
    def gateways(self) -> tuple[str, ...]:
        """The gateway processes' instances: 'gateway', 'gateway.1', ..."""
        return self.instances(GATEWAY)

    def gateway_stride(self, instance: str) -> tuple[int, int]:
        """(first, step) of the session ids gateway `instance` hands out."""
        return self.gateways.index(instance), self.count(GATEWAY)

    def sessions_of(self, instance: str, max_sessions: int) -> range:
        """Every session id gateway `instance` may hand out."""
        first, step = self.gateway_stride(instance)
        return range(first, max_sessions, step)

    def instance_for(self, role: str, session: int) -> str:
        """The instance of `role` that serves `session` (the role itself when it has one)."""
        gateways = self.count(GATEWAY)
        k = session % gateways if role == GATEWAY else (session // gateways) % self.count(role)
        return role if k == 0 else f"{role}.{k}"


class RingSet:
    """Every segment of a pipeline on one host (`names.host`), created and owned by that host's
    supervisor's process."""

    def __init__(self, names: RingNames, config: PipelineConfig) -> None:
        self.names = names
        self.control = Control.create(names.control, config.max_sessions)
        self.rings: dict[tuple[str, str], Ring] = {}
        try:
            for link in names.links_here:
                roles = (role_of(link[0]), role_of(link[1]))
                # under speech-in the encoder's rows to reasoning are audio-sized too
                spoken = config.reasoning.speech_in is not None and roles == SPEECH_IN_LINK
                audio = roles in AUDIO_LINKS or spoken
                size = config.rings.audio_bytes if audio else config.rings.event_bytes
                self.rings[link] = Ring.create(names.ring(*link), size, control=self.control)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for ring in self.rings.values():
            ring.close()
        self.control.close()


class RingWriter:
    """The producing end of one ring, shared by a process's threads (SPSC needs one pusher at
    a time, so pushes take a lock)."""

    def __init__(self, ring: Ring, src: str, dst: str) -> None:
        self.ring = ring
        self.src, self.dst = src, dst
        self._lock = threading.Lock()

    def send(
        self, session: int, msg: Msg, *, epoch: int | None = None, timeout: float | None = 5.0
    ) -> bool:
        kind, payload = encode(msg)
        return self.push(
            session, kind, payload, epoch=epoch, timeout=timeout, keep=survives_cancel(kind, msg)
        )

    def push(
        self,
        session: int,
        kind: Kind,
        payload: bytes | memoryview,
        *,
        epoch: int | None = None,
        timeout: float | None = 5.0,
        keep: bool = False,
    ) -> bool:
        """Push; False (and a full count in the ring's stats) if the consumer fell behind by a
        whole ring for `timeout` seconds. `keep`: a cancel does not purge it (`send` sets it
        by survives_cancel; raw pushes are audio, which a cancel purges)."""
        flags = FLAG_NO_PURGE if keep else 0
        with self._lock:
            return self.ring.push(
                payload, session=session, kind=kind, epoch=epoch, flags=flags, timeout=timeout
            )


@dataclass
class Ends:
    """One process's ends of the pipeline: the control segment, its input rings by source
    instance, and its outboxes by destination instance."""

    instance: str
    names: RingNames
    control: Control
    inputs: dict[str, Ring]
    outputs: dict[str, RingWriter]

    def outbox(self, role: str, session: int) -> RingWriter:
        """The outbox to the instance of `role` that serves `session`."""
        return self.outputs[self.names.instance_for(role, session)]

    def rings(self) -> dict[str, Ring]:
        """Every ring of these ends by name ('encoder->gateway', ...), for metrics."""
        out = {f"{src}->{self.instance}": ring for src, ring in self.inputs.items()}
        out.update({f"{self.instance}->{dst}": o.ring for dst, o in self.outputs.items()})
        return out

    def close(self) -> None:
        for ring in self.inputs.values():
            ring.close()
        for out in self.outputs.values():
            out.ring.close()
        self.control.close()


def attach_ends(names: RingNames, me: str) -> Ends:
    """Attach process `me` (an instance) to its rings."""
    control = Control.attach(names.control)
    inputs: dict[str, Ring] = {}
    outputs: dict[str, RingWriter] = {}
    try:
        for src, dst in names.links:
            if dst == me:
                inputs[src] = Ring.attach(names.ring(src, dst), control, role="consumer")
            elif src == me:
                ring = Ring.attach(names.ring(src, dst), control, role="producer")
                outputs[dst] = RingWriter(ring, src, dst)
                ring.wake_yield = names.wake_yield
    except BaseException:
        for ring in [*inputs.values(), *(o.ring for o in outputs.values())]:
            ring.close()
        control.close()
        raise
    return Ends(me, names, control, inputs, outputs)
