"""loadtest.service: what a benchmark starts does not outlive the benchmark."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import select
import signal
import subprocess
import sys

from loadtest.service import ctrl_c_when_parent_dies

# Stands in for `omni-gateway start`, which shuts down cleanly on Ctrl-C.
SERVICE = (
    "import time\ntry:\n    time.sleep(120)\nexcept KeyboardInterrupt:\n    raise SystemExit(130)"
)


def _start_service(conn) -> None:
    """A benchmark: starts the service as loadtest.service.Service does, reports its pid."""
    service = subprocess.Popen(
        [sys.executable, "-c", SERVICE],
        start_new_session=True,
        preexec_fn=ctrl_c_when_parent_dies,
    )
    conn.send(service.pid)
    service.wait()


def test_the_service_gets_ctrl_c_when_the_benchmark_that_started_it_is_killed() -> None:
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    benchmark = ctx.Process(target=_start_service, args=(writer,))
    benchmark.start()
    pid = None
    try:
        assert reader.poll(30), "the stand-in benchmark did not start its service"
        pid = reader.recv()
        service = os.pidfd_open(pid)  # to wait for a process that is not our child
        os.kill(benchmark.pid, signal.SIGKILL)  # no finally, no atexit: only the kernel acts
        readable, _, _ = select.select([service], [], [], 20)
        os.close(service)
        assert readable, "the service outlived the benchmark that started it"
    finally:
        benchmark.kill()
        benchmark.join(10)
        if pid is not None:  # the test failed: do not leave the stand-in sleeping
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
