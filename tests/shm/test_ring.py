"""Single-process behaviour of shm.Ring and shm.Control."""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import pytest

import shm
from shm import HEADER_SIZE, Control, Ring, segment_name


def test_push_pop_roundtrip_keeps_header_fields(ring: Ring, control: Control) -> None:
    producer = Ring.attach(ring.name, control)
    before = time.monotonic_ns()
    assert producer.push(b"hello", session=3, kind=7, flags=0x21)
    rec = ring.pop(timeout=1)
    assert rec is not None
    assert (rec.kind, rec.flags, rec.session, rec.epoch, rec.seq) == (7, 0x21, 3, 0, 0)
    assert rec.payload == b"hello"
    assert before <= rec.t_ns <= time.monotonic_ns()
    producer.close()


def test_seq_counts_every_push(ring: Ring) -> None:
    for i in range(5):
        assert ring.push(bytes([i]), session=0, kind=1)
    assert [ring.pop(0).seq for _ in range(5)] == [0, 1, 2, 3, 4]


def test_pop_times_out_with_none(ring: Ring) -> None:
    t0 = time.monotonic()
    assert ring.pop(timeout=0.05) is None
    assert 0.04 <= time.monotonic() - t0 < 1.0
    assert ring.pop(timeout=0) is None


def test_full_ring_is_reported_not_overwritten(ring: Ring) -> None:
    pushed = 0
    while ring.push(pushed.to_bytes(4, "little") * 25, session=0, kind=1):
        pushed += 1
    assert pushed > 10
    t0 = time.monotonic()
    assert ring.push(b"x", session=0, kind=1, timeout=0.05) is False
    assert time.monotonic() - t0 >= 0.04
    assert ring.stats()["full"] == 2
    for i in range(pushed):  # nothing was lost or overwritten
        assert ring.pop(0).payload == i.to_bytes(4, "little") * 25
    assert ring.pop(0) is None


def test_payload_larger_than_ring_is_a_clear_error(ring: Ring) -> None:
    assert ring.max_payload == ring.capacity // 2 - HEADER_SIZE
    assert ring.push(b"x" * ring.max_payload, session=0, kind=1)
    with pytest.raises(shm.RecordTooLargeError, match=r"exceeds ring .* largest record"):
        ring.push(b"x" * (ring.max_payload + 1), session=0, kind=1)
    with pytest.raises(ValueError):  # RecordTooLargeError is a ValueError too
        ring.push(b"x" * (ring.max_payload + 1), session=0, kind=1)


def test_stale_epoch_records_are_skipped_and_counted(ring: Ring, control: Control) -> None:
    ring.push(b"old-1", session=5, kind=1)
    ring.push(b"other", session=6, kind=1)
    ring.push(b"old-2", session=5, kind=1)
    assert control.cancel(5) == 1
    ring.push(b"new", session=5, kind=1)
    got = [(r.session, r.epoch, r.payload) for r in iter(lambda: ring.pop(0), None)]
    assert got == [(6, 0, b"other"), (5, 1, b"new")]
    assert ring.stats()["skipped"] == 2


def test_no_purge_flag_survives_a_cancel(ring: Ring, control: Control) -> None:
    ring.push(b"data", session=4, kind=1)
    ring.push(b"close", session=4, kind=2, flags=shm.FLAG_NO_PURGE)
    control.cancel(4)
    assert [r.payload for r in iter(lambda: ring.pop(0), None)] == [b"close"]


def test_explicit_epoch_and_future_epochs(ring: Ring, control: Control) -> None:
    control.cancel(1)
    ring.push(b"stale", session=1, kind=1, epoch=0)
    ring.push(b"future", session=1, kind=1, epoch=5)
    assert [r.payload for r in iter(lambda: ring.pop(0), None)] == [b"future"]


def test_epoch_comparison_is_wrap_safe(ring: Ring, control: Control) -> None:
    # a record stamped just before the 32-bit epoch wraps is older than epoch 0 after it
    ring.push(b"pre-wrap", session=2, kind=1, epoch=2**32 - 1)
    assert control.epoch(2) == 0
    assert [r.payload for r in iter(lambda: ring.pop(0), None)] == []


def test_session_outside_control_is_rejected(ring: Ring, control: Control) -> None:
    with pytest.raises(ValueError, match="outside control segment"):
        ring.push(b"x", session=control.max_sessions, kind=1)
    with pytest.raises(ValueError, match="outside control segment"):
        control.cancel(control.max_sessions)


def test_reserved_kinds_are_rejected(ring: Ring) -> None:
    with pytest.raises(ValueError, match="kind must be below"):
        ring.push(b"x", session=0, kind=0xFFFF)


def test_zero_copy_view_shares_memory_until_released(ring: Ring) -> None:
    samples = np.arange(1000, dtype=np.int16)
    ring.push(samples, session=0, kind=1)
    view = ring.pop_view(timeout=1)
    assert view is not None
    arr = np.frombuffer(view.payload, dtype=np.int16)
    np.testing.assert_array_equal(arr, samples)
    assert view.payload.readonly
    with pytest.raises(BufferError, match="still"):
        view.release()  # `arr` still exports the payload
    del arr
    view.release()
    view.release()  # idempotent
    assert ring.stats()["bytes_used"] == 0


def test_pop_while_a_view_is_exported_refuses(ring: Ring) -> None:
    ring.push(b"abcd", session=0, kind=1)
    ring.push(b"efgh", session=0, kind=1)
    view = ring.pop_view(0)
    arr = np.frombuffer(view.payload, dtype=np.uint8)
    with pytest.raises(BufferError, match="still in use"):
        ring.pop(0)
    del arr
    view.payload.release()
    assert ring.pop(0).payload == b"efgh"  # the unreleased view was advanced past


def test_view_context_manager(ring: Ring) -> None:
    ring.push(b"xyz", session=0, kind=1)
    with ring.pop_view(0) as view:
        assert bytes(view.payload) == b"xyz"
    assert ring.pop(0) is None


def test_wraparound_keeps_records_whole(control: Control) -> None:
    with Ring.create(segment_name("test-wrap"), 256, control=control) as ring:
        rng = np.random.default_rng(1)
        for i in range(2000):
            n = int(rng.integers(0, ring.max_payload + 1))
            payload = bytes([i % 251]) * n
            assert ring.push(payload, session=0, kind=1)
            rec = ring.pop(0)
            assert rec.payload == payload and rec.seq == i
        assert ring.stats()["pushed"] == 2000


def test_capacity_rounds_up_to_power_of_two(control: Control) -> None:
    with Ring.create(segment_name("test-cap"), 5000) as ring:
        assert ring.capacity == 8192


def test_bad_names_and_missing_segments() -> None:
    with pytest.raises(ValueError, match="bad shared-memory name"):
        Ring.create("a/b", 1024)
    with pytest.raises(FileNotFoundError):
        Ring.attach(segment_name("test-missing"))
    with pytest.raises(FileNotFoundError):
        Control.attach(segment_name("test-missing"))


def test_existing_live_segment_is_not_clobbered(ring: Ring) -> None:
    with pytest.raises(FileExistsError):
        Ring.create(ring.name, 1024)


def test_wrong_magic_is_a_clear_error() -> None:
    name = segment_name("test-foreign")
    fd = os.open(f"/dev/shm/{name[1:]}", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"\x00" * 4096)
        with pytest.raises(shm.SegmentError, match="wrong magic"):
            Ring.attach(name)
        with pytest.raises(shm.SegmentError, match="wrong magic"):
            Control.attach(name)
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{name[1:]}")


def test_wrong_version_is_a_clear_error(ring: Ring) -> None:
    fd = os.open(f"/dev/shm/{ring.name[1:]}", os.O_RDWR)
    with mmap.mmap(fd, 4096) as m:
        m[8:12] = (99).to_bytes(4, "little")  # og_ring_meta.version
    os.close(fd)
    with pytest.raises(shm.SegmentError, match="layout version"):
        Ring.attach(ring.name)


def test_closed_objects_raise_and_close_twice(control: Control) -> None:
    ring = Ring.create(segment_name("test-closed"), 1024, control=control)
    ring.close()
    ring.close()
    assert ring.closed
    with pytest.raises(ValueError, match="is closed"):
        ring.push(b"x", session=0, kind=1)
    with pytest.raises(ValueError, match="is closed"):
        ring.pop(0)


def test_owner_close_unlinks(control: Control) -> None:
    ring = Ring.create(segment_name("test-unlink"), 1024, control=control)
    assert ring.name in shm.list_segments()
    ring.close()
    assert ring.name not in shm.list_segments()


def test_session_claims_in_strides_never_clash() -> None:
    control = Control.create(segment_name("test-strides"), 7)
    try:
        # two processes' worth of claims: gateway 0 of 2 takes even ids, gateway 1 odd ones
        evens = [control.open_session(0, 2) for _ in range(5)]
        odds = [control.open_session(1, 2) for _ in range(4)]
        assert evens == [0, 2, 4, 6, None]
        assert odds == [1, 3, 5, None]
        control.close_session(3)
        assert control.open_session(0, 2) is None  # a free odd id is not an even one's
        assert control.open_session(1, 2) == 3
        with pytest.raises(ValueError, match="step"):
            control.open_session(0, 0)
    finally:
        control.close()


def test_negative_timeout_is_rejected(ring: Ring) -> None:
    with pytest.raises(ValueError, match="timeout"):
        ring.pop(timeout=-1)


def test_session_slots_are_claimed_once_and_purged_on_reuse(ring: Ring, control: Control) -> None:
    small = Control.create(segment_name("test-slots"), 2)
    try:
        a, b = small.open_session(), small.open_session()
        assert {a, b} == {0, 1}
        assert small.open_session() is None  # full
        assert small.holder(a) == os.getpid()
        assert small.open_sessions() == [0, 1]
        epoch = small.epoch(a)
        small.close_session(a)
        assert small.holder(a) == 0
        assert small.epoch(a) == epoch + 1  # what the old holder queued is now stale
        assert small.open_session() == a
    finally:
        small.close()


def test_wake_yield_is_off_until_asked_and_refused_once_closed(control: Control) -> None:
    ring = Ring.create(segment_name("test-yield"), 4096, control=control)
    assert ring.wake_yield is False
    ring.wake_yield = True
    assert ring.wake_yield is True
    assert ring.push(b"x", session=0, kind=1)  # no consumer sleeps: nothing to wake or yield
    assert ring.pop(0).payload == b"x"
    ring.close()
    with pytest.raises(ValueError, match="closed"):
        ring.wake_yield = False


def test_advance_keeps_the_larger_epoch_across_the_wrap(control: Control) -> None:
    assert control.advance(6, 3) == 3
    assert control.advance(6, 2) == 3  # an older epoch leaves it
    assert control.advance(6, 3) == 3
    control.cancel(7)
    control.cancel(7)
    assert control.advance(7, 2**32 - 1) == 2  # 2**32 - 1 comes before 2, across the wrap
    assert control.advance(8, 2**32 - 2) == 0  # half the circle or more behind 0: older
    assert control.advance(8, 2**31 - 1) == 2**31 - 1
    assert control.advance(8, 2**32 - 2) == 2**32 - 2
    assert control.advance(8, 1) == 1  # 1 comes after 2**32 - 2, across the wrap
    assert control.advance(8, 2**32 - 1) == 1  # and 2**32 - 1 before 1
    with pytest.raises(ValueError, match="32-bit"):
        control.advance(8, 2**32)
    with pytest.raises(OverflowError):
        control.advance(8, -1)
    with pytest.raises(ValueError, match="outside control segment"):
        control.advance(control.max_sessions, 1)
