"""Embedded offline voice: espeak-ng's own synthesis (stages.backends.espeak_library).

No Debian package and no download: the espeakng-loader wheel ships the library and its voice
data. A synthesis runs on a short-lived thread (ctypes releases the GIL for the call) and hands
~50 ms buffers to the consuming generator through a queue, so the first chunk is out after a few
ms even for a long text; closing the generator makes the next callback abort the synthesis.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from stages.backends.espeak_library import EE_OK, EspeakLibrary, SynthJob
from stages.backends.speech import (
    MAX_CHUNK_MS,
    SpeechOptionError,
    reject_unknown_options,
    split_pcm16,
)

logger = logging.getLogger(__name__)

_PARAM_RATE, _PARAM_VOLUME, _PARAM_PITCH = 1, 2, 3  # speak_lib.h

RATE_WPM_RANGE = (80, 450)
PITCH_RANGE = (0, 100)
VOLUME_RANGE = (0, 200)


def load_espeak(
    voice: str = "en-us",
    rate_wpm: int = 175,
    pitch: int = 50,
    volume: int = 100,
    chunk_ms: int = MAX_CHUNK_MS,
    **unknown: Any,
) -> EspeakVoice:
    """Load espeak-ng with ``voice`` (a language such as ``en-us``, optionally ``+variant``).

    ``rate_wpm`` is in words per minute (80-450), ``pitch`` 0-100, ``volume`` 0-200 (100 = normal),
    ``chunk_ms`` the longest chunk ``synthesize`` yields (at most 100).
    """
    reject_unknown_options("espeak", unknown, ("voice", "rate_wpm", "pitch", "volume", "chunk_ms"))
    _check_int("rate_wpm", rate_wpm, *RATE_WPM_RANGE)
    _check_int("pitch", pitch, *PITCH_RANGE)
    _check_int("volume", volume, *VOLUME_RANGE)
    _check_int("chunk_ms", chunk_ms, 10, MAX_CHUNK_MS)
    if not isinstance(voice, str) or not voice:
        raise SpeechOptionError(f"espeak option voice={voice!r} must be a voice name like 'en-us'")
    library = EspeakLibrary.get()
    with library.lock:
        if library.set_voice(voice) != EE_OK:
            raise SpeechOptionError(
                f"espeak option voice={voice!r}: no such espeak-ng voice "
                "(use a language code such as 'en-us', 'en-gb', 'de', optionally '+variant')"
            )
    return EspeakVoice(library, voice, rate_wpm, pitch, volume, chunk_ms)


def _check_int(option: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpeechOptionError(f"espeak option {option}={value!r} must be an int in {low}..{high}")


class EspeakVoice:
    """An espeak-ng voice with fixed settings; safe to use from several threads."""

    name = "espeak"
    random_weights = False

    def __init__(
        self,
        library: EspeakLibrary,
        voice: str,
        rate_wpm: int,
        pitch: int,
        volume: int,
        chunk_ms: int = MAX_CHUNK_MS,
    ) -> None:
        self._library = library
        self.voice = voice
        self.sample_rate = library.sample_rate
        self._params = ((_PARAM_RATE, rate_wpm), (_PARAM_PITCH, pitch), (_PARAM_VOLUME, volume))
        self._chunk_ms = chunk_ms

    def synthesize(self, text: str, stop: Callable[[], bool] | None = None) -> Iterator[np.ndarray]:
        """Yield int16 chunks of speech while espeak produces them; closing early, or ``stop``
        returning True (asked at every buffer), aborts it."""
        if not text.strip():
            return
        job = SynthJob(stop)
        worker = threading.Thread(
            target=self._library.synthesize,
            args=(job, text, self.voice, self._params),
            name="espeak-synth",
            daemon=True,
        )
        worker.start()
        try:
            while True:
                item = job.output.get()
                if item is None or job.should_abort():
                    break
                if isinstance(item, BaseException):
                    raise item
                yield from split_pcm16(item, self.sample_rate, self._chunk_ms)
        finally:
            job.cancelled = True
            worker.join()
