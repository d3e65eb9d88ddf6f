"""A stage whose supervisor is killed outright stops by itself: nothing is left running."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from stages.config import PipelineConfig
from stages.rings import RingNames, RingSet

pytestmark = pytest.mark.timeout(90)

# A stand-in supervisor: starts a real encoder stage process on the test's rings, prints its
# pid once it is ready, then waits to be killed.
SUPERVISOR = textwrap.dedent(
    """
    import multiprocessing as mp, sys, time
    from stages.rings import RingNames
    from stages.stage_process import StageSpec, stage_main

    if __name__ == "__main__":
        names = RingNames(sys.argv[1])
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        spec = StageSpec("encoder", names, {"encoder": {"backend": "pocketsphinx"}})
        proc = ctx.Process(target=stage_main, args=(spec, child))
        proc.start()
        status, info = parent.recv()
        print(status, proc.pid, flush=True)
        time.sleep(600)
    """
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purpose; it waits for its (dead) parent's reaper
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_stage_stops_when_its_supervisor_is_killed() -> None:
    names = RingNames.fresh()
    rings = RingSet(names, PipelineConfig())
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, names.prefix],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        status, pid = supervisor.stdout.readline().split()
        assert status == "ready"
        stage = int(pid)
        exited = os.pidfd_open(stage)  # readable once the stage process has exited
        try:
            assert alive(stage)
            os.kill(supervisor.pid, signal.SIGKILL)
            supervisor.wait(10)
            readable, _, _ = select.select([exited], [], [], 10)
            assert readable, "the stage outlived its supervisor"
        finally:
            if alive(stage):  # the test failed: leave nothing running all the same
                os.kill(stage, signal.SIGKILL)
            os.close(exited)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait(10)
        supervisor.stdout.close()
        rings.close()
