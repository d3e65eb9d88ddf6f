"""The reply prepared at the caller's pause (gateway.prepare_reply_ms), as each stage holds it.

When the caller pauses mid-turn, the gateway sends TURN_PAUSED. The encoder transcribes the
turn so far (`PausedTurn`) and hands that to reasoning, which starts the reply on it
(`EarlyReply`); the vocoder speaks it. Nothing of it reaches the caller yet: reasoning keeps
back its records for the gateway, the vocoder its audio (`HeldBack`). Then either

- the turn ends as it was (the final transcript is the one at the pause): reasoning releases
  what it kept, and tells the vocoder (RESPONSE_RELEASE, keep), which sends what it made, so
  the caller hears the reply without waiting for its first tokens or its first audio; or
- the caller goes on (TURN_RESUMED): the encoder decodes the audio it held back, reasoning
  drops the reply (its request aborted, its user message taken back) and tells the vocoder
  (RESPONSE_RELEASE, not keep), which drops what it made. stages.stops calls both of these
  stops; a cancel ends a prepared reply as it ends any other.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

R = TypeVar("R")


@dataclass
class PausedTurn:
    """The encoder's turn at the caller's pause: what they said so far (the final transcript
    if the turn ends now), and the audio after the pause, silence to the VAD, kept back and
    decoded only if the caller goes on, so that the transcript at the pause stays final."""

    text: str
    audio: list[np.ndarray] = field(default_factory=list)


@dataclass
class EarlyReply:
    """Reasoning's reply started at the caller's pause on the transcript of the turn so far:
    released if the turn ends with the same transcript, dropped (request aborted, the user
    message it answers and any assistant message taken back) if the caller goes on."""

    turn_id: int
    text: str
    asked: dict[str, str] | None  # the user message it answers
    response: Any  # stages.reasoning.Response

    def answers(self, turn_id: int, text: str) -> bool:
        """Whether the turn's final transcript is the one it was started on."""
        return (self.turn_id, self.text) == (turn_id, text)


class HeldBack(Generic[R]):
    """What a prepared reply made for the caller, kept back until its turn ends.

    Thread-safe: the vocoder keeps records on its model loop and releases them from a reader
    thread. A record kept while a release is sending waits for it, so records leave in the
    order they were made."""

    def __init__(self) -> None:
        self._records: list[R] | None = []
        self._lock = threading.Lock()

    @property
    def holding(self) -> bool:
        """Still keeping records back (not released)."""
        return self._records is not None

    @property
    def kept(self) -> list[R]:
        """A copy of what is kept back now (empty once released)."""
        with self._lock:
            return list(self._records or ())

    def keep(self, record: R) -> bool:
        """Keep `record` back; False once released (send it now instead)."""
        with self._lock:
            if self._records is None:
                return False
            self._records.append(record)
            return True

    def release(self, send: Callable[[list[R]], None]) -> bool:
        """Hand what was kept to `send`, under the lock; False if released already."""
        with self._lock:
            records, self._records = self._records, None
            if records is None:
                return False
            send(records)
            return True
