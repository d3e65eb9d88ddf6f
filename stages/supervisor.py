"""Starts the stage processes on a fresh set of rings, watches them, restarts the dead.

The supervisor's process owns every segment: it reaps what a crashed predecessor left, and
unlinks everything on stop, at exit, or after an error during start-up.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from shm import reap_stale
from stages.bridge import DEFAULT_TIMING, LinkTiming
from stages.config import PipelineConfig
from stages.crossing import CrossingLinks, close_sessions, fail_served_sessions
from stages.mps import MpsDaemon, client_env
from stages.placement import StagePlacement, plan, wants_gpus
from stages.process_groups import StageGroups
from stages.rings import STAGES, RingNames, RingSet, role_of
from stages.stage_process import StageSpec, stage_main

logger = logging.getLogger(__name__)
_ctx = mp.get_context("spawn")  # vLLM and CUDA need spawn; it is also the portable choice

Progress = Callable[[str], None]


class StageStartError(RuntimeError):
    """A stage did not become ready; the message names the stage and why."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(f"stage {stage!r} failed to start: {reason}")
        self.stage = stage
        self.reason = reason


@dataclass
class StageProcess:
    name: str
    process: Any = None  # multiprocessing.Process
    conn: Any = None  # the parent's end of its status pipe
    info: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    restarts: int = 0
    failed_restarts: int = 0


def terminate(procs: list[Any], timeout_s: float) -> None:
    """SIGTERM each process, wait for all of them up to `timeout_s`, kill the stragglers.
    One never started (its start failed) is passed over."""
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            logger.warning("%s did not stop in time; killing it", p.name)
            p.kill()
            p.join(5)


class Supervisor:
    """Runs the encoder, reasoning and vocoder stages of one pipeline.

    `start()` blocks until all three are ready (or raises StageStartError, leaving nothing
    behind); a watcher thread then restarts a stage that dies, after cancelling the open
    sessions and pushing an ERROR record for each into that stage's ring to the gateway.
    """

    def __init__(
        self,
        config: PipelineConfig,
        *,
        log_level: int = logging.INFO,
        on_restart: Callable[[str, int], None] | None = None,
        gateways: int = 1,
        names: RingNames | None = None,
        link_address: str = "127.0.0.1",
        link_timing: LinkTiming = DEFAULT_TIMING,
    ) -> None:
        """`gateways`: how many gateway processes will attach (each gets its own rings).
        `names`: a pipeline placed across hosts (`RingNames.placed`), seen from this
        supervisor's host: only the stages on it are run here, and the links that cross to
        other hosts are received on `link_address` (`open_links`, then `links.connect`), live
        by `link_timing`."""
        self.config = config
        self.log_level = log_level
        self.names = names or RingNames.of(config, gateways)
        self.link_address, self.link_timing = link_address, link_timing
        self.rings: RingSet | None = None
        self.links: CrossingLinks | None = None
        # by instance: 'encoder', 'reasoning', 'vocoder' and the vocoder's replicas, on this host
        self.stages = {name: StageProcess(name) for name in self.names.stages_here}
        self.placements: dict[str, StagePlacement] = {}
        self.mps: MpsDaemon | None = None
        self.on_restart = on_restart
        self.groups: StageGroups | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- start -----------------------------------------------------------------------------

    def start(self, progress: Progress | None = None) -> None:
        progress = progress or (lambda line: logger.info("%s", line))
        # an impossible layout fails here, naming the stage, before any segment or process
        self.placements = plan(self.config)
        if any(p.gpus is not None for p in self.placements.values()):
            for placement in self.placements.values():
                progress(f"placement: {placement.describe()}")
        if reaped := reap_stale():
            progress(f"reaped {len(reaped)} shared-memory segments left by a dead process")
        self.groups = StageGroups()  # ends what the stages of a killed supervisor left
        try:
            self.open_links()
            if self.config.gpu_sharing == "mps":
                self._start_mps(progress)
            for stage in self.stages.values():
                self._spawn(stage)
            self._wait_ready(list(self.stages.values()), progress)
        except BaseException:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, name="stage-watcher", daemon=True)
        self._watcher.start()

    def open_links(self) -> dict[tuple[str, str], str]:
        """This host's segments, and the receiving ends of the links into it from other hosts
        (their endpoints, returned, are what the other hosts' `links.connect` needs)."""
        if self.rings is None:
            self.rings = RingSet(self.names, self.config)
        if self.links is None and self.names.hosts:
            self.links = CrossingLinks(self.names, self.rings, self.link_address, self.link_timing)
        return self.links.endpoints if self.links is not None else {}

    def _start_mps(self, progress: Progress) -> None:
        """Run a CUDA MPS daemon for the stages and point every stage process at it."""
        if not wants_gpus(self.config):
            progress("gpu_sharing: mps has nothing to share: no stage is placed on a GPU")
            return
        self.mps = MpsDaemon.start()
        progress(f"gpu sharing: CUDA MPS (control daemon pid {self.mps.process.pid})")
        shares, low = self.config.experiments.mps_thread_percent, self.config.mps_low_priority
        self.placements = {
            role: replace(
                p, env={**p.env, **self.mps.env, **client_env(shares.get(role), role in low)}
            )
            for role, p in self.placements.items()
        }
        if low:
            progress("MPS: " + ", ".join(low) + " scheduled below the other stages")
        if shares:
            progress(
                "MPS SM caps: "
                + ", ".join(f"{r} {v}%" for r, v in shares.items())
                + " (an experiment: the caps make replies late; docs/gpu.md)"
            )

    def _spawn(self, stage: StageProcess) -> None:
        parent, child = _ctx.Pipe(duplex=False)
        spec = StageSpec(
            stage.name,
            self.names,
            self.config.model_dump(include=set(PipelineConfig.model_fields)),
            self.log_level,
            self.placements[role_of(stage.name)].env,
        )
        stage.process = _ctx.Process(
            target=stage_main, args=(spec, child), name=f"omni-{stage.name}", daemon=False
        )
        try:
            stage.process.start()
        except BaseException:
            parent.close()
            child.close()
            raise
        assert self.groups is not None and stage.process.pid is not None
        self.groups.record(stage.process.pid)  # it leads its own group (stage_main)
        child.close()
        stage.conn, stage.ready, stage.info = parent, False, {}

    def _wait_ready(self, pending: list[StageProcess], progress: Progress) -> None:
        t0 = time.monotonic()
        timeout = self.config.supervisor.ready_timeout_s
        last_report = t0
        waiting = {s.conn: s for s in pending}
        sentinels = {s.process.sentinel: s for s in pending}
        while waiting:
            elapsed = time.monotonic() - t0
            if elapsed > timeout:
                names = ", ".join(sorted(s.name for s in waiting.values()))
                raise StageStartError(names, f"not ready after {timeout:.0f} s")
            ready = mp.connection.wait([*waiting, *sentinels], timeout=min(2.0, timeout))
            for obj in ready:
                if obj in waiting:
                    stage = waiting[obj]
                    try:
                        status, detail = obj.recv()
                    except EOFError:
                        status, detail = "failed", "exited before reporting"
                    if status != "ready":
                        raise StageStartError(stage.name, detail)
                    stage.ready, stage.info = True, detail
                    del waiting[obj]
                    del sentinels[stage.process.sentinel]
                    progress(
                        f"{stage.name} ready in {time.monotonic() - t0:.1f} s "
                        f"({', '.join(f'{k}={v}' for k, v in detail.items())})"
                    )
                elif obj in sentinels and sentinels[obj].conn in waiting:
                    stage = sentinels[obj]
                    if not stage.conn.poll():  # died without a word
                        stage.process.join(1)
                        raise StageStartError(
                            stage.name, f"process exited with code {stage.process.exitcode}"
                        )
            if waiting and time.monotonic() - last_report >= 5:
                last_report = time.monotonic()
                names = ", ".join(sorted(s.name for s in waiting.values()))
                progress(f"loading models: waiting for {names} ({time.monotonic() - t0:.0f} s)")

    # -- watch and restart -----------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return all(s.ready and s.process.is_alive() for s in self.stages.values())

    def stage_info(self, instance: str) -> dict[str, Any]:
        """What stage `instance` said of itself when ready (the vocoder's sample rate...)."""
        return self.stages[instance].info

    def _watch(self) -> None:
        while not self._stopping.is_set():
            sentinels = {s.process.sentinel: s for s in self.stages.values()}
            # a stage about to exit says so first (stages.stage.Stage.cannot_serve)
            conns = {s.conn: s for s in self.stages.values() if s.conn is not None and s.ready}
            woken = mp.connection.wait([*sentinels, *conns], timeout=0.5)
            for obj in woken:
                if self._stopping.is_set():
                    return
                if obj in conns:
                    self._heard(conns[obj])
            for obj in woken:
                if obj in sentinels:
                    self._restart(sentinels[obj])

    def _heard(self, stage: StageProcess) -> None:
        assert stage.conn is not None
        try:
            kind, detail = stage.conn.recv()
        except (EOFError, OSError):  # it died: its sentinel says so too
            stage.conn.close()
            stage.conn = None
            return
        if kind == "cannot_serve":
            stage.ready = False
            logger.error("stage %s cannot serve: %s", stage.name, detail)

    def _restart(self, stage: StageProcess) -> None:
        stage.process.join(1)
        code = stage.process.exitcode
        assert self.groups is not None
        self.groups.end(stage.process.pid, stage.name)  # vLLM's engine core, if it outlived it
        stage.ready = False
        logger.error(
            "stage %s (pid %s) died with exit code %s; restarting",
            stage.name,
            stage.process.pid,
            code,
        )
        self._fail_open_sessions(
            stage.name,
            f"the {stage.name} stage died (exit code {code}) "
            "and is being restarted; the current turn was lost",
        )
        while not self._stopping.is_set():
            if stage.failed_restarts > self.config.supervisor.max_restarts:
                logger.error(
                    "stage %s failed to restart %d times; giving up",
                    stage.name,
                    stage.failed_restarts,
                )
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                self._spawn(stage)
            try:
                self._wait_ready([stage], lambda line: logger.info("restart: %s", line))
            except StageStartError as exc:
                stage.failed_restarts += 1
                logger.error("%s", exc)
                stage.process.join(5)
                if self._stopping.wait(min(30.0, 0.5 * 2**stage.failed_restarts)):  # back off
                    return
                continue
            stage.restarts += 1
            stage.failed_restarts = 0
            if self.on_restart:
                self.on_restart(stage.name, stage.restarts)
            return

    def _fail_open_sessions(self, stage: str, message: str) -> None:
        """Cancel every open session the dead stage instance served and tell the gateway,
        through that instance's own ring (its producer is dead, so the supervisor may push
        there until the restart)."""
        assert self.rings is not None
        for gateway in self.names.gateways:
            ring = self.rings.rings[(stage, gateway)]
            opened = self.links.opened(gateway, stage) if self.links is not None else None
            fail_served_sessions(
                self.names, self.rings.control, ring, stage, gateway, message, opened
            )

    def release_gateway_sessions(self, instance: str, pid: int, reason: str) -> list[int]:
        """Gateway process `instance` (pid `pid`) died: close each session it held in every
        stage (the reasoning stage aborts its request, freeing its KV blocks) and free the
        ids. Pushed into that process's own rings, whose producer is gone; returns the ids."""
        assert self.rings is not None
        control = self.rings.control
        closed = []
        for session in self.names.sessions_of(instance, control.max_sessions):
            if control.holder(session) != pid:
                continue
            control.cancel(session)
            for role in STAGES:
                stage = self.names.instance_for(role, session)
                close_sessions(
                    self.rings.rings[(instance, stage)], instance, stage, [session], reason
                )
            control.close_session(session)
            closed.append(session)
        return closed

    # -- stop ------------------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM every stage, wait for them, kill stragglers, unlink every segment.
        Safe to call twice."""
        self._stopping.set()
        with self._lock:
            terminate(
                [s.process for s in self.stages.values() if s.process is not None],
                self.config.supervisor.stop_timeout_s,
            )
            for s in self.stages.values():
                if s.conn is not None:
                    s.conn.close()
                    s.conn = None
            if self.groups is not None:  # what a stage started and did not stop
                self.groups.close()
                self.groups = None
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(2)
        if self.links is not None:  # before the rings they pop and push
            self.links.stop()
            self.links = None
        if self.rings is not None:
            self.rings.close()
            self.rings = None
        if self.mps is not None:  # after the stages: their contexts go first
            self.mps.stop()
            self.mps = None

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
