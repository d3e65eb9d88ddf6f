"""What every stage shares: its ring ends, the reader threads, the one stop path, acks and
errors; and the queued model loop of the encoder and the vocoder.

Reader threads own the input rings (one each, stages.envelope); the model loop owns the model.
Every record goes through `route`: the six records that stop work go to the stage's `on_stop`
(stages.stops says what each ends), every other to its `handle`. Records of a cancelled epoch
never reach either: the ring drops what was queued at the time of the cancel, and `is_stale`
what a reader had already passed on.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from stages.config import PipelineConfig
from stages.envelope import POLL_S, Envelope, RingReader
from stages.messages import Cancel, CancelAck, Error, Kind, Msg
from stages.rings import GATEWAY, Ends
from stages.stops import Stop, made_stale, stop_of

logger = logging.getLogger(__name__)


class Stage:
    """Base of the encoder, reasoning and vocoder stages. `ends` are its rings (attached by
    stages.stage_process, or stand-ins in a unit test); `stop` ends its model loop."""

    name = "stage"

    def __init__(self, config: PipelineConfig, ends: Ends, stop: threading.Event) -> None:
        self.config = config
        self.ends = ends
        self.control = ends.control
        self.stop = stop
        # tells the supervisor this stage can no longer serve, ahead of its exit (set by
        # stages.stage_process; /health goes unready at once)
        self.cannot_serve: Callable[[str], None] = lambda why: None
        self._readers = [
            RingReader(
                src,
                ring,
                self.deliver,
                name=f"{self.name}<-{src}",
                on_bad=lambda session, why: self.error(session, "bad_record", why),
                on_failure=self._delivery_failed,
            )
            for src, ring in ends.inputs.items()
        ]

    # -- lifecycle, overridden by stages --------------------------------------------------

    def load(self) -> dict[str, Any]:
        """Load models; return facts for the supervisor (e.g. the output sample rate)."""
        return {}

    def run(self) -> None:
        """The model loop; returns when `self.stop` is set."""
        raise NotImplementedError

    def deliver(self, env: Envelope) -> None:
        """Called on a reader thread for every record read."""
        raise NotImplementedError

    def on_stop(self, session: int, stop: Stop) -> None:
        """Drop the session's work that `stop` ends (and acknowledge a cancel)."""
        raise NotImplementedError

    def handle(self, env: Envelope) -> None:
        """Any record that is not a stop (and a SESSION_OPEN, after its stop)."""
        raise NotImplementedError

    def close(self) -> None:
        for reader in self._readers:
            reader.stop()
        self.ends.close()

    # -- helpers ---------------------------------------------------------------------------

    def start_readers(self) -> None:
        for reader in self._readers:
            reader.start()

    def route(self, env: Envelope) -> None:
        """On the model loop: a stop to `on_stop`, the rest to `handle`. A SESSION_OPEN goes
        to both: it ends what an earlier holder of the id left, then opens the session."""
        stop = stop_of(env)
        if stop is not None:
            self.on_stop(env.session, stop)
            if env.kind is not Kind.SESSION_OPEN:
                return
        self.handle(env)

    def _delivery_failed(self, session: int, kind: Kind | int, exc: BaseException) -> None:
        logger.error("%s: handling %s failed", self.name, kind, exc_info=exc)
        self.error(session, "internal_error", f"{type(exc).__name__}: {exc}")

    def is_stale(self, env: Envelope) -> bool:
        """True when the session was cancelled (or closed) after `env` was pushed."""
        return made_stale(env, self.control.epoch(env.session))

    def send(self, dst: str, session: int, msg: Msg, *, epoch: int | None = None) -> None:
        """Send to the instance of role `dst` that serves `session`."""
        if not self.ends.outbox(dst, session).send(session, msg, epoch=epoch):
            logger.error(
                "%s: ring to %s stayed full; dropped %s for session %d",
                self.name,
                dst,
                type(msg).__name__,
                session,
            )

    def ack(self, session: int, cancel: Cancel, kv_usage: float | None = None) -> None:
        ack = CancelAck(cancel.cancel_id, self.name, time.monotonic_ns(), kv_usage)
        self.send(GATEWAY, session, ack)

    def error(self, session: int, code: str, message: str) -> None:
        logger.warning("%s: session %d: %s: %s", self.name, session, code, message)
        self.send(GATEWAY, session, Error(self.name, code, message))


class QueuedStage(Stage):
    """A stage whose model loop is one thread taking records from a priority inbox: session
    control and cancels jump the queue, stale records are dropped as they come up."""

    URGENT = frozenset({Kind.CANCEL, Kind.SESSION_OPEN, Kind.SESSION_CLOSE})
    #: records the loop handles between two pumps, at most (see `_take`)
    records_a_pump = 4096

    def __init__(self, config: PipelineConfig, ends: Ends, stop: threading.Event) -> None:
        super().__init__(config, ends, stop)
        self.inbox: queue.PriorityQueue[tuple[int, int, Envelope]] = queue.PriorityQueue()
        self._order = itertools.count()

    def deliver(self, env: Envelope) -> None:
        self.inbox.put((0 if env.kind in self.URGENT else 1, next(self._order), env))

    def run(self) -> None:
        timeout = POLL_S
        while not self.stop.is_set():
            for env in self._take(timeout):
                if self.is_stale(env):
                    continue
                try:
                    self.route(env)
                except Exception as exc:  # this session's turn fails; the others go on
                    logger.exception(
                        "%s: %s for session %d failed", self.name, env.kind.name, env.session
                    )
                    self.error(env.session, "internal_error", f"{type(exc).__name__}: {exc}")
            next_in = self.pump()
            timeout = POLL_S if next_in is None else min(max(next_in, 0.0), POLL_S)

    def _take(self, timeout: float) -> list[Envelope]:
        """The next record (waiting up to ``timeout``) and every one already behind it.

        All of them, not one: a pump can take tens of milliseconds, and records come a token
        at a time from every session, so one record a pump leaves the inbox growing without
        end and a new reply waiting behind other replies' text for seconds.
        """
        try:
            items = [self.inbox.get(timeout=timeout)[2]]
        except queue.Empty:
            return []
        while len(items) < self.records_a_pump:
            try:
                items.append(self.inbox.get_nowait()[2])
            except queue.Empty:
                break
        return items

    def pump(self) -> float | None:
        """Work that is not driven by a record (pacing): do a slice of it; return in how many
        seconds to come back (0: at once), or None when there is none."""
        return None
