"""Shared-memory rings: the only way bytes move between omni-gateway's processes.

A `Ring` is a single-producer single-consumer queue of typed records in a POSIX shared-memory
segment; a `Control` segment holds one epoch per session, so that cancelling a session purges
every ring at once. shm imports nothing else of the project.
"""

from shm._ring import PeerDiedError, RecordTooLargeError, RingError, SegmentError
from shm.control import Control, epoch_older
from shm.ring import FLAG_NO_PURGE, HEADER_SIZE, Record, RecordView, Ring
from shm.segments import list_segments, reap_stale, segment_name

__all__ = [
    "FLAG_NO_PURGE",
    "HEADER_SIZE",
    "Control",
    "PeerDiedError",
    "Record",
    "RecordTooLargeError",
    "RecordView",
    "Ring",
    "RingError",
    "SegmentError",
    "epoch_older",
    "list_segments",
    "reap_stale",
    "segment_name",
]
