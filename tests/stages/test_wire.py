"""stages.wire: a frame's header is the ring's record header, byte for byte."""

from __future__ import annotations

import mmap
import os

import pytest

from shm import Control, Ring, segment_name
from stages import wire
from stages.wire import WIRE_HEADER, WireError, WireKind


def test_a_frames_header_is_the_rings_record_header_byte_for_byte() -> None:
    with (
        Control.create(segment_name("test-wire-ctl"), 8) as control,
        Ring.create(segment_name("test-wire"), 4096, control=control) as ring,
    ):
        control.cancel(5)
        assert ring.push(b"a token", session=5, kind=31, flags=0x8000)
        fd = os.open(f"/dev/shm/{ring.name[1:]}", os.O_RDONLY)
        try:
            with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as segment:
                meta_size = int.from_bytes(segment[12:16], "little")  # og_ring_meta.meta_size
                in_ring = bytes(segment[meta_size : meta_size + WIRE_HEADER.size + 7])
        finally:
            os.close(fd)
        record = ring.pop(0)
    assert record is not None
    header, payload = wire.encode(
        record.kind, record.flags, record.session, record.epoch, record.seq, record.t_ns,
        record.payload,
    )  # fmt: skip
    assert header + payload == in_ring
    frame = wire.decode([header, payload])
    assert (frame.kind, frame.flags, frame.session, frame.epoch) == (31, 0x8000, 5, 1)
    assert frame.payload == b"a token"


def test_frames_that_cannot_be_right_are_wire_errors() -> None:
    header, payload = wire.encode(31, 0, 1, 0, 1, 0, b"abc")
    with pytest.raises(WireError, match="2 parts"):
        wire.decode([header])
    with pytest.raises(WireError, match="32 bytes"):
        wire.decode([header[:-1], payload])
    with pytest.raises(WireError, match="says 3 payload bytes"):
        wire.decode([header, b"ab"])
    bad_hello = wire.decode(wire.encode(WireKind.HELLO, 0, 0, 0, 0, 0, b"\xc1"))
    with pytest.raises(WireError, match="HELLO"):
        wire.read_hello(bad_hello)


def test_the_transports_kinds_are_kinds_a_ring_refuses() -> None:
    import shm._ring

    assert min(WireKind) >= shm._ring.KIND_RESERVED
    hello = wire.read_hello(wire.decode(wire.hello("gateway.0>vocoder.0", "abc", 5)))
    assert (hello.link, hello.incarnation) == ("gateway.0>vocoder.0", "abc")
