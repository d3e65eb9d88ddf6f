"""A ring record as the code above the rings sees it, and the one loop that reads them.

Both ends of the pipeline read the same way: a thread owns a ring's consuming end, pops each
record, decodes its payload by the record's kind (stages.messages) and hands an `Envelope` on.
The stages' model loops and the gateway's sessions only ever see Envelopes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

from shm import PeerDiedError, Ring
from stages.messages import BadRecord, Kind, Msg, decode

logger = logging.getLogger(__name__)

POLL_S = 0.25  # how often an idle reader looks at its stop flag

#: A record's message: a schema of stages.messages, or the raw PCM16 of an audio kind.
Payload: TypeAlias = Msg | memoryview | bytes


@dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded record: the instance that pushed it, its header, its message."""

    src: str
    kind: Kind
    session: int
    epoch: int
    seq: int
    t_ns: int  # CLOCK_MONOTONIC when it was pushed (one clock for every process)
    msg: Payload


class RingReader:
    """A thread that owns the consuming end of one ring and hands each record on.

    `deliver` runs on the thread, for every record whose payload decodes. A record that does not
    goes to `on_bad`; an exception from `deliver` goes to `on_failure`; the thread goes on in
    both cases, as it does when the ring's producer dies (it waits for its restart)."""

    def __init__(
        self,
        src: str,
        ring: Ring,
        deliver: Callable[[Envelope], None],
        *,
        name: str,
        on_bad: Callable[[int, str], None],
        on_failure: Callable[[int, Kind | int, BaseException], None],
    ) -> None:
        self.src, self.ring = src, ring
        self._deliver, self._on_bad, self._on_failure = deliver, on_bad, on_failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2 * POLL_S + 1) -> None:
        """Ask the thread to end and wait for it (it sees the flag within POLL_S)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _read(self) -> None:
        src, ring = self.src, self.ring
        while not self._stop.is_set():
            try:
                rec = ring.pop(timeout=POLL_S)
            except PeerDiedError as exc:
                logger.warning("%s: %s; waiting for it to be restarted", self._thread.name, exc)
                continue
            if rec is None:
                continue
            try:
                msg = decode(rec.kind, rec.payload)
            except BadRecord as exc:
                self._on_bad(rec.session, f"from {src}: {exc}")
                continue
            try:
                self._deliver(
                    Envelope(src, Kind(rec.kind), rec.session, rec.epoch, rec.seq, rec.t_ns, msg)
                )
            except Exception as exc:  # one bad record must not stop the reader
                self._on_failure(rec.session, rec.kind, exc)
