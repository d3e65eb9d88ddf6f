"""Whisper through CTranslate2 (faster-whisper): int8 on the CPU, float16 on CUDA.

Loads any Whisper model in CTranslate2's format: a local folder (config.json, model.bin,
tokenizer.json), the bundled Whisper tiny.en (`bundled:whisper-tiny.en`, stages.backends.
bundled), or a Hugging Face id where downloads work. A turn is a stream of windows re-decoded
for partials, as with the transformers backend (stages.backends.whisper_stream). Decodes are
greedy, with no temperature fallback and no timestamps: a turn is short, and a retry at a
higher temperature would double a slow decode (on 2 cores it settled an interruption too late
to count). Whisper sometimes falls into a loop ("Wait, how much? No, no, no, no, ..."), most on
the smaller models and on damaged speech: a decode never runs longer than its audio could hold
words, so a loop costs a few tokens, not Whisper's 448.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from stages.backends.speech import (
    SpeechModelNotFoundError,
    SpeechOptionError,
    pcm16_to_float,
    reject_unknown_options,
)
from stages.backends.whisper_stream import WhisperStream
from stages.messages import CALLER_RATE
from stages.passlog import PassLog

logger = logging.getLogger(__name__)

COMPUTE_TYPES = ("default", "int8", "int8_float16", "int8_float32", "float16", "float32")
WINDOW_S = 30  # Whisper's input window
# tokens a decode may make: fast speech is 4-5 tokens a second; a loop stops here
TOKENS_A_SECOND, TOKENS_AT_LEAST = 8, 16


def load_ctranslate2_whisper(
    model: str,
    device: str = "cpu",
    partial_interval_ms: int = 600,
    *,
    language: str | None = "en",
    compute_type: str | None = None,
    cpu_threads: int = 1,
    workers: int = 1,
    beam_size: int = 1,
    initial_prompt: str | None = None,
    warmup: bool = True,
    **unknown: Any,
) -> CTranslate2Whisper:
    """Load a CTranslate2 Whisper model (a folder, or a hub id already cached).

    ``compute_type``: int8 on the CPU and float16 on CUDA unless given. ``cpu_threads``: the
    threads one decode uses; ``workers``: decodes that may run at once (each with its own
    threads). ``language``: None detects it (multilingual models only). ``initial_prompt``:
    text Whisper reads as what was said before each turn (its style and words are taken as
    likelier). ``warmup``: one decode now, so the first turn is not slow.
    """
    reject_unknown_options(
        "ctranslate2 whisper",
        unknown,
        (
            "language",
            "compute_type",
            "cpu_threads",
            "workers",
            "beam_size",
            "initial_prompt",
            "warmup",
        ),
    )
    if initial_prompt is not None and not isinstance(initial_prompt, str):
        raise SpeechOptionError(
            f"ctranslate2 whisper option initial_prompt={initial_prompt!r} must be text"
        )
    for name, value in (
        ("cpu_threads", cpu_threads),
        ("workers", workers),
        ("beam_size", beam_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpeechOptionError(f"ctranslate2 whisper option {name}={value!r} must be >= 1")
    if isinstance(partial_interval_ms, bool) or not isinstance(partial_interval_ms, int):
        raise SpeechOptionError(f"partial_interval_ms={partial_interval_ms!r} must be an int (ms)")
    kind = device.partition(":")[0]
    if kind not in ("cpu", "cuda"):
        raise SpeechOptionError(f"ctranslate2 whisper device={device!r}: use 'cpu' or 'cuda[:N]'")
    compute_type = compute_type or ("float16" if kind == "cuda" else "int8")
    if compute_type not in COMPUTE_TYPES:
        raise SpeechOptionError(
            f"ctranslate2 whisper option compute_type={compute_type!r}: one of {COMPUTE_TYPES}"
        )
    from faster_whisper import WhisperModel

    index = int(device.partition(":")[2] or 0)
    started = time.monotonic()
    try:
        whisper = WhisperModel(
            model,
            device=kind,
            device_index=index,
            compute_type=compute_type,
            cpu_threads=cpu_threads,
            num_workers=workers,
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise SpeechModelNotFoundError(
            f"cannot load the CTranslate2 Whisper model {model!r}: {type(exc).__name__}: {exc}"
        ) from exc
    recognizer = CTranslate2Whisper(
        whisper,
        partial_interval_ms=partial_interval_ms,
        language=language if whisper.model.is_multilingual else None,
        beam_size=beam_size,
        initial_prompt=initial_prompt or None,
    )
    if warmup:
        recognizer.transcribe(np.zeros(CALLER_RATE // 2, np.int16))
    logger.info(
        "ctranslate2 whisper %s (%s, %s, %d thread(s)) loaded in %.1f s",
        model,
        kind,
        compute_type,
        cpu_threads,
        time.monotonic() - started,
    )
    return recognizer


class CTranslate2Whisper:
    """A loaded CTranslate2 Whisper model; streams share it."""

    name = "ctranslate2"
    sample_rate = CALLER_RATE
    window_samples = WINDOW_S * CALLER_RATE

    def __init__(
        self,
        model: Any,
        *,
        partial_interval_ms: int,
        language: str | None,
        beam_size: int,
        initial_prompt: str | None = None,
    ) -> None:
        self._model = model
        self._initial_prompt = initial_prompt
        self.partial_interval_ms = partial_interval_ms
        self._language = language
        self._beam_size = beam_size
        self.passes = PassLog("ctranslate2 whisper", "decodes")

    def open_stream(self) -> WhisperStream:
        return WhisperStream(self)

    def transcribe(self, pcm16: np.ndarray) -> str:
        """Up to one window of 16 kHz int16 audio as text (thread-safe: CTranslate2 queues
        decodes beyond its workers)."""
        started = time.perf_counter()
        seconds = min(len(pcm16), self.window_samples) / CALLER_RATE
        segments, _ = self._model.transcribe(
            pcm16_to_float(pcm16),
            language=self._language,
            beam_size=self._beam_size,
            temperature=0.0,
            max_new_tokens=TOKENS_AT_LEAST + int(TOKENS_A_SECOND * seconds),
            without_timestamps=True,
            condition_on_previous_text=False,
            initial_prompt=self._initial_prompt,
            vad_filter=False,
        )
        text = " ".join(segment.text.strip() for segment in segments).strip()
        self.passes.add(1, time.perf_counter() - started)
        return text
