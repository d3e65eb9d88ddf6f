"""Whisper speech recognizer through transformers (a local folder, or a hub id already cached).
A turn is a stream of windows re-decoded for partials (stages.backends.whisper_stream).

One model serves all streams of the process. Whisper's input is a fixed-size window, so decodes
asked for at the same time (turns of several callers ending together, on the encoder stage's
threads) run as one batch: whichever thread gets the model decodes everything waiting.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from stages.backends.speech import (
    SpeechOptionError,
    gpu_stream,
    load_error,
    pcm16_to_float,
    reject_unknown_options,
    resolve_model_path,
    set_torch_threads,
    warn_if_random_weights,
)
from stages.backends.speech import torch_device as load_device
from stages.backends.whisper_greedy import GreedyDecoder
from stages.backends.whisper_static import StaticDecoder
from stages.backends.whisper_stream import WhisperStream
from stages.messages import CALLER_RATE
from stages.passlog import PassLog

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_DTYPES = ("float32", "float16", "bfloat16")
_DECODE_LOOPS = ("greedy", "static", "generate")


def load_whisper(
    model: str,
    device: str = "cpu",
    partial_interval_ms: int = 600,
    *,
    language: str | None = "en",
    task: str = "transcribe",
    max_new_tokens: int | None = None,
    max_batch: int = 16,
    dtype: str | None = None,
    num_threads: int | None = None,
    stream_priority: str = "normal",
    decode_loop: str | None = None,
    warmup: bool = True,
    **unknown: Any,
) -> WhisperRecognizer:
    """Load a Whisper checkpoint (folder with config, weights and processor files, or hub id).

    ``partial_interval_ms``: audio between partial re-decodes (0: no partials, only the final).
    ``language``/``task``: for multilingual checkpoints (ignored by English-only ones).
    ``max_new_tokens``: cap per decode (default: the checkpoint's ``max_length``).
    ``max_batch``: most windows decoded in one batch (decodes asked for together are batched).
    ``dtype``: float32 on the CPU, float16 on CUDA unless given. ``num_threads``: torch intra-op
    threads of this process (process-wide). ``stream_priority``: "high" runs the decodes on a
    CUDA stream the GPU schedules ahead of other work (stages.backends.speech.gpu_stream).
    ``decode_loop``: "greedy" (stages.backends.whisper_greedy: generate's tokens for less host
    work), "static" (stages.backends.whisper_static: the same from fixed buffers, a CUDA graph a
    step on a GPU; its buffers hold ``max_batch`` windows) or "generate" (transformers' own;
    needed to detect the language, ``language=None``). Default: static on CUDA, greedy on the
    CPU.
    ``warmup``: run one decode now so the first turn is not slow.
    """

    reject_unknown_options(
        "whisper",
        unknown,
        (
            "model",
            "device",
            "partial_interval_ms",
            "language",
            "task",
            "max_new_tokens",
            "max_batch",
            "dtype",
            "num_threads",
            "stream_priority",
            "decode_loop",
            "warmup",
        ),
    )
    if isinstance(partial_interval_ms, bool) or not isinstance(partial_interval_ms, int):
        raise SpeechOptionError(
            f"whisper option partial_interval_ms={partial_interval_ms!r} must be an int (ms)"
        )
    if partial_interval_ms < 0:
        raise SpeechOptionError(
            f"whisper option partial_interval_ms={partial_interval_ms} must be >= 0 "
            "(0: no partials)"
        )
    if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
        raise SpeechOptionError(f"whisper option max_new_tokens={max_new_tokens!r} must be >= 1")
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise SpeechOptionError(f"whisper option max_batch={max_batch!r} must be an int >= 1")
    if task not in ("transcribe", "translate"):
        raise SpeechOptionError(f"whisper option task={task!r} must be 'transcribe' or 'translate'")
    torch_device = load_device(device, "whisper")
    if decode_loop is None:
        decode_loop = "static" if torch_device.type == "cuda" else "greedy"
    if decode_loop not in _DECODE_LOOPS:
        raise SpeechOptionError(
            f"whisper option decode_loop={decode_loop!r} must be one of {_DECODE_LOOPS}"
        )
    on_stream = gpu_stream(torch_device, stream_priority, "whisper")
    torch_dtype = _torch_dtype(dtype, torch_device)
    set_torch_threads(num_threads, "whisper")

    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    path = resolve_model_path(model, "whisper model")
    random_weights = warn_if_random_weights(path, "whisper model")
    started = time.perf_counter()
    try:
        processor = WhisperProcessor.from_pretrained(path)
        network = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch_dtype)
    except OSError as exc:
        raise load_error("whisper model", path, exc) from exc
    network.to(torch_device).eval()
    recognizer = WhisperRecognizer(
        network,
        processor,
        partial_interval_ms=partial_interval_ms,
        language=language,
        task=task,
        max_new_tokens=max_new_tokens,
        max_batch=max_batch,
        random_weights=random_weights,
        on_stream=on_stream,
        decode_loop=decode_loop,
    )
    if warmup:
        recognizer.record_steps()
        recognizer.transcribe(np.zeros(CALLER_RATE, dtype=np.int16))
    logger.info(
        "whisper %s loaded on %s (%s) in %.2f s",
        path,
        torch_device,
        str(torch_dtype).removeprefix("torch."),
        time.perf_counter() - started,
    )
    return recognizer


def _torch_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    import torch

    if dtype is None:
        return torch.float16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise SpeechOptionError(f"whisper option dtype={dtype!r} must be one of {_DTYPES}")
    return getattr(torch, dtype)


class WhisperRecognizer:
    """A loaded Whisper model and processor; streams share it, one decode at a time."""

    name = "whisper"
    sample_rate = CALLER_RATE

    def __init__(
        self,
        model: Any,
        processor: Any,
        *,
        partial_interval_ms: int = 600,
        language: str | None = "en",
        task: str = "transcribe",
        max_new_tokens: int | None = None,
        max_batch: int = 16,
        random_weights: bool = False,
        on_stream: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        decode_loop: str = "greedy",
    ) -> None:
        self._model = model
        self._on_stream = on_stream  # where its GPU work runs (gpu_stream)
        self._processor = processor
        self.partial_interval_ms = partial_interval_ms
        self.random_weights = random_weights
        #: Audio one decode sees: the feature extractor pads or cuts everything to this (30 s).
        self.window_samples: int = int(processor.feature_extractor.n_samples)
        self._lock = threading.Lock()  # held while the model decodes a batch
        self._waiting_lock = threading.Lock()
        self._waiting: list[_Decode] = []
        self.max_batch = max_batch
        device = model.device
        self._feature_device = "cpu" if device.type == "cpu" else str(device)
        # every 10 s: windows a batch, ms a batch, and the feature and queueing time a window
        self.passes = PassLog("whisper", "windows")
        self._generation_config = copy.deepcopy(model.generation_config)
        self._generate_kwargs: dict[str, Any] = {}
        if max_new_tokens is not None:
            # Both set makes transformers complain; max_new_tokens is what we mean.
            self._generation_config.max_new_tokens = max_new_tokens
            self._generation_config.max_length = None
        if getattr(self._generation_config, "is_multilingual", False):
            self._generate_kwargs["task"] = task
            if language is not None:
                self._generate_kwargs["language"] = self._language_code(language)
            elif decode_loop != "generate":
                raise SpeechOptionError(
                    "whisper option language=None (detect it) needs decode_loop='generate'"
                )
        loop = {"greedy": GreedyDecoder, "static": StaticDecoder}.get(decode_loop)
        language_code = self._generate_kwargs.get("language")
        self._greedy = (
            None if loop is None else loop(model, self._generation_config, language_code, task)
        )

    def record_steps(self) -> None:
        """With the static decoder on CUDA, record its step for every batch size now (its
        buffers sized for `max_batch` windows), not during the first turns that need them."""
        import torch

        if isinstance(self._greedy, StaticDecoder):
            with self._on_stream(), torch.inference_mode():
                self._greedy.record(self.max_batch)

    def open_stream(self) -> WhisperStream:
        """Start a turn (cheap: a stream is an audio buffer)."""
        return WhisperStream(self)

    def transcribe(self, pcm16: np.ndarray) -> str:
        """Transcribe up to one window of 16 kHz int16 audio (thread-safe; batched with the
        decodes other threads ask for meanwhile)."""
        started = time.perf_counter()
        # the log-mel spectrogram on the model's device: on the CPU it took longer than the
        # decode itself under load (a 30 s window's STFT, on every waiting thread at once)
        with self._on_stream():
            features = self._processor.feature_extractor(
                pcm16_to_float(pcm16),
                sampling_rate=CALLER_RATE,
                return_tensors="pt",
                device=self._feature_device,
            ).input_features
        request = _Decode(features, started)
        with self._waiting_lock:
            self._waiting.append(request)
        while not request.done:
            with self._lock:  # the model, one batch at a time
                if request.done:  # another thread decoded it while we waited
                    break
                with self._waiting_lock:
                    batch = self._waiting[: self.max_batch]
                    del self._waiting[: self.max_batch]
                self._decode(batch)
        if request.error is not None:
            raise request.error
        return request.text

    def _decode(self, batch: list[_Decode]) -> None:
        import torch

        started = time.perf_counter()
        try:
            with self._on_stream(), torch.inference_mode():
                features = torch.cat([r.features for r in batch])
                features = features.to(self._model.device, self._model.dtype)
                if self._greedy is not None:
                    token_ids = self._greedy.decode(features)
                else:
                    token_ids = self._model.generate(
                        features, generation_config=self._generation_config, **self._generate_kwargs
                    )
                token_ids = token_ids.cpu()  # copied on the stream that made them
            texts = self._processor.tokenizer.batch_decode(token_ids, skip_special_tokens=True)
            for request, text in zip(batch, texts, strict=True):
                request.text = text.strip()
        except Exception as exc:
            for request in batch:
                request.error = exc
        finally:
            for request in batch:
                request.done = True
            self.passes.add(
                len(batch),
                time.perf_counter() - started,
                features=sum(r.queued - r.asked for r in batch) / len(batch),
                waited=sum(started - r.queued for r in batch) / len(batch),
            )

    def _language_code(self, language: str) -> str:
        from transformers.models.whisper.tokenization_whisper import TO_LANGUAGE_CODE

        code = TO_LANGUAGE_CODE.get(language.lower(), language.lower())
        known = getattr(self._generation_config, "lang_to_id", None) or {}
        if f"<|{code}|>" not in known:
            sample = ", ".join(sorted(token.strip("<|>") for token in known)[:12])
            raise SpeechOptionError(
                f"whisper option language={language!r}: not a language of this model "
                f"({len(known)} known: {sample}{', ...' if len(known) > 12 else ''})"
            )
        return code


class _Decode:
    """One window waiting to be decoded, and its outcome."""

    __slots__ = ("asked", "done", "error", "features", "queued", "text")

    def __init__(self, features: Any, asked: float) -> None:
        self.features = features
        self.asked = asked  # perf_counter when transcribe was called
        self.queued = time.perf_counter()  # features ready
        self.text = ""
        self.error: Exception | None = None
        self.done = False
