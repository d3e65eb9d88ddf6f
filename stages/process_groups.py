"""Each stage process leads a process group of its own, which the processes it starts (vLLM's
engine core and workers, a tokenizer pool) join. A stage that dies therefore leaves a group
the supervisor can end whole, and the groups of a supervisor that was killed outright are
written down where the next one to start finds and ends them (`StageGroups`).

Only processes that are ours are signalled: Python multiprocessing children and vLLM's own
(a group id a recycled pid took over is left alone).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
from pathlib import Path

from stages.rundir import owned_folder

logger = logging.getLogger(__name__)

PREFIX = "omni-stages-"
_OURS = (b"multiprocessing", b"VLLM::", b"vllm", b"omni-gateway", b"stages.")


def own_group() -> None:
    """Make this process the leader of a new process group (a stage, first thing)."""
    with contextlib.suppress(PermissionError):  # already a group or session leader
        os.setpgid(0, 0)


def _live(field: int, value: int, ours_only: bool) -> list[int]:
    """Live processes whose stat `field` (2: process group, 3: session) is `value`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_bytes()
            cmdline = (proc / "cmdline").read_bytes() if ours_only else b""
        except OSError:
            continue
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) <= field or int(fields[field]) != value or fields[0] == b"Z":
            continue
        if not ours_only or any(mark in cmdline or mark in stat for mark in _OURS):
            found.append(int(proc.name))
    return found


def members(pgid: int) -> list[int]:
    """The live processes of group `pgid` that are ours."""
    return _live(2, pgid, ours_only=True)


def session_members(sid: int) -> list[int]:
    """Every live process of session `sid`: a command started in a session of its own
    (start_new_session) and all it started, whichever group each leads."""
    return _live(3, sid, ours_only=False)


def kill_session(sid: int) -> list[int]:
    """SIGKILL every process of session `sid`; the pids."""
    left = session_members(sid)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


def end_group(pgid: int) -> list[int]:
    """SIGKILL what is left of a stage's group (the stage itself may be gone); the pids."""
    left = [pid for pid in members(pgid) if pid != os.getpid()]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


class StageGroups:
    """The groups of one supervisor's stages, on record until they are ended."""

    def __init__(self) -> None:
        _end_orphaned_groups()  # before owned_folder, which removes dead owners' folders
        self.folder = owned_folder(PREFIX)

    def record(self, pgid: int) -> None:
        (self.folder / str(pgid)).touch()

    def end(self, pgid: int, name: str) -> None:
        """The stage that led `pgid` is gone: end what it started."""
        if left := end_group(pgid):
            logger.warning("%s left %d processes running (%s): killed", name, len(left), left)
        (self.folder / str(pgid)).unlink(missing_ok=True)

    def close(self) -> None:
        for entry in self.folder.iterdir():
            if entry.name.isdigit():
                end_group(int(entry.name))
        shutil.rmtree(self.folder, ignore_errors=True)


def _end_orphaned_groups() -> None:
    """The groups a supervisor that died without stopping its stages left on record."""
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        owner = folder.name.removeprefix(PREFIX).split("-", 1)[0]
        if not owner.isdigit() or int(owner) == os.getpid() or Path(f"/proc/{owner}").exists():
            continue
        for entry in folder.iterdir():
            if entry.name.isdigit() and (left := end_group(int(entry.name))):
                logger.warning(
                    "a stage of a supervisor that died (pid %s) left %d processes: killed %s",
                    owner,
                    len(left),
                    left,
                )
        shutil.rmtree(folder, ignore_errors=True)
