"""SessionLanes: one session's jobs in order, sessions side by side, failures contained."""

from __future__ import annotations

import threading

import pytest

from stages.lanes import SessionLanes

pytestmark = pytest.mark.timeout(30)


def test_a_sessions_jobs_run_in_order() -> None:
    lanes = SessionLanes(4, "test")
    seen: list[int] = []
    for i in range(200):
        lanes.submit(7, lambda i=i: seen.append(i))
    lanes.close()
    assert seen == list(range(200))


def test_sessions_run_side_by_side() -> None:
    """Session 2's job runs while session 1's is still blocked: a long decode of one caller
    does not hold up another's."""
    lanes = SessionLanes(2, "test")
    release = threading.Event()
    ran = threading.Event()
    lanes.submit(1, lambda: release.wait(10))
    lanes.submit(1, ran.set)  # queued behind the blocked job of its own session
    other = threading.Event()
    lanes.submit(2, other.set)
    assert other.wait(5), "session 2 waited for session 1"
    assert not ran.is_set() and lanes.pending() == 1
    release.set()
    assert ran.wait(5)
    lanes.close()


def test_a_failing_job_is_reported_and_the_lane_goes_on() -> None:
    errors: list[tuple[int, str]] = []
    lanes = SessionLanes(1, "test", on_error=lambda s, exc: errors.append((s, str(exc))))
    after = threading.Event()

    def boom() -> None:
        raise ValueError("bad audio")

    lanes.submit(3, boom)
    lanes.submit(3, after.set)
    assert after.wait(5)
    lanes.close()
    assert errors == [(3, "bad audio")]


def test_close_without_waiting_drops_what_is_queued() -> None:
    lanes = SessionLanes(1, "test")
    started, release = threading.Event(), threading.Event()
    seen: list[int] = []
    lanes.submit(1, lambda: (started.set(), release.wait(10)))
    for i in range(5):
        lanes.submit(1, lambda i=i: seen.append(i))
    assert started.wait(5) and lanes.pending() == 5
    closer = threading.Thread(target=lanes.close, kwargs={"wait": False})
    closer.start()
    for _ in range(500):  # close() drops the queue before it waits for the running job
        if lanes.pending() == 0:
            break
        threading.Event().wait(0.01)
    assert lanes.pending() == 0
    release.set()
    closer.join(5)
    assert not closer.is_alive() and seen == []
