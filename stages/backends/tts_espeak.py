"""Embedded offline voice: libespeak-ng from the espeakng-loader wheel, driven through ctypes.

No Debian package and no download: the wheel ships the library and its voice data. espeak-ng is a
process-wide library with global state (one voice, one set of parameters, one callback), so every
synthesis holds ``_EspeakLibrary.lock`` from setting the voice to the last sample.

Synthesis runs in synchronous mode: ``espeak_Synth`` returns only when the whole text is spoken,
calling back with ~50 ms buffers along the way. It runs on a short-lived thread (ctypes releases the
GIL for the call) and hands buffers to the consuming generator through a queue, so the first chunk
is out after a few ms even for a long text; closing the generator makes the next callback abort the
synthesis.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from stages.backends.speech import (
    MAX_CHUNK_MS,
    SpeechBackendError,
    SpeechOptionError,
    reject_unknown_options,
    split_pcm16,
)

logger = logging.getLogger(__name__)

# speak_lib.h constants.
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_DONT_EXIT = 0x8000  # return an error instead of calling exit() on bad data
_CHARS_UTF8 = 1
_POS_CHARACTER = 1
_EE_OK = 0
_PARAM_RATE, _PARAM_VOLUME, _PARAM_PITCH = 1, 2, 3
#: Length of the buffers espeak hands to the callback.
_BUFFER_MS = 50

RATE_WPM_RANGE = (80, 450)
PITCH_RANGE = (0, 100)
VOLUME_RANGE = (0, 200)

_SynthCallback = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


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
    library = _EspeakLibrary.get()
    with library.lock:
        if library.set_voice(voice) != _EE_OK:
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
        library: _EspeakLibrary,
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
        job = _SynthJob(stop)
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


class _SynthJob:
    """One synthesis: the buffers go to ``output`` (then None); ``cancelled`` or ``stop``
    aborts it."""

    def __init__(self, stop: Callable[[], bool] | None = None) -> None:
        self.output: queue.SimpleQueue[np.ndarray | BaseException | None] = queue.SimpleQueue()
        self.cancelled = False
        self.stop = stop

    def should_abort(self) -> bool:
        return self.cancelled or (self.stop is not None and self.stop())


class _EspeakLibrary:
    """The process-wide libespeak-ng, initialized once; ``lock`` serializes everything."""

    _instance: _EspeakLibrary | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls) -> _EspeakLibrary:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        import espeakng_loader

        self.lock = threading.Lock()
        self._job: _SynthJob | None = None
        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_SetSynthCallback.argtypes = [_SynthCallback]
        lib.espeak_SetSynthCallback.restype = None
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetParameter.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [
            ctypes.c_void_p,  # text
            ctypes.c_size_t,  # size in bytes, including the terminating NUL
            ctypes.c_uint,  # position
            ctypes.c_int,  # position type
            ctypes.c_uint,  # end position (0: none)
            ctypes.c_uint,  # flags
            ctypes.POINTER(ctypes.c_uint),  # unique identifier (unused)
            ctypes.c_void_p,  # user data (unused: the job is in self._job)
        ]
        lib.espeak_Synth.restype = ctypes.c_int
        data_path = espeakng_loader.get_data_path()
        rate = lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, _BUFFER_MS, data_path.encode(), _INITIALIZE_DONT_EXIT
        )
        if rate <= 0:
            raise SpeechBackendError(
                f"espeak_Initialize failed ({rate}) with data path {data_path!r}"
            )
        self.sample_rate: int = rate
        # Keep a reference: ctypes does not, and a collected callback crashes the next synthesis.
        self._callback = _SynthCallback(self._on_audio)
        lib.espeak_SetSynthCallback(self._callback)
        self._lib = lib
        logger.info("espeak-ng initialized at %d Hz from %s", rate, data_path)

    def set_voice(self, voice: str) -> int:
        """Select ``voice``; the caller holds ``lock``. Returns espeak's status (0 = ok)."""
        return self._lib.espeak_SetVoiceByName(voice.encode())

    def synthesize(
        self, job: _SynthJob, text: str, voice: str, params: tuple[tuple[int, int], ...]
    ) -> None:
        """Speak ``text`` into ``job.output`` (run on the job's thread); always ends with None."""
        try:
            with self.lock:
                if job.cancelled:
                    return
                if self.set_voice(voice) != _EE_OK:
                    raise SpeechBackendError(f"espeak-ng lost voice {voice!r}")
                for param, value in params:
                    self._lib.espeak_SetParameter(param, value, 0)
                encoded = text.encode("utf-8") + b"\0"
                self._job = job
                try:
                    status = self._lib.espeak_Synth(
                        encoded, len(encoded), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None
                    )
                finally:
                    self._job = None
                if status != _EE_OK:
                    raise SpeechBackendError(f"espeak_Synth failed with status {status}")
        except BaseException as exc:
            job.output.put(exc)
        finally:
            job.output.put(None)

    def _on_audio(self, wav: Any, count: int, _events: Any) -> int:
        """espeak's synth callback: copy the buffer out; returning 1 aborts the synthesis."""
        job = self._job
        if job is None:
            return 0
        if job.should_abort():
            return 1
        if count > 0 and wav:
            job.output.put(np.ctypeslib.as_array(wav, shape=(count,)).copy())
        return 0
