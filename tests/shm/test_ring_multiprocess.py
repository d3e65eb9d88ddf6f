"""The ring under real processes: wrap-around at load, purges, dead peers, signals, leaks."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import shm
from shm import Control, Ring, segment_name

ctx = mp.get_context("spawn")
N_RECORDS = 20_000


def _payload(i: int, rng: random.Random, max_len: int) -> bytes:
    n = rng.randrange(0, max_len + 1)
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


def produce_random(
    name: str, ctl_name: str, seed: int, count: int, max_len: int, wake_yield: bool = False
) -> None:
    rng = random.Random(seed)
    with Control.attach(ctl_name) as ctl, Ring.attach(name, ctl, role="producer") as ring:
        ring.wake_yield = wake_yield
        for i in range(count):
            assert ring.push(_payload(i, rng, max_len), session=i % 4, kind=1 + i % 3, timeout=10)


@pytest.mark.parametrize("wake_yield", [False, True], ids=["plain", "wake_yield"])
def test_random_sizes_across_many_wraps_every_byte_and_seq(
    control: Control, wake_yield: bool
) -> None:
    seed, max_len = 1234, 1500
    with Ring.create(segment_name("test-mp"), 8192, control=control) as ring:
        proc = ctx.Process(
            target=produce_random,
            args=(ring.name, control.name, seed, N_RECORDS, max_len, wake_yield),
        )
        proc.start()
        rng = random.Random(seed)
        total = 0
        for i in range(N_RECORDS):
            rec = ring.pop(timeout=10)
            assert rec is not None, f"record {i} never came"
            assert rec.seq == i
            assert (rec.session, rec.kind) == (i % 4, 1 + i % 3)
            assert rec.payload == _payload(i, rng, max_len)
            total += len(rec.payload) + shm.HEADER_SIZE
        proc.join(10)
        assert proc.exitcode == 0
        assert total > 50 * ring.capacity  # many wrap-arounds
        assert ring.stats()["skipped"] == 0


def produce_sessions(name: str, ctl_name: str, count: int) -> None:
    with Control.attach(ctl_name) as ctl, Ring.attach(name, ctl, role="producer") as ring:
        for i in range(count):
            for session in (0, 1):
                # stamp explicitly: a producer that has not yet seen the cancel keeps old epochs
                ring.push(i.to_bytes(4, "little"), session=session, kind=1, epoch=0, timeout=10)


def test_cancel_purges_across_processes_without_producer_help(control: Control) -> None:
    with Ring.create(segment_name("test-purge"), 1 << 20, control=control) as ring:
        proc = ctx.Process(target=produce_sessions, args=(ring.name, control.name, 2000))
        proc.start()
        proc.join(20)
        assert proc.exitcode == 0
        assert ring.stats()["pushed"] == 4000
        control.cancel(1)  # after everything was queued: O(1), no queue walk
        got = [r.session for r in iter(lambda: ring.pop(0), None)]
        assert got == [0] * 2000
        assert ring.stats()["skipped"] == 2000


def produce_forever(name: str, ctl_name: str, ready: mp.Event) -> None:
    with Control.attach(ctl_name) as ctl, Ring.attach(name, ctl, role="producer") as ring:
        ready.set()
        i = 0
        while True:
            body = os.urandom(random.randrange(16, 1000))
            ring.push(
                hashlib.blake2b(body, digest_size=16).digest() + body,
                session=0,
                kind=1,
                timeout=None,
            )
            i += 1


def test_producer_sigkilled_mid_stream(control: Control) -> None:
    with Ring.create(segment_name("test-kill"), 16384, control=control) as ring:
        ready = ctx.Event()
        proc = ctx.Process(target=produce_forever, args=(ring.name, control.name, ready))
        proc.start()
        assert ready.wait(20)
        for _ in range(2000):  # let it get well into the stream, then kill it mid-push
            assert ring.pop(timeout=10) is not None
        os.kill(proc.pid, signal.SIGKILL)
        seen = 0
        t0 = time.monotonic()
        with pytest.raises(shm.PeerDiedError, match=r"producer \(pid \d+\) died"):
            while True:
                rec = ring.pop(timeout=10)
                assert rec is not None
                digest, body = rec.payload[:16], rec.payload[16:]
                assert hashlib.blake2b(body, digest_size=16).digest() == digest  # no torn record
                seen += 1
        assert time.monotonic() - t0 < 2  # noticed within a few wait slices, not a hang
        proc.join(5)
        assert ring.pop(timeout=0) is None  # reported once; the ring stays usable


def consume_one_then_die(name: str, ctl_name: str, ready: mp.Event) -> None:
    with Control.attach(ctl_name) as ctl, Ring.attach(name, ctl, role="consumer") as ring:
        ready.set()
        ring.pop(timeout=10)
        os.kill(os.getpid(), signal.SIGKILL)


def test_blocked_producer_learns_consumer_died(control: Control) -> None:
    with Ring.create(segment_name("test-kill-c"), 1024, control=control) as ring:
        ready = ctx.Event()
        proc = ctx.Process(target=consume_one_then_die, args=(ring.name, control.name, ready))
        proc.start()
        assert ready.wait(20)
        with pytest.raises(shm.PeerDiedError, match="consumer"):
            for _ in range(1000):
                ring.push(b"x" * 400, session=0, kind=1, timeout=10)
        proc.join(5)


def test_ctrl_c_interrupts_a_blocked_pop(control: Control, tmp_path) -> None:
    with Ring.create(segment_name("test-sigint"), 1024, control=control) as ring:
        script = textwrap.dedent(f"""
            import signal
            import sys
            from shm import Control, Ring
            # Python's own Ctrl-C handling, even when started with SIGINT ignored (as a
            # background job of a shell is)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            ring = Ring.attach({ring.name!r}, Control.attach({control.name!r}))
            print("blocked", flush=True)
            try:
                ring.pop(timeout=None)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                sys.exit(3)
        """)
        with subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
        ) as child:
            assert child.stdout.readline().strip() == "blocked"
            t0 = time.monotonic()
            child.send_signal(signal.SIGINT)
            assert child.wait(10) == 3
            assert child.stdout.read().strip() == "interrupted"
            assert time.monotonic() - t0 < 1


def test_idle_blocked_consumer_uses_no_cpu(control: Control) -> None:
    with Ring.create(segment_name("test-idle"), 1024, control=control) as ring:
        script = textwrap.dedent(f"""
            import time
            from shm import Control, Ring
            ring = Ring.attach({ring.name!r}, Control.attach({control.name!r}))
            t0 = time.process_time()
            assert ring.pop(timeout=1.0) is None
            print(time.process_time() - t0)
        """)
        out = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=20, check=True
        )
        cpu_seconds = float(out.stdout)
        assert cpu_seconds < 0.02, f"a consumer blocked for 1 s burned {cpu_seconds:.4f} s CPU"


def test_owner_exit_unlinks_and_sigkilled_owner_is_reaped(tmp_path) -> None:
    names = [segment_name("test-exit"), segment_name("test-exit")]
    script = textwrap.dedent(f"""
        import os, signal, sys
        from shm import Control, Ring
        ctl = Control.create({names[0]!r}, 4)
        ring = Ring.create({names[1]!r}, 1024, control=ctl)
        print("created", flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        # normal exit without close(): atexit unlinks
    """)
    out = subprocess.run(
        [sys.executable, "-c", script, "exit"],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    assert out.stdout.strip() == "created"
    assert not set(names) & set(shm.list_segments())

    killed = subprocess.run(
        [sys.executable, "-c", script, "kill"], capture_output=True, text=True, timeout=20
    )
    assert killed.returncode == -signal.SIGKILL
    assert set(names) <= set(shm.list_segments())  # a SIGKILL skips every exit handler...
    with pytest.raises(shm.SegmentError, match="stale: its owner"):
        Ring.attach(names[1])
    with pytest.raises(shm.SegmentError, match="stale: its owner"):
        Control.attach(names[0])
    reaped = shm.reap_stale()  # ...so the next supervisor reaps what the dead one left
    assert set(names) <= set(reaped)
    assert not set(names) & set(shm.list_segments())


def test_create_over_a_dead_owners_segment_reaps_it(control: Control) -> None:
    name = segment_name("test-recreate")
    script = (
        f"from shm import Ring; import os, signal; r = Ring.create({name!r}, 1024); "
        "os.kill(os.getpid(), signal.SIGKILL)"
    )
    subprocess.run([sys.executable, "-c", script], timeout=20)
    assert name in shm.list_segments()
    with Ring.create(name, 1024, control=control) as ring:
        assert ring.push(b"fresh", session=0, kind=1)
        assert ring.pop(0).payload == b"fresh"
