"""The ring's Python API over the C core (shm/src)."""

from __future__ import annotations

from types import TracebackType
from typing import Any, NamedTuple

from shm import _ring
from shm.control import Control
from shm.segments import normalize, reap_if_stale, track_owned

HEADER_SIZE: int = _ring.HEADER_SIZE
"""Bytes of header in front of every record's payload."""
FLAG_NO_PURGE: int = _ring.FLAG_NO_PURGE
"""Record flag: delivered even when its session's epoch moved on (session control, cancels)."""


class Record(NamedTuple):
    """One record, its payload copied out of shared memory."""

    kind: int
    flags: int
    session: int
    epoch: int
    seq: int
    t_ns: int
    """CLOCK_MONOTONIC at push, comparable with time.monotonic_ns() in any local process."""
    payload: bytes


class RecordView:
    """A record whose payload is a read-only memoryview straight into the ring (no copy).

    The view pins the record: the producer cannot reuse its bytes until `release()` (or the
    end of a `with` block, or the next pop). numpy arrays made from `payload` must be gone
    by then, or release raises BufferError rather than let them see overwritten memory.
    """

    __slots__ = ("_ring", "epoch", "flags", "kind", "payload", "seq", "session", "t_ns")

    def __init__(self, ring: _ring.RingCore, header: tuple[Any, ...]) -> None:
        self._ring: _ring.RingCore | None = ring
        (self.kind, self.flags, self.session, self.epoch, self.seq, self.t_ns, self.payload) = (
            header
        )

    def release(self) -> None:
        """Hand the record's bytes back to the producer. Safe to call twice."""
        if self._ring is None:
            return
        self.payload.release()
        self._ring.release_view()
        self._ring = None

    def __enter__(self) -> RecordView:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def _power_of_two(n: int) -> int:
    return 1 << max(8, (n - 1).bit_length())


class Ring:
    """Single-producer single-consumer ring of typed records in POSIX shared memory.

    One process pushes, one pops. With a `Control`, records carry their session's epoch and
    a consumer silently skips (and counts) records whose epoch is older than the session's
    current one. Blocking calls sleep in the kernel with the GIL released, wake for Ctrl-C,
    and raise PeerDiedError when the process on the other end is gone.
    """

    def __init__(self, core: _ring.RingCore, control: Control | None) -> None:
        self._core = core
        self.control = control

    @property
    def wake_yield(self) -> bool:
        """Whether this end's pushes yield the CPU to a consumer they wake after a quiet spell
        (the previous wake over 100 µs before). Off by default.

        A woken consumer is usually queued on the producer's own CPU and waits there until the
        producer blocks; yielding runs it at once. On a 2-core VM, side by side in three runs,
        the one-way p99 went from 21-41 to 14-29 µs (6,400 B) and from 25-37 to 18-26 µs
        (16 B), but the two processes stay on one CPU: 6,400-byte throughput halved in two
        runs of three, and in the loaded pipeline a yield can hand the CPU to any runnable
        task, not just the consumer (a hop that only crosses rings went from 0.3-0.5 to 2.6-8.6
        ms; docs/benchmarks.md)."""
        return self._core.wake_yield

    @wake_yield.setter
    def wake_yield(self, enabled: bool) -> None:
        self._core.wake_yield = enabled

    @classmethod
    def create(cls, name: str, capacity: int, control: Control | None = None) -> Ring:
        """Create and own a ring of `capacity` data bytes (rounded up to a power of two).

        The owner unlinks the segment on close and at interpreter exit. A leftover segment
        of the same name whose owner died is reaped first.
        """
        if capacity <= 0:
            raise ValueError(f"ring capacity must be positive, got {capacity}")
        name = normalize(name)
        reap_if_stale(name)
        core = _ring.create_ring(name, _power_of_two(capacity), _control_core(control))
        ring = cls(core, control)
        track_owned(ring)
        return ring

    @classmethod
    def attach(cls, name: str, control: Control | None = None, *, role: str | None = None) -> Ring:
        """Map an existing ring. `role` ('producer' or 'consumer') registers this process at
        once, so the peer can tell if it dies before its first push or pop."""
        name = normalize(name)
        core = _ring.attach_ring(name, _control_core(control))
        owner = core.owner_pid
        if not _ring.pid_alive(owner):
            core.close()
            raise _ring.SegmentError(f"ring {name} is stale: its owner (pid {owner}) is dead")
        if role is not None:
            core.register(role)
        return cls(core, control)

    @property
    def name(self) -> str:
        return self._core.name

    @property
    def capacity(self) -> int:
        return self._core.capacity

    @property
    def max_payload(self) -> int:
        """The largest payload a single record may carry (half the ring, less a header)."""
        return self._core.max_payload

    @property
    def closed(self) -> bool:
        return self._core.closed

    def push(
        self,
        payload: bytes | bytearray | memoryview | Any,
        *,
        session: int,
        kind: int,
        epoch: int | None = None,
        flags: int = 0,
        timeout: float | None = 0,
    ) -> bool:
        """Append a record; True when written, False when still full after `timeout` seconds.

        `payload` is any C-contiguous buffer (bytes, memoryview, numpy array). `epoch=None`
        stamps the session's current epoch. `timeout=0` never waits; None waits for room as
        long as it takes. A full ring is reported, never overwritten.
        """
        return self._core.push(payload, session, kind, epoch, flags, timeout)

    def pop(self, timeout: float | None = None) -> Record | None:
        """The next deliverable record, copied; None if none came within `timeout` seconds."""
        header = self._core.pop(timeout)
        return None if header is None else Record._make(header)

    def pop_view(self, timeout: float | None = None) -> RecordView | None:
        """The next record without a copy: see RecordView for how long its payload is valid."""
        header = self._core.pop_view(timeout)
        return None if header is None else RecordView(self._core, header)

    def stats(self) -> dict[str, int]:
        """capacity, bytes_used, pushed, popped, skipped (stale epochs), full (refused pushes),
        producer_pid and consumer_pid. Readable from any process attached to the ring."""
        return self._core.stats()

    def close(self) -> None:
        """Unmap; the owner also unlinks. Safe to call twice."""
        self._core.close()

    def __enter__(self) -> Ring:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"capacity={self.capacity}"
        return f"<Ring {self.name} {state}>"


def _control_core(control: Control | None) -> _ring.ControlCore | None:
    if control is None:
        return None
    if not isinstance(control, Control):
        raise TypeError(f"control must be a shm.Control, not {type(control).__name__}")
    return control._core
