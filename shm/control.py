"""The control segment: one epoch per session, shared by every process."""

from __future__ import annotations

from types import TracebackType

from shm import _ring
from shm.segments import normalize, reap_if_stale, track_owned


def epoch_older(a: int, b: int) -> bool:
    """Whether epoch `a` comes before epoch `b`: 32-bit and wrap-safe, as the rings compare."""
    return (a - b) % (1 << 32) >= 1 << 31


class Control:
    """Per-session epochs. `cancel(session)` makes every queued record of the session stale.

    Session ids are slots 0..max_sessions-1; epochs only grow (modulo 2**32, compared
    wrap-safely by consumers).
    """

    def __init__(self, core: _ring.ControlCore) -> None:
        self._core = core

    @classmethod
    def create(cls, name: str, max_sessions: int) -> Control:
        """Create the segment (the caller owns it: it is unlinked on close and at exit).

        A leftover segment of the same name whose owner died is reaped first; one whose owner
        lives raises FileExistsError.
        """
        name = normalize(name)
        reap_if_stale(name)
        control = cls(_ring.create_control(name, max_sessions))
        track_owned(control)
        return control

    @classmethod
    def attach(cls, name: str) -> Control:
        """Map an existing control segment; raises SegmentError if its owner is dead."""
        name = normalize(name)
        core = _ring.attach_control(name)
        owner = core.owner_pid
        if not _ring.pid_alive(owner):
            core.close()
            raise _ring.SegmentError(
                f"control segment {name} is stale: its owner (pid {owner}) is dead"
            )
        return cls(core)

    @property
    def name(self) -> str:
        return self._core.name

    @property
    def max_sessions(self) -> int:
        return self._core.max_sessions

    @property
    def closed(self) -> bool:
        return self._core.closed

    def epoch(self, session: int) -> int:
        """The session's current epoch."""
        return self._core.epoch(session)

    def cancel(self, session: int) -> int:
        """Bump the session's epoch, purging its queued records everywhere; return the new one."""
        return self._core.cancel(session)

    def advance(self, session: int, epoch: int) -> int:
        """Raise the session's epoch to `epoch` unless it is already there or past it (wrap-safe,
        as `epoch_older`); return the epoch after. For a mirror of another host's segment,
        which learns each session's epoch from the records that cross."""
        return self._core.advance(session, epoch)

    def open_session(self, first: int = 0, step: int = 1) -> int | None:
        """Claim a free session id for this process (its epoch is bumped, so nothing a previous
        holder queued is delivered); None when every slot is taken.

        Only ids `first`, `first + step`, ... are looked at: processes that hand out ids from
        one segment take disjoint strides (gateway k of n: first=k, step=n)."""
        return self._core.claim(first, step)

    def close_session(self, session: int) -> None:
        """Free a session id; records still queued for it become stale."""
        self._core.release(session)

    def holder(self, session: int) -> int:
        """pid of the process holding the session id, 0 if free."""
        return self._core.holder(session)

    def open_sessions(self) -> list[int]:
        """Session ids currently held by some process."""
        return [s for s in range(self.max_sessions) if self._core.holder(s)]

    def close(self) -> None:
        """Unmap; the owner also unlinks. Safe to call twice."""
        self._core.close()

    def __enter__(self) -> Control:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"max_sessions={self.max_sessions}"
        return f"<Control {self.name} {state}>"
