"""The ring topology: one ring per direction per pair of processes, plus the control segment.

```
gateway ─▶ encoder ─▶ reasoning ─▶ vocoder ─▶ gateway
   │  ╲────────────────▲  ╲──────────────────▲
   ╰──────────────────────────────▶ vocoder  (control: cancel, session open/close)
encoder ─▶ gateway (transcripts)   reasoning ─▶ gateway (text deltas)
```
The supervisor creates (and owns) every segment; each process attaches to its own ends.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from shm import FLAG_NO_PURGE, Control, Ring, segment_name
from stages.config import PipelineConfig
from stages.messages import Kind, Msg, encode

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
# delivered whatever the session's epoch: the records that manage sessions, their settings
# and conversation, and cancels (a barge-in must not undo an edit sent just before it)
UNPURGEABLE = frozenset(
    {
        Kind.SESSION_OPEN,
        Kind.SESSION_CLOSE,
        Kind.HISTORY,
        Kind.SESSION_SETTINGS,
        Kind.CANCEL,
        Kind.CANCEL_ACK,
        Kind.ERROR,
    }
)


@dataclass(frozen=True)
class RingNames:
    """Segment names of one pipeline; picklable, handed to every stage process."""

    prefix: str

    @classmethod
    def fresh(cls) -> RingNames:
        return cls(segment_name("pipe")[1:])

    @property
    def control(self) -> str:
        return f"/{self.prefix}-control"

    def ring(self, src: str, dst: str) -> str:
        return f"/{self.prefix}-{src}-{dst}"


class RingSet:
    """Every segment of a pipeline, created and owned by the supervisor's process."""

    def __init__(self, names: RingNames, config: PipelineConfig) -> None:
        self.names = names
        self.control = Control.create(names.control, config.max_sessions)
        self.rings: dict[tuple[str, str], Ring] = {}
        try:
            for link in LINKS:
                size = config.rings.audio_bytes if link in AUDIO_LINKS else config.rings.event_bytes
                self.rings[link] = Ring.create(names.ring(*link), size, control=self.control)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for ring in self.rings.values():
            ring.close()
        self.control.close()


class Outbox:
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
        return self.push(session, kind, payload, epoch=epoch, timeout=timeout)

    def push(
        self,
        session: int,
        kind: Kind,
        payload: bytes | memoryview,
        *,
        epoch: int | None = None,
        timeout: float | None = 5.0,
    ) -> bool:
        """Push; False (and a full count in the ring's stats) if the consumer fell behind by a
        whole ring for `timeout` seconds."""
        flags = FLAG_NO_PURGE if kind in UNPURGEABLE else 0
        with self._lock:
            return self.ring.push(
                payload, session=session, kind=kind, epoch=epoch, flags=flags, timeout=timeout
            )


def attach_ends(names: RingNames, me: str) -> tuple[Control, dict[str, Ring], dict[str, Outbox]]:
    """Attach process `me` to its rings: (control, inputs by source, outboxes by destination)."""
    control = Control.attach(names.control)
    inputs: dict[str, Ring] = {}
    outputs: dict[str, Outbox] = {}
    try:
        for src, dst in LINKS:
            if dst == me:
                inputs[src] = Ring.attach(names.ring(src, dst), control, role="consumer")
            elif src == me:
                outputs[dst] = Outbox(
                    Ring.attach(names.ring(src, dst), control, role="producer"), src, dst
                )
    except BaseException:
        for ring in [*inputs.values(), *(o.ring for o in outputs.values())]:
            ring.close()
        control.close()
        raise
    return control, inputs, outputs
