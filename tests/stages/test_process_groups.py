"""stages.process_groups: what a stage started is ended with it, by the supervisor that saw
it die or, if that supervisor was killed too, by the next one to start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from stages.process_groups import StageGroups, members

pytestmark = pytest.mark.timeout(60)

# A stand-in for a stage: leads its own group, starts a child that outlives it (as vLLM's
# engine core outlives a stage killed outright), prints both pids, waits to be killed.
STAGE = textwrap.dedent(
    """
    import multiprocessing as mp, sys, time
    from stages.process_groups import own_group

    def engine():
        time.sleep(600)

    if __name__ == "__main__":
        own_group()
        child = mp.get_context("fork").Process(target=engine, daemon=False)
        child.start()
        print(child.pid, flush=True)
        time.sleep(600)
    """
)

# A stand-in supervisor: records the stage's group as the real one does, then waits.
SUPERVISOR = textwrap.dedent(
    f"""
    import subprocess, sys, time
    from stages.process_groups import StageGroups

    groups = StageGroups()
    stage = subprocess.Popen([sys.executable, "-c", {STAGE!r}], stdout=subprocess.PIPE, text=True)
    groups.record(stage.pid)
    print(stage.pid, stage.stdout.readline().strip(), flush=True)
    time.sleep(600)
    """
)


def gone(pid: int, within_s: float = 10) -> bool:
    deadline = time.monotonic() + within_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(") ", 1)[1][0] == "Z":
                    return True  # dead, waiting for its reaper
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)  # polling the kernel's process table


def start(script: str) -> tuple[subprocess.Popen, list[int]]:
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    return proc, [int(p) for p in proc.stdout.readline().split()]


def test_a_dead_stages_group_is_ended_by_its_supervisor() -> None:
    groups = StageGroups()
    stage, (engine,) = start(STAGE)
    try:
        groups.record(stage.pid)
        assert set(members(stage.pid)) == {stage.pid, engine}
        stage.kill()
        stage.wait(10)
        assert not gone(engine, 0.5), "the stand-in engine should outlive its stage"
        groups.end(stage.pid, "encoder")
        assert gone(engine)
    finally:
        groups.close()
        for pid in (stage.pid, engine):
            if not gone(pid, 0):
                os.kill(pid, signal.SIGKILL)
        stage.stdout.close()


def test_the_next_supervisor_ends_what_a_killed_one_left() -> None:
    supervisor, (stage, engine) = start(SUPERVISOR)
    try:
        supervisor.kill()  # no cleanup runs: the stage and its child go on
        supervisor.wait(10)
        os.kill(stage, signal.SIGKILL)
        assert gone(stage) and not gone(engine, 0.5)
        StageGroups().close()  # a new supervisor starts (and stops)
        assert gone(engine), "the next supervisor left the orphan running"
    finally:
        for pid in (stage, engine):
            if not gone(pid, 0):
                os.kill(pid, signal.SIGKILL)
        supervisor.stdout.close()
