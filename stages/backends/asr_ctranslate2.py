"""Whisper through CTranslate2 (faster-whisper): int8 on the CPU, float16 on CUDA.

Loads any Whisper model in CTranslate2's format: a local folder (config.json, model.bin,
tokenizer.json), the bundled Whisper tiny.en (`bundled:whisper-tiny.en`, stages.backends.
bundled), or a Hugging Face id where downloads work. A turn is a stream of windows re-decoded
for partials, as with the transformers backend (stages.backends.whisper_stream). Decodes are
at temperature 0 (greedy, or a beam), with no temperature fallback and no timestamps: a turn
is short, and a retry at a higher temperature would double a slow decode (on 2 cores it
settled an interruption too late to count). Whisper sometimes falls into a loop ("Wait, how
much? No, no, no, no, ..."), most on the smaller models and on damaged speech: a decode never
runs longer than its audio could hold words, so a loop costs a few tokens, not Whisper's 448.
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
FRAMES_A_SECOND = 100  # its mel frames
NO_SPEECH, LOW_LOGPROB = 0.6, -1.0  # faster-whisper's thresholds for a silent segment
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
    pad_to_s: float = WINDOW_S,
    warmup: bool = True,
    **unknown: Any,
) -> CTranslate2Whisper:
    """Load a CTranslate2 Whisper model (a folder, or a hub id already cached).

    ``compute_type``: int8 on the CPU and float16 on CUDA unless given. ``cpu_threads``: the
    threads one decode uses; ``workers``: decodes that may run at once (each with its own
    threads). ``language``: None detects it (multilingual models only). ``initial_prompt``:
    text Whisper reads as what was said before each turn (its style and words are taken as
    likelier). ``pad_to_s``: the shortest input Whisper's encoder reads, a turn padded to it
    (CTranslate2Whisper). ``warmup``: one decode now, so the first turn is not slow.
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
            "pad_to_s",
            "warmup",
        ),
    )
    if (
        isinstance(pad_to_s, bool)
        or not isinstance(pad_to_s, int | float)
        or not 1 <= pad_to_s <= WINDOW_S
    ):
        raise SpeechOptionError(
            f"ctranslate2 whisper option pad_to_s={pad_to_s!r} must be 1..{WINDOW_S} (seconds)"
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
        pad_to_s=pad_to_s,
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
    """A loaded CTranslate2 Whisper model; streams share it.

    A turn's decode is faster-whisper's at temperature 0 for one segment (its prompt, its
    suppressed tokens, its no-speech rule), with one difference: Whisper's encoder reads the
    turn padded to `pad_to_s`, not always to 30 s. Its cost grows with its input, and a turn is
    a few seconds: on 2 cores a tiny.en decode took about 540 ms padded to 30 s, 180 to 10 s.
    Whisper was trained on 30 s inputs; padded only to the end of the speech it loops (says the
    question twice), so a turn still gets several seconds of padding (docs/lab-notes.md,
    "Whisper's input, padded to less than 30 s")."""

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
        pad_to_s: float = WINDOW_S,
    ) -> None:
        self._model = model
        self.partial_interval_ms = partial_interval_ms
        self._beam_size = beam_size
        self._pad_frames = min(round(pad_to_s * FRAMES_A_SECOND), WINDOW_S * FRAMES_A_SECOND)
        self._multilingual = bool(model.model.is_multilingual)
        self._language = language
        # by language: its tokenizer and the tokens a decode may not write
        self._tokenizers: dict[str | None, tuple[Any, tuple[int, ...]]] = {}
        # Whisper's context holds 448 tokens: the prompt keeps at most half of them
        half = model.max_length // 2 - 1
        tokenizer, _ = self._tokenizer(language or "en")
        self._before = (
            [tokenizer.sot_prev, *tokenizer.encode(" " + initial_prompt.strip())[-half:]]
            if initial_prompt
            else []
        )
        self.passes = PassLog("ctranslate2 whisper", "decodes")

    def _tokenizer(self, language: str | None) -> tuple[Any, tuple[int, ...]]:
        if language not in self._tokenizers:
            from faster_whisper.tokenizer import Tokenizer
            from faster_whisper.transcribe import get_suppressed_tokens

            tokenizer = Tokenizer(
                self._model.hf_tokenizer, self._multilingual, task="transcribe", language=language
            )
            self._tokenizers[language] = (tokenizer, get_suppressed_tokens(tokenizer, [-1]))
        return self._tokenizers[language]

    def open_stream(self) -> WhisperStream:
        return WhisperStream(self)

    def transcribe(self, pcm16: np.ndarray) -> str:
        """Up to one window of 16 kHz int16 audio as text (thread-safe: CTranslate2 queues
        decodes beyond its workers)."""
        from faster_whisper.audio import pad_or_trim

        started = time.perf_counter()
        pcm16 = pcm16[: self.window_samples]
        seconds = len(pcm16) / CALLER_RATE
        features = self._model.feature_extractor(pcm16_to_float(pcm16))
        content = features[:, : features.shape[-1] - 1]  # faster-whisper's last frame dropped
        encoded = self._model.encode(pad_or_trim(content, max(content.shape[-1], self._pad_frames)))
        language = self._language
        if self._multilingual and language is None:
            ((best, _), *_) = self._model.model.detect_language(encoded)[0]
            language = best[2:-2]  # "<|en|>"
        tokenizer, suppressed = self._tokenizer(language if self._multilingual else "en")
        prompt = [*self._before, *tokenizer.sot_sequence, tokenizer.no_timestamps]
        result = self._model.model.generate(
            encoded,
            [prompt],
            beam_size=self._beam_size,
            patience=1,
            length_penalty=1,
            max_length=min(
                len(prompt) + TOKENS_AT_LEAST + int(TOKENS_A_SECOND * seconds),
                self._model.max_length,
            ),
            return_scores=True,
            return_no_speech_prob=True,
            suppress_blank=True,
            suppress_tokens=suppressed,
            max_initial_timestamp_index=50,
        )[0]
        tokens = result.sequences_ids[0]
        average_logprob = result.scores[0] * len(tokens) / (len(tokens) + 1)
        # faster-whisper's rule for a segment that is silence: both unlikely speech and words
        silence = result.no_speech_prob > NO_SPEECH and average_logprob < LOW_LOGPROB
        text = "" if silence else tokenizer.decode(tokens).strip()
        self.passes.add(1, time.perf_counter() - started)
        return text
