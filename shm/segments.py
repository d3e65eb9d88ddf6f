"""Segment names, clean-up at exit, and reaping segments whose owner died."""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import threading
import weakref
from pathlib import Path
from typing import Protocol

from shm import _ring

SHM_DIR = Path("/dev/shm")
PREFIX = "omni-"


class _Closable(Protocol):
    def close(self) -> None: ...


_owned: weakref.WeakSet[_Closable] = weakref.WeakSet()
_owned_lock = threading.Lock()


def normalize(name: str) -> str:
    """POSIX shm names start with '/'; accept them with or without it."""
    if not isinstance(name, str):
        raise TypeError(f"segment name must be a str, not {type(name).__name__}")
    return name if name.startswith("/") else "/" + name


def segment_name(*parts: str, unique: bool = True) -> str:
    """A project segment name such as '/omni-<parts>-<random>'."""
    name = PREFIX + "-".join(parts)
    if unique:
        name += "-" + secrets.token_hex(4)
    return "/" + name


def track_owned(segment: _Closable) -> None:
    """Close (and so unlink) `segment` at interpreter exit if nobody did before."""
    with _owned_lock:
        _owned.add(segment)


@atexit.register
def _close_owned() -> None:
    with _owned_lock:
        segments = list(_owned)
    for segment in segments:
        # exit must unlink everything it can, whatever one segment does
        with contextlib.suppress(Exception):
            segment.close()


def owner_of(name: str) -> tuple[str | None, int]:
    """(kind, owner pid) of a segment: kind is 'ring', 'control' or None if not ours."""
    return _ring.segment_owner(normalize(name))


def reap_if_stale(name: str) -> bool:
    """Unlink `name` if it is one of ours and its owner process is gone; True if unlinked."""
    name = normalize(name)
    try:
        kind, pid = owner_of(name)
    except FileNotFoundError:
        return False
    if kind is None or _ring.pid_alive(pid):
        return False
    try:
        os.unlink(SHM_DIR / name[1:])
    except FileNotFoundError:
        return False
    return True


def list_segments(prefix: str = PREFIX) -> list[str]:
    """Names of segments in /dev/shm starting with `prefix` (without the leading '/')."""
    prefix = prefix.lstrip("/")
    try:
        return sorted("/" + p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


def reap_stale(prefix: str = PREFIX) -> list[str]:
    """Unlink every segment under `prefix` whose owner died (a SIGKILLed supervisor, say)."""
    return [name for name in list_segments(prefix) if reap_if_stale(name)]
