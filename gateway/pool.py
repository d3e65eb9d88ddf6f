"""The gateway processes beyond the first (`gateway.processes`): started by `omni-gateway start`
next to the supervisor once the stages are ready, each serving the public port (SO_REUSEPORT)
on its own rings and session ids, restarted when one dies.

A dead gateway process takes its calls with it, and only those: the supervisor closes their
sessions in every stage (their vLLM requests aborted) and frees their ids before the process
is started again; the other processes' calls go on.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import multiprocess

from gateway.gateway_process import GatewayProcessSpec, gateway_process_main
from stages.supervisor import Supervisor, terminate

logger = logging.getLogger(__name__)
_ctx = mp.get_context("spawn")

START_TIMEOUT_S = 60.0
READY_POLL_S = 0.5  # how often the processes' view of the stages' health is refreshed


@dataclass
class _Worker:
    instance: str
    process: Any = None
    started: float = 0.0
    quick_deaths: int = 0


class GatewayPool:
    """Starts, watches and stops the extra gateway processes; `ready` is the stages' health
    as they all see it."""

    def __init__(
        self,
        supervisor: Supervisor,
        spec_for: Callable[[str], GatewayProcessSpec],
        progress: Callable[[str], None],
    ) -> None:
        self.supervisor = supervisor
        self.spec_for = spec_for
        self.progress = progress
        self.ready = _ctx.Value("b", 0, lock=False)
        self.workers = {g: _Worker(g) for g in supervisor.names.gateways[1:]}
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> None:
        """Spawn every process and wait until each listens; RuntimeError names one that
        did not (the others are stopped)."""
        self.ready.value = self.supervisor.healthy
        try:
            for worker in self.workers.values():
                self._spawn(worker)
        except BaseException:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, name="gateway-pool", daemon=True)
        self._watcher.start()

    def _spawn(self, worker: _Worker) -> None:
        parent, child = _ctx.Pipe(duplex=False)
        worker.process = _ctx.Process(
            target=gateway_process_main,
            args=(self.spec_for(worker.instance), self.ready, child),
            name=f"omni-{worker.instance}",
        )
        worker.process.start()
        worker.started = time.monotonic()
        child.close()
        try:
            if not parent.poll(START_TIMEOUT_S):
                worker.process.kill()
                raise RuntimeError(
                    f"gateway process {worker.instance} did not start listening within "
                    f"{START_TIMEOUT_S:.0f} s"
                )
            status = parent.recv()
        except EOFError:
            worker.process.join(5)
            raise RuntimeError(
                f"gateway process {worker.instance} exited while starting "
                f"(code {worker.process.exitcode})"
            ) from None
        finally:
            parent.close()
        self.progress(f"{worker.instance} listening (pid {status['pid']})")

    def _watch(self) -> None:
        while not self._stopping.is_set():
            sentinels = {w.process.sentinel: w for w in self.workers.values()}
            dead = mp.connection.wait(list(sentinels), timeout=READY_POLL_S)
            self.ready.value = self.supervisor.healthy
            for sentinel in dead:
                if self._stopping.is_set():
                    return
                self._restart(sentinels[sentinel])

    def _restart(self, worker: _Worker) -> None:
        pid, code = worker.process.pid, worker.process.exitcode
        closed = self.supervisor.release_gateway_sessions(
            worker.instance, pid, "gateway_process_died"
        )
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # its live gauges stop counting
            multiprocess.mark_process_dead(pid)
        logger.error(
            "gateway process %s (pid %d) died with exit code %s; closed its %d session(s); "
            "restarting it",
            worker.instance,
            pid,
            code,
            len(closed),
        )
        # one that dies at once, again and again, is restarted less and less often
        quick = time.monotonic() - worker.started < 10
        worker.quick_deaths = worker.quick_deaths + 1 if quick else 0
        if worker.quick_deaths and self._stopping.wait(min(30.0, 0.5 * 2**worker.quick_deaths)):
            return
        try:
            self._spawn(worker)
        except RuntimeError as exc:
            logger.error("%s", exc)  # the watcher sees it dead and tries again

    def stop(self) -> None:
        """SIGTERM every process, wait for them, kill stragglers. Safe to call twice."""
        self._stopping.set()
        terminate([w.process for w in self.workers.values() if w.process is not None], 10.0)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(2)
