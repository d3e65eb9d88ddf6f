"""A ring record on the network: what a crossing link carries between hosts (docs/scaling.md,
"Records across hosts").

A frame is two ZeroMQ parts: the 32-byte record header exactly as a ring lays it out, then the
payload's bytes as they were in the ring (msgspec MessagePack, or raw PCM16 for the audio
kinds). Two header fields mean something else on the wire:
- `seq` is the sender's count of frames on this connection, from 1 after its HELLO: the
  receiver checks it is contiguous, so a lost frame is a dead link, never a silent loss (a
  ring's own `seq` has holes where records were purged);
- `t_ns` is the sender's CLOCK_MONOTONIC, which another host cannot compare with its own; the
  receiving ring stamps its own arrival time.
The transport's own frames use kinds a ring refuses (from 0xFF00), so they can never reach one.
"""

from __future__ import annotations

import enum
import struct

import msgspec

from shm import HEADER_SIZE, Record

WIRE_HEADER = struct.Struct("<IHHIIQQ")  # og_record_header: length, kind, flags, session,
# epoch, seq, t_ns
assert WIRE_HEADER.size == HEADER_SIZE


class WireKind(enum.IntEnum):
    """Frames of the transport itself, in the kinds a ring reserves."""

    HELLO = 0xFF01  # the first frame of a connection: who sends, on which link
    HEARTBEAT = 0xFF02  # nothing else to send for a while: the sender is alive
    LINK_DOWN = 0xFF03  # the sender is stopping the link on purpose


class WireError(ValueError):
    """A frame that cannot be right: the link that carried it is dead."""


class Hello(msgspec.Struct, array_like=True, frozen=True):
    """Who is on the other end: the link's name (both ends must agree) and the sender's
    incarnation, a token drawn when it started, so that a restarted sender is a new one and
    a stale one (cut off, then back) can be refused."""

    link: str
    incarnation: str


def encode(
    kind: int,
    flags: int,
    session: int,
    epoch: int,
    seq: int,
    t_ns: int,
    payload: bytes | memoryview,
) -> list[bytes | memoryview]:
    """The two parts of a frame (the payload is not copied here)."""
    return [WIRE_HEADER.pack(len(payload), kind, flags, session, epoch, seq, t_ns), payload]


def decode(parts: list[bytes]) -> Record:
    """A frame from its parts, as a ring's record (with the wire's `seq` and `t_ns`);
    WireError if they are not one."""
    if len(parts) != 2:
        raise WireError(f"a frame is 2 parts, got {len(parts)}")
    header, payload = parts
    if len(header) != WIRE_HEADER.size:
        raise WireError(f"a frame's header is {WIRE_HEADER.size} bytes, got {len(header)}")
    length, kind, flags, session, epoch, seq, t_ns = WIRE_HEADER.unpack(header)
    if length != len(payload):
        raise WireError(f"the header says {length} payload bytes, the frame has {len(payload)}")
    return Record(kind, flags, session, epoch, seq, t_ns, bytes(payload))


def hello(link: str, incarnation: str, t_ns: int) -> list[bytes | memoryview]:
    payload = msgspec.msgpack.encode(Hello(link, incarnation))
    return encode(WireKind.HELLO, 0, 0, 0, 0, t_ns, payload)


def read_hello(frame: Record) -> Hello:
    try:
        return msgspec.msgpack.decode(frame.payload, type=Hello)
    except msgspec.DecodeError as exc:
        raise WireError(f"a HELLO that does not decode: {exc}") from exc
