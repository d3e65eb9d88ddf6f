"""idle_timeout_ms (server_vad): once the agent's reply has been heard, a caller who says
nothing for that long gets an empty turn committed and answered
(input_audio_buffer.timeout_triggered). This is the timer; the session says what firing does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.protocol import TurnDetection


class IdleTimer:
    """One session's idle timeout. `fire(from_ms)` runs when it expires, `from_ms` being the
    caller's audio clock when it started counting."""

    def __init__(self, fire: Callable[[int], None]) -> None:
        self._fire = fire
        self._handle: asyncio.TimerHandle | None = None
        self.from_ms = 0

    @property
    def armed(self) -> bool:
        return self._handle is not None

    def arm(self, detection: TurnDetection | None, audio_ms: int, after_s: float = 0.0) -> None:
        """The agent's reply has been heard (or will have been in `after_s`): the caller has
        idle_timeout_ms from then to say something, `audio_ms` being their audio clock now.
        Only server_vad with a timeout set arms it."""
        self.disarm()
        if detection is None or detection.type != "server_vad" or not detection.idle_timeout_ms:
            return
        self.from_ms = audio_ms + int(after_s * 1000)
        loop = asyncio.get_running_loop()
        self._handle = loop.call_later(after_s + detection.idle_timeout_ms / 1000, self._expired)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _expired(self) -> None:
        self._handle = None
        self._fire(self.from_ms)
