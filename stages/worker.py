"""What every stage process shares: attaching its rings, reader threads, acks and errors.

A stage process runs `stage_main`. Reader threads own the input rings (one each); the model
loop owns the model. Records of a cancelled epoch never reach the model loop's hands: the ring
drops what was queued at the time of the cancel, and `is_stale` drops what the reader had
already passed on.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from shm import PeerDiedError, Record, epoch_older
from stages import placement
from stages.config import PipelineConfig
from stages.messages import BadRecord, CancelAck, Error, Kind, Msg, decode
from stages.rings import GATEWAY, RingNames, attach_ends, made_stale, role_of

logger = logging.getLogger(__name__)

POP_TIMEOUT_S = 0.25  # how often an idle reader looks at the stop flag
PARENT_CHECK_S = 0.5  # how often a stage checks that its supervisor is alive


@dataclass(frozen=True)
class StageSpec:
    """What a stage process is started with (picklable for spawn)."""

    stage: str  # the instance: 'vocoder', or 'vocoder.1' for a replica
    names: RingNames
    config: dict[str, Any]
    log_level: int = logging.INFO
    # set first thing in the process (its GPUs, NVLink multicast off); see stages.placement
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Inbound:
    """A decoded record, as a reader thread hands it to the model loop."""

    src: str
    kind: Kind
    session: int
    epoch: int
    t_ns: int
    msg: Any  # a messages.Msg, or bytes for audio


def ends_state(item: Inbound, epoch: int) -> bool:
    """Whether a SESSION_OPEN, SESSION_CLOSE or CANCEL `item` ends a session's state (a turn,
    a reply) begun in `epoch`.

    A session's records reach a stage on several rings (a reply's start from reasoning, the
    session's open and cancels from the gateway), and reader threads race: the new holder of a
    session id, or the reply a client asks for right after its cancel, can be handled before
    the open or the cancel that came first. Those bump the epoch before they are sent, so an
    open or a cancel ends only state of an older epoch, and a close what began up to its own.
    """
    if item.kind is Kind.SESSION_CLOSE:
        return not epoch_older(item.epoch, epoch)
    return epoch_older(epoch, item.epoch)


class Stage:
    """Base of the encoder, reasoning and vocoder stages."""

    name = "stage"

    def __init__(self, spec: StageSpec, stop: threading.Event) -> None:
        self.spec = spec
        self.config = PipelineConfig.model_validate(spec.config)
        self.stop = stop
        self.control, self.inputs, self.outputs = attach_ends(spec.names, spec.stage)
        self._readers: list[threading.Thread] = []

    # -- lifecycle, overridden by stages --------------------------------------------------

    def load(self) -> dict[str, Any]:
        """Load models; return facts for the supervisor (e.g. the output sample rate)."""
        return {}

    def run(self) -> None:
        """The model loop; returns when `self.stop` is set."""
        raise NotImplementedError

    def deliver(self, item: Inbound) -> None:
        """Called on a reader thread for every record that is not stale."""
        raise NotImplementedError

    def close(self) -> None:
        for t in self._readers:
            t.join(2 * POP_TIMEOUT_S + 1)
        for ring in self.inputs.values():
            ring.close()
        for out in self.outputs.values():
            out.ring.close()
        self.control.close()

    # -- helpers ---------------------------------------------------------------------------

    def start_readers(self) -> None:
        for src, ring in self.inputs.items():
            t = threading.Thread(
                target=self._read, args=(src, ring), name=f"{self.name}<-{src}", daemon=True
            )
            t.start()
            self._readers.append(t)

    def _read(self, src: str, ring: Any) -> None:
        while not self.stop.is_set():
            try:
                rec: Record | None = ring.pop(timeout=POP_TIMEOUT_S)
            except PeerDiedError as exc:
                logger.warning("%s: %s; waiting for it to be restarted", self.name, exc)
                continue
            if rec is None:
                continue
            try:
                msg = decode(rec.kind, rec.payload)
            except BadRecord as exc:
                self.error(rec.session, "bad_record", f"from {src}: {exc}")
                continue
            try:
                self.deliver(Inbound(src, Kind(rec.kind), rec.session, rec.epoch, rec.t_ns, msg))
            except Exception as exc:  # one bad record must not stop the reader
                logger.exception("%s: handling %s from %s failed", self.name, rec.kind, src)
                self.error(rec.session, "internal_error", f"{type(exc).__name__}: {exc}")

    def is_stale(self, item: Inbound) -> bool:
        """True when the session was cancelled (or closed) after `item` was pushed; records
        that manage sessions, cancels and final transcripts never are (survives_cancel)."""
        return made_stale(item.kind, item.msg, item.epoch, self.control.epoch(item.session))

    def send(self, dst: str, session: int, msg: Msg, *, epoch: int | None = None) -> None:
        """Send to the instance of role `dst` that serves `session`."""
        dst = self.spec.names.instance_for(dst, session)
        if not self.outputs[dst].send(session, msg, epoch=epoch):
            logger.error(
                "%s: ring to %s stayed full; dropped %s for session %d",
                self.name,
                dst,
                type(msg).__name__,
                session,
            )

    def ack(self, session: int, cancel_id: int, kv_usage: float | None = None) -> None:
        self.send(GATEWAY, session, CancelAck(cancel_id, self.name, time.monotonic_ns(), kv_usage))

    def error(self, session: int, code: str, message: str) -> None:
        logger.warning("%s: session %d: %s: %s", self.name, session, code, message)
        self.send(GATEWAY, session, Error(self.name, code, message))


class QueuedStage(Stage):
    """A stage whose model loop is one thread taking records from a priority inbox: session
    control and cancels jump the queue, stale records are dropped as they come up."""

    URGENT = frozenset({Kind.CANCEL, Kind.SESSION_OPEN, Kind.SESSION_CLOSE})
    #: records the loop handles between two pumps, at most (see `_take`)
    records_a_pump = 4096

    def __init__(self, spec: StageSpec, stop: threading.Event) -> None:
        super().__init__(spec, stop)
        self.inbox: queue.PriorityQueue[tuple[int, int, Inbound]] = queue.PriorityQueue()
        self._order = itertools.count()

    def deliver(self, item: Inbound) -> None:
        self.inbox.put((0 if item.kind in self.URGENT else 1, next(self._order), item))

    def run(self) -> None:
        timeout = POP_TIMEOUT_S
        while not self.stop.is_set():
            for item in self._take(timeout):
                if self.is_stale(item):
                    continue
                try:
                    self.handle(item)
                except Exception as exc:  # this session's turn fails; the others go on
                    logger.exception(
                        "%s: %s for session %d failed", self.name, item.kind.name, item.session
                    )
                    self.error(item.session, "internal_error", f"{type(exc).__name__}: {exc}")
            next_in = self.pump()
            timeout = POP_TIMEOUT_S if next_in is None else min(max(next_in, 0.0), POP_TIMEOUT_S)

    def _take(self, timeout: float) -> list[Inbound]:
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

    def handle(self, item: Inbound) -> None:
        raise NotImplementedError


def _stage_class(instance: str) -> type[Stage]:
    # imported here: each process loads only the models of its own stage
    name = role_of(instance)
    if name == "encoder":
        from stages.encoder import EncoderStage

        return EncoderStage
    if name == "reasoning":
        from stages.reasoning import ReasoningStage

        return ReasoningStage
    if name == "vocoder":
        from stages.vocoder import VocoderStage

        return VocoderStage
    raise ValueError(f"unknown stage {name!r}")


def _stop_without_supervisor(supervisor_pid: int, stop: threading.Event) -> None:
    """A supervisor killed outright (SIGKILL, OOM) cannot stop its stages: they notice it is
    gone (they are re-parented) and stop themselves, models and GPU memory included; its
    segments are reaped by the next supervisor to start."""
    while not stop.wait(PARENT_CHECK_S):
        if os.getppid() != supervisor_pid:
            logger.error("the supervisor (pid %d) is gone; stopping", supervisor_pid)
            stop.set()
            if not _running.is_set():  # still loading: nothing to close cleanly
                os._exit(1)


#: Set once the model loop runs (before that, a stage without a supervisor exits at once).
_running = threading.Event()


def stage_main(spec: StageSpec, conn: Connection) -> None:
    """Entry point of a stage process: load, report ready, run until SIGTERM."""
    # before anything can initialise CUDA: this process and its children see only its GPUs
    os.environ.update(spec.env)
    # stdout belongs to the command that started us (say-file --json prints there); model
    # libraries log to stdout, so point it, and their own child processes, at stderr
    sys.stdout.flush()
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    logging.basicConfig(
        level=spec.log_level,
        format=f"%(asctime)s {spec.stage}[%(process)d] %(levelname)s %(message)s",
    )
    stop = threading.Event()
    # Ctrl-C reaches the whole process group; the supervisor decides, and stops us by SIGTERM
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    # `kill -USR1 <pid>` prints every thread's stack to stderr: what a stuck stage is doing
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    threading.Thread(
        target=_stop_without_supervisor,
        args=(os.getppid(), stop),
        name="supervisor-watch",
        daemon=True,
    ).start()
    stage: Stage | None = None
    try:
        stage = _stage_class(spec.stage)(spec, stop)
        stage_config = getattr(stage.config, role_of(spec.stage))
        placement.apply_memory_share(
            getattr(stage_config, "device", "cpu"),
            getattr(stage_config, "gpu_memory_fraction", None),
        )
        info = stage.load()
        stage.start_readers()
        conn.send(("ready", {"pid": os.getpid(), **info, **placement.visible_report()}))
        _running.set()
        stage.run()
    except BaseException as exc:
        logger.error("%s failed: %s", spec.stage, "".join(traceback.format_exception(exc)))
        with contextlib.suppress(OSError):
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    finally:
        stop.set()
        if stage is not None:
            stage.close()
