"""libespeak-ng from the espeakng-loader wheel, through ctypes: espeak-ng's own synthesis
(stages.backends.tts_espeak) and its text to IPA phonemes (stages.backends.tts_piper).

espeak-ng is a process-wide library with global state (one voice, one set of parameters, one
callback), so every call holds ``EspeakLibrary.lock``. Synthesis runs in synchronous mode:
``espeak_Synth`` returns only when the whole text is spoken, calling back with ~50 ms buffers.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from stages.backends.speech import SpeechBackendError

logger = logging.getLogger(__name__)

# speak_lib.h constants.
AUDIO_OUTPUT_SYNCHRONOUS = 2
INITIALIZE_DONT_EXIT = 0x8000  # return an error instead of calling exit() on bad data
CHARS_UTF8 = 1
POS_CHARACTER = 1
PHONEMES_IPA = 0x02
EE_OK = 0
#: Length of the buffers espeak hands to the callback.
BUFFER_MS = 50

_SynthCallback = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


class SynthJob:
    """One synthesis: the buffers go to ``output`` (then None); ``cancelled`` or ``stop``
    aborts it."""

    def __init__(self, stop: Callable[[], bool] | None = None) -> None:
        self.output: queue.SimpleQueue[np.ndarray | BaseException | None] = queue.SimpleQueue()
        self.cancelled = False
        self.stop = stop

    def should_abort(self) -> bool:
        return self.cancelled or (self.stop is not None and self.stop())


class EspeakLibrary:
    """The process-wide libespeak-ng, initialized once; ``lock`` serializes everything."""

    _instance: EspeakLibrary | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls) -> EspeakLibrary:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        import espeakng_loader

        self.lock = threading.Lock()
        self._job: SynthJob | None = None
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
        lib.espeak_TextToPhonemes.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),  # the text; moved past the clause it converted
            ctypes.c_int,  # text encoding
            ctypes.c_int,  # phoneme mode
        ]
        lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
        data_path = espeakng_loader.get_data_path()
        rate = lib.espeak_Initialize(
            AUDIO_OUTPUT_SYNCHRONOUS, BUFFER_MS, data_path.encode(), INITIALIZE_DONT_EXIT
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
        self, job: SynthJob, text: str, voice: str, params: tuple[tuple[int, int], ...]
    ) -> None:
        """Speak ``text`` into ``job.output`` (run on the job's thread); always ends with None."""
        try:
            with self.lock:
                if job.cancelled:
                    return
                if self.set_voice(voice) != EE_OK:
                    raise SpeechBackendError(f"espeak-ng lost voice {voice!r}")
                for param, value in params:
                    self._lib.espeak_SetParameter(param, value, 0)
                encoded = text.encode("utf-8") + b"\0"
                self._job = job
                try:
                    status = self._lib.espeak_Synth(
                        encoded, len(encoded), 0, POS_CHARACTER, 0, CHARS_UTF8, None, None
                    )
                finally:
                    self._job = None
                if status != EE_OK:
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

    def clauses(self, text: str, voice: str) -> list[tuple[str, str]]:
        """`text` as IPA a clause at a time, each with the text of the clause it speaks.

        espeak_TextToPhonemes converts one clause a call and moves the text pointer past it,
        one character further than the clause (espeak reads a character ahead), which is
        handed to the next clause here. The punctuation that ended a clause is in its text,
        not in its phonemes."""
        raw = text.encode("utf-8")
        buffer = ctypes.create_string_buffer(raw)
        base = ctypes.addressof(buffer)
        pointer = ctypes.c_void_p(base)
        out: list[tuple[str, str]] = []
        carried = ""
        with self.lock:
            if self.set_voice(voice) != EE_OK:
                raise SpeechBackendError(f"espeak-ng has no voice {voice!r}")
            while pointer.value is not None:
                start = pointer.value - base
                ipa = self._lib.espeak_TextToPhonemes(
                    ctypes.byref(pointer), CHARS_UTF8, PHONEMES_IPA
                )
                end = len(raw) if pointer.value is None else pointer.value - base
                spoken = raw[start:end].decode("utf-8", "replace")
                if pointer.value is not None and spoken:
                    clause, carried = carried + spoken[:-1], spoken[-1]
                else:
                    clause, carried = carried + spoken, ""
                out.append(((ipa or b"").decode("utf-8"), clause))
        return out
