"""A Whisper turn as a stream, for any Whisper recognizer (transformers' or CTranslate2's).

Whisper is not a streaming model: it transcribes windows of up to 30 s. A stream buffers the
turn's audio and re-decodes the whole buffer each time ``partial_interval_ms`` more audio has
arrived, which gives partial transcripts at that pace, and decodes once more at ``finish``. A turn
longer than a window is cut into consecutive 30 s windows; the text of a full window is kept and
not re-decoded (a word that straddles the cut may be lost).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from stages.backends.speech import StreamClosedError, as_pcm16
from stages.messages import CALLER_RATE


class WindowRecognizer(Protocol):
    """What a stream needs of its recognizer."""

    partial_interval_ms: int
    window_samples: int  # the audio one decode sees at most

    def transcribe(self, pcm16: np.ndarray) -> str:
        """Up to one window of 16 kHz int16 audio as text (thread-safe)."""
        ...


class WhisperStream:
    """One turn: buffered audio, re-decoded for partials every ``partial_interval_ms``."""

    def __init__(self, recognizer: WindowRecognizer) -> None:
        self._recognizer = recognizer
        self._chunks: list[np.ndarray] = []
        self._buffered = 0  # samples in the current window
        self._since_decode = 0  # samples fed since the last partial decode
        self._committed: list[str] = []  # text of the full windows already cut off
        self._partial = ""
        self._interval = CALLER_RATE * recognizer.partial_interval_ms // 1000
        self._done = False

    def feed(self, pcm16: np.ndarray) -> str | None:
        """Buffer audio; re-decode when enough came since the last decode; report a change."""
        if self._done:
            raise StreamClosedError("cannot feed: this recognizer stream is finished or closed")
        pcm16 = as_pcm16(pcm16)
        if len(pcm16) == 0:
            return None
        self._chunks.append(pcm16.copy())
        self._buffered += len(pcm16)
        self._since_decode += len(pcm16)
        self._commit_full_windows()
        if self._interval == 0 or self._since_decode < self._interval or self._buffered == 0:
            return None
        self._since_decode = 0
        text = self._text(self._recognizer.transcribe(self._window()))
        if text and text != self._partial:
            self._partial = text
            return text
        return None

    def peek(self, silence_after: int = 0) -> str:
        """The transcript if the turn ended after `silence_after` more samples of silence (the
        same words as `finish` would give then: Whisper's can change with the audio's length
        alone); the stream stays open for more audio."""
        if self._done:
            raise StreamClosedError("cannot peek: this recognizer stream is finished or closed")
        if not self._buffered:
            return self._text("")
        audio = self._window()
        room = self._recognizer.window_samples - len(audio)
        if silence_after > 0 and room > 0:
            audio = np.concatenate([audio, np.zeros(min(silence_after, room), np.int16)])
        return self._text(self._recognizer.transcribe(audio))

    def finish(self) -> str:
        """Decode what is buffered and return the turn's transcript."""
        if self._done:
            raise StreamClosedError("cannot finish: this recognizer stream is finished or closed")
        try:
            return self.peek()
        finally:
            self.close()

    def close(self) -> None:
        """Drop the buffered audio; safe to call twice."""
        self._done = True
        self._chunks = []
        self._buffered = 0

    def _window(self) -> np.ndarray:
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks)]
        return self._chunks[0]

    def _commit_full_windows(self) -> None:
        window = self._recognizer.window_samples
        while self._buffered > window:
            audio = self._window()
            self._committed.append(self._recognizer.transcribe(audio[:window]))
            self._chunks = [audio[window:]]
            self._buffered -= window

    def _text(self, tail: str) -> str:
        return " ".join(part for part in (*self._committed, tail) if part)
