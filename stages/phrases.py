"""Cutting a stream of text deltas into phrases a voice can speak right away."""

from __future__ import annotations

import re
from dataclasses import dataclass

# A phrase ends at sentence or clause punctuation followed by whitespace, or at full-width
# punctuation (Chinese, Japanese), which no space follows.
_BOUNDARY = re.compile(r"[.!?;:,\u2026]+[\"')\]]*\s+|[\u3002\uff01\uff1f\uff1b\uff1a\uff0c\u3001]+")

# A phrase is cut after this many characters a word when no word ends in time: text without
# spaces (Chinese, Japanese; a random-weight model's tokens) would otherwise wait for the
# reply's end or its next punctuation before a word was ever counted.
CHARS_PER_WORD = 6


class PhraseSplitter:
    """Feed it deltas; it returns phrases as soon as they are complete.

    The first phrase goes out at the first punctuation boundary or after `first_words` whole
    words, whichever comes first, so speech starts within a few tokens. Later phrases end at
    punctuation, or after `max_words` words when the model writes none. No phrase is longer
    than `CHARS_PER_WORD` characters a word: text without spaces is cut there, text with them
    at its last space before.
    """

    def __init__(self, first_words: int = 4, max_words: int = 20) -> None:
        self.first_words = first_words
        self.max_words = max_words
        self._buffer = ""
        self._emitted = 0

    def feed(self, text: str) -> list[str]:
        self._buffer += text
        phrases = []
        while phrase := self._take():
            phrases.append(phrase)
        return phrases

    def take_words(self, at_least: int) -> str | None:
        """The whole words held so far, as a phrase, if there are `at_least` of them (the
        last word may still be growing, and stays)."""
        words = list(re.finditer(r"\S+\s+", self._buffer))
        if len(words) < max(at_least, 1):
            return None
        cut = words[-1].end()
        phrase, self._buffer = self._buffer[:cut].strip(), self._buffer[cut:]
        self._emitted += 1
        return phrase

    def flush(self) -> str | None:
        """What is left at the end of the reply."""
        rest, self._buffer = self._buffer.strip(), ""
        return rest or None

    def _take(self) -> str | None:
        limit = self.first_words if self._emitted == 0 else self.max_words
        match = _BOUNDARY.search(self._buffer)
        # whole words are those followed by whitespace; the last one may still be growing
        words = list(re.finditer(r"\S+\s+", self._buffer))
        cut = match.end() if match else None
        if len(words) >= limit and (cut is None or words[limit - 1].end() < cut):
            cut = words[limit - 1].end()
        capped = self._cut_long(limit * CHARS_PER_WORD)
        if capped is not None and (cut is None or capped < cut):
            cut = capped
        if cut is None:
            return None
        phrase, self._buffer = self._buffer[:cut].strip(), self._buffer[cut:]
        if not phrase:
            return None
        self._emitted += 1
        return phrase

    def _cut_long(self, chars: int) -> int | None:
        """Where to cut a buffer that holds `chars` characters of text without a boundary."""
        start = len(self._buffer) - len(self._buffer.lstrip())
        if len(self._buffer) - start < chars:
            return None
        end = start + chars
        space = self._buffer.rfind(" ", start, end)
        return space + 1 if space > start else end


@dataclass(frozen=True)
class EarlyPhrase:
    """When a reply's next phrase is spoken before its clause ends.

    A clause of fifteen words takes the model longer to write, and the voice longer to make,
    than the four words before it take to play: waiting for its comma, the caller hears the
    agent stop mid-sentence. So once the audio made ahead of the caller's playback is under
    `low_water_s` (about what the voice needs to make a short phrase on a busy machine) and no
    phrase is waiting, the whole words written so far go to the voice, if there are
    `min_words` of them. A low water of 0 turns this off.
    """

    low_water_s: float
    min_words: int = 2

    def wait_s(self, lead_s: float) -> float | None:
        """How long until the words so far are due to be spoken (0: now); None: never."""
        if self.low_water_s <= 0:
            return None
        return max(0.0, lead_s - self.low_water_s)
