"""A private CUDA MPS control daemon for stages that share a GPU.

Without MPS, CUDA time-slices a GPU between processes: while vLLM and the vocoder keep it busy,
each of Whisper's hundreds of small kernels waits for its process's turn, and a final decode
takes several times as long (docs/benchmarks.md). Under MPS the stages' kernels run side by
side in one hardware context instead.

The supervisor runs the daemon in the foreground as its child, with its pipe and log folders in
a private temporary folder: stage processes find it through CUDA_MPS_PIPE_DIRECTORY, other
users' CUDA programs on the machine never do, and the daemon dies with the supervisor (parent
death signal) instead of outliving a crash.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from stages.rundir import owned_folder

logger = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
START_TIMEOUT_S = 10.0
QUIT_TIMEOUT_S = 10.0
_PR_SET_PDEATHSIG = 1
PREFIX = "omni-mps-"  # then the owner's pid: a folder whose owner died is removed at next start


def client_env(percent: int | None = None, low_priority: bool = False) -> dict[str, str]:
    """The environment of one stage's MPS client processes.

    `percent` caps its kernels at that share of the GPU's SMs (None: no cap). A cap, not a
    reservation: the stages' caps may add up to more than 100. The idea was to leave SMs free
    for Whisper's small kernels by capping the stages that keep the GPU busy; the caps make
    replies seconds late instead (docs/benchmarks.md), so none is set by default.

    `low_priority` makes it a below-normal client: the MPS server gives its streams a lower
    priority than the normal clients', so the GPU schedules their waiting kernels first. A
    hint for ordering, not preemption of kernels already running (NVIDIA's MPS documentation,
    CUDA_MPS_CLIENT_PRIORITY).
    """
    env = {} if percent is None else {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent)}
    if low_priority:
        env["CUDA_MPS_CLIENT_PRIORITY"] = "1"
    return env


class MpsError(RuntimeError):
    """The MPS control daemon could not be started (the message says why)."""


def _die_with_parent() -> None:  # in the child, between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class MpsDaemon:
    """`MpsDaemon.start()` runs a control daemon; `env` is what a stage process needs to use
    it; `stop()` quits it (its server and clients' contexts with it) and removes its folder."""

    def __init__(self, folder: Path, process: subprocess.Popen[bytes], control: str) -> None:
        self.folder = folder
        self.process = process
        self._control = control

    @property
    def env(self) -> dict[str, str]:
        return {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.folder / "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": str(self.folder / "log"),
        }

    @classmethod
    def start(cls, control: str = CONTROL) -> MpsDaemon:
        path = shutil.which(control)
        if path is None:
            raise MpsError(
                f"gpu_sharing is 'mps' but {control} is not on PATH (it comes with the NVIDIA "
                "driver); install it or set gpu_sharing: time-slice"
            )
        folder = owned_folder(PREFIX)
        (folder / "pipe").mkdir()
        (folder / "log").mkdir()
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe")}
        env["CUDA_MPS_LOG_DIRECTORY"] = str(folder / "log")
        try:
            process = subprocess.Popen(
                [path, "-f"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            shutil.rmtree(folder, ignore_errors=True)
            raise MpsError(f"could not run {path}: {exc}") from exc
        daemon = cls(folder, process, path)
        try:
            daemon._wait_listening()
        except BaseException:
            daemon.stop()
            raise
        logger.info("gpu sharing: MPS control daemon (pid %d) in %s", process.pid, folder)
        return daemon

    def _wait_listening(self) -> None:
        """Until the daemon's control pipe exists: a stage started earlier would not find it
        and silently run without MPS."""
        deadline = time.monotonic() + START_TIMEOUT_S
        pipe = self.folder / "pipe"
        while not any(pipe.iterdir()):
            if self.process.poll() is not None:
                err = self.process.communicate()[1].decode(errors="replace").strip()
                raise MpsError(f"{CONTROL} exited with status {self.process.returncode}: {err}")
            if time.monotonic() > deadline:
                raise MpsError(f"{CONTROL} made no control pipe in {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    def stop(self) -> None:
        """Quit the daemon (after its clients are gone), then remove its folder; idempotent."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run(
                    [self._control],
                    input=b"quit\n",
                    env={**os.environ, **self.env},
                    capture_output=True,
                    timeout=QUIT_TIMEOUT_S,
                )
            try:
                self.process.wait(QUIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("MPS control daemon did not quit; killing it")
                self.process.kill()
                self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)
