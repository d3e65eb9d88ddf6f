"""`omni-gateway start` run as a user runs it, for benchmarks and tests: its own process group,
its log read as it comes, stopped with Ctrl-C, and by the kernel if whoever started it dies."""

from __future__ import annotations

import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from stages.process_groups import kill_session

ROOT = Path(__file__).parents[1]
CLI = [sys.executable, "-m", "gateway.cli"]
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# loaded now: a child between fork and exec must not import or load anything
_libc = ctypes.CDLL(None, use_errno=True)
_libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
_libc.signal.restype = ctypes.c_void_p
_SIG_DFL = 0


def ctrl_c_when_parent_dies() -> None:
    """In a child before it execs: the kernel sends it SIGINT when the thread that started it
    ends, however that ends (a benchmark killed by `timeout` or SIGKILL runs no `finally`).
    A service started in a process group of its own would otherwise run on, and keep its
    shared memory, after the benchmark that started it is gone. Start services from the main
    thread: a worker thread's end would stop them too.

    SIGINT is also set back to its default action: a benchmark run as a background job
    inherits it ignored, and so would the service (Python then installs no Ctrl-C handler)."""
    if _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGINT, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    _libc.signal(signal.SIGINT, _SIG_DFL)


class Service:
    """`omni-gateway start --config CONFIG --port 0`; `wait_for` reads its log."""

    def __init__(
        self, config: Path, *, echo: bool = False, env: Mapping[str, str] | None = None
    ) -> None:
        """`env`: variables set for the service beside this process's environment."""
        self.echo = echo
        self.proc = subprocess.Popen(
            [*CLI, "start", "--config", str(config), "--port", "0"],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env={**os.environ, **env} if env else None,
            start_new_session=True,
            preexec_fn=ctrl_c_when_parent_dies,
        )
        self.lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.put(line)
            if self.echo and (line.startswith("omni-gateway:") or "event loop held" in line):
                print(line, end="", file=sys.stderr, flush=True)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first log line from now on that matches `pattern`; TimeoutError (with the
        last lines of the log) when none does within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if match := re.search(pattern, line):
                return match
        tail = "".join(self.seen[-30:])
        raise TimeoutError(f"no log line matching {pattern!r} in {timeout:.0f} s:\n{tail}")

    def started(self, timeout: float = 600) -> tuple[str, dict[str, int]]:
        """Wait until it serves: (base URL, pid of each gateway process). The first process
        ('gateway') also runs the supervisor."""
        pids = {"gateway": self.proc.pid}
        while True:
            match = self.wait_for(
                r"(gateway\.\d+) listening \(pid (\d+)\)|gateway listening on (http://[0-9.:]+)",
                timeout,
            )
            if match[3]:
                return match[3], pids
            pids[match[1]] = int(match[2])

    def stop(self, timeout: float = 60) -> int:
        """Ctrl-C; its exit code."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """Kill all it started that still runs (its session: the stages lead process groups
        of their own); close the log."""
        kill_session(self.proc.pid)
        self.proc.wait()
        self._reader.join(10)  # the log ends with the process
        assert self.proc.stderr is not None
        self.proc.stderr.close()

    def log_tail(self, lines: int = 80) -> str:
        """The last `lines` lines of its log so far, read or not by `wait_for`."""
        while True:
            try:
                self.seen.append(self.lines.get_nowait())
            except queue.Empty:
                return "".join(self.seen[-lines:])

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
