"""A trace of the stage records a gateway process receives, for latency analysis.

With `gateway.trace_dir` set, every gateway process appends each record its ring readers hand
it to `<trace_dir>/<instance>.trace`, stamped with when it arrived and the call it belongs to:
the stages' own CLOCK_MONOTONIC stamps joined with the gateway's, across processes (one host,
one clock). loadtest.tap reads the traces of the gateway processes it does not run itself.
Audio records are traced without their samples. Each entry is its length (4 bytes, little
endian) and then MessagePack, written at once (one write call, a few microseconds of the
reader thread's), so a trace read while the gateway runs holds everything received so far.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from stages.envelope import Envelope
from stages.messages import RAW_KINDS, Kind, decode, encode

_LENGTH = struct.Struct("<I")
logger = logging.getLogger(__name__)


class TraceEntry(msgspec.Struct, array_like=True, frozen=True):
    recv_ns: int  # when the gateway's reader thread had it (CLOCK_MONOTONIC)
    call_id: str | None
    session: int
    stage: str
    kind: int
    t_ns: int  # the record's stamp: when the stage pushed it
    payload: bytes  # the record's payload as on the ring; empty for audio
    cancel_sent_ns: int | None = None  # for a CANCEL_ACK: when its CANCEL was sent

    @property
    def msg(self) -> Any:
        """The record's message (None for audio)."""
        return None if self.kind in RAW_KINDS else decode(self.kind, self.payload)


class StageTrace:
    """Appends entries to one file; safe to call from several reader threads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab", buffering=0)
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()

    def record(
        self,
        event: Envelope,
        call_id: str | None,
        cancel_sent_ns: int | None = None,
    ) -> None:
        kind = Kind(event.kind)
        payload = b"" if isinstance(event.msg, (bytes, memoryview)) else encode(event.msg)[1]
        entry = TraceEntry(
            time.monotonic_ns(),
            call_id,
            event.session,
            event.src,
            int(kind),
            event.t_ns,
            payload,
            cancel_sent_ns,
        )
        data = self._encoder.encode(entry)
        with self._lock:
            if self._file.closed:
                return  # a reader thread still delivering, or a write that failed
            try:
                self._file.write(_LENGTH.pack(len(data)) + data)
            except OSError as exc:  # a full disk ends the trace, never the calls
                logger.error("stage trace %s stopped: %s", self.path, exc)
                self._file.close()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_trace(path: str | Path, since_ns: int = 0) -> Iterator[TraceEntry]:
    """The entries of one trace file that arrived at or after `since_ns`; a last entry cut
    short by a process still writing (or killed) is left out."""
    data = Path(path).read_bytes()
    decoder = msgspec.msgpack.Decoder(TraceEntry)
    offset = 0
    while offset + _LENGTH.size <= len(data):
        (length,) = _LENGTH.unpack_from(data, offset)
        start, offset = offset + _LENGTH.size, offset + _LENGTH.size + length
        if offset > len(data):
            return
        entry = decoder.decode(data[start:offset])
        if entry.recv_ns >= since_ns:
            yield entry
