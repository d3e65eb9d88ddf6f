"""What the encoder and vocoder stages need from a speech backend, and helpers the backends share.

A ``SpeechRecognizer`` is loaded once per encoder process and opens one ``RecognizerStream`` per
user turn; a ``Voice`` is loaded once per vocoder process and turns text into PCM16 chunks as they
are produced. Every backend module has a ``load_*`` function that takes the options of the YAML
config as keyword arguments and fails early, naming the bad option or the missing path.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

from stages.backends.tiny_chat_model import has_random_weights

logger = logging.getLogger(__name__)

#: Longest audio chunk a voice yields, so playout can start (and stop) at a fine grain.
MAX_CHUNK_MS = 100


class SpeechRecognizer(Protocol):
    """A loaded speech recognizer; cheap to open streams on."""

    name: str
    sample_rate: int

    def open_stream(self) -> RecognizerStream:
        """Start recognizing one user turn."""
        ...


class RecognizerStream(Protocol):
    """Recognition of one user turn, fed audio as it arrives."""

    def feed(self, pcm16: np.ndarray) -> str | None:
        """Add int16 mono audio; return the partial transcript when it changed, else None."""
        ...

    def finish(self) -> str:
        """Return the final transcript of the turn; the stream is done afterwards."""
        ...

    def close(self) -> None:
        """Drop the turn without a result (cancel); idempotent."""
        ...

    # A backend's stream may also have `peek(silence_after: int = 0) -> str`: the final
    # transcript if the turn ended after `silence_after` more samples of silence, the stream
    # staying open (the encoder's early transcript at a pause; stages.encoder).


class Voice(Protocol):
    """A loaded text-to-speech voice."""

    name: str
    sample_rate: int

    def synthesize(self, text: str, stop: Callable[[], bool] | None = None) -> Iterator[np.ndarray]:
        """Yield int16 mono chunks of at most ``MAX_CHUNK_MS`` as they are produced.

        Closing the iterator early stops the synthesis. ``stop`` is asked as often as the
        engine can stop (every decoder step of a neural voice); once it returns True the
        iterator ends at once, without waiting for a consumer to close it: that is how a
        CANCEL reaches the engine within a step.
        """
        ...


class PhraseStream(Protocol):
    """A phrase a batching voice speaks a block per `advance` (tts_speecht5, tts_talker)."""

    done: bool

    def close(self) -> None: ...


class BlockVoice(Protocol):
    """A voice whose phrases advance a block at a time, several in one pass (the vocoder
    steps them together)."""

    sample_rate: int

    def begin(self, text: str, stop: Callable[[], bool] | None = None) -> PhraseStream: ...

    def advance(self, streams: Sequence[Any]) -> list[np.ndarray]: ...


def speak_by_blocks(
    voice: BlockVoice, text: str, stop: Callable[[], bool] | None, chunk_ms: int
) -> Iterator[np.ndarray]:
    """`Voice.synthesize` of a batching voice: one phrase advanced alone, its blocks yielded in
    chunks of at most ``chunk_ms``; closing the iterator ends the phrase."""
    stream = voice.begin(text, stop)
    try:
        while not stream.done:
            (block,) = voice.advance([stream])
            yield from split_pcm16(block, voice.sample_rate, chunk_ms)
    finally:
        stream.close()


class SpeechBackendError(RuntimeError):
    """Base class of the errors the speech backends raise."""


class SpeechModelNotFoundError(SpeechBackendError, FileNotFoundError):
    """A model, vocoder or speaker-embedding path does not exist or cannot be loaded."""


class SpeechOptionError(SpeechBackendError, ValueError):
    """A backend option is unknown or has a bad value."""


class StreamClosedError(SpeechBackendError):
    """A recognizer stream was used after ``finish()`` or ``close()``."""


def reject_unknown_options(backend: str, options: Mapping[str, Any], known: Iterable[str]) -> None:
    """Raise ``SpeechOptionError`` naming the first unknown option (and the closest known ones)."""
    known = sorted(known)
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise SpeechOptionError(
                f"unknown {backend} option {key!r}{hint} (known: {', '.join(known)})"
            )


def resolve_model_path(model: str, what: str) -> str:
    """Return a local model folder as an absolute path; leave a hub model id as it is.

    ``what`` names the model in errors ("whisper model", "speecht5 vocoder"). A ``model`` written
    as a path (absolute, ``./``, ``../`` or ``~``) must exist and hold a ``config.json``.
    """
    if not model:
        raise SpeechModelNotFoundError(f"{what}: no model path or id given")
    path = Path(model).expanduser()
    if path.exists():
        if not (path.is_dir() and (path / "config.json").is_file()):
            raise SpeechModelNotFoundError(
                f"{what} path {str(path)!r} is not a Hugging Face model folder (no config.json)"
            )
        return str(path.resolve())
    if model.startswith(("/", ".", "~")):
        raise SpeechModelNotFoundError(f"{what} path {str(path)!r} does not exist")
    return model


def load_error(what: str, model: str, exc: Exception) -> SpeechModelNotFoundError:
    """The error for a model that ``from_pretrained`` could not load (often: not downloadable)."""
    hint = "" if Path(model).is_absolute() else " (no local folder of that name either)"
    return SpeechModelNotFoundError(
        f"cannot load {what} {model!r}{hint}: {type(exc).__name__}: {exc}. "
        "Pass a local folder; hub ids work only when the model is already in the HF cache."
    )


def warn_if_random_weights(model: str, what: str) -> bool:
    """Warn (log) when ``model`` is a local folder built with random weights; return that flag."""
    path = Path(model)
    if path.is_dir() and has_random_weights(path):
        logger.warning(
            "%s %s has RANDOM weights (built for tests): its output is noise", what, path
        )
        return True
    return False


def as_pcm16(pcm16: np.ndarray) -> np.ndarray:
    """Check that ``pcm16`` is int16 mono audio and return it as a flat array (no copy)."""
    if not isinstance(pcm16, np.ndarray) or pcm16.dtype != np.int16:
        kind = pcm16.dtype if isinstance(pcm16, np.ndarray) else type(pcm16).__name__
        raise TypeError(f"expected an int16 numpy array of PCM samples, got {kind}")
    if pcm16.ndim != 1 and not (pcm16.ndim == 2 and 1 in pcm16.shape):
        raise ValueError(f"expected mono audio (one channel), got shape {pcm16.shape}")
    return pcm16.reshape(-1)


def float_to_pcm16(audio: np.ndarray) -> np.ndarray:
    """Float audio in [-1, 1] to int16, clipping what lies outside."""
    audio = np.asarray(audio, dtype=np.float32).reshape(-1)
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype(np.int16)


def pcm16_to_float(pcm16: np.ndarray) -> np.ndarray:
    """int16 audio to float32 in [-1, 1), the input format of neural feature extractors."""
    return pcm16.astype(np.float32) / 32768.0


def max_chunk_samples(sample_rate: int, max_ms: int = MAX_CHUNK_MS) -> int:
    """Samples in ``max_ms`` of audio at ``sample_rate`` (at least one)."""
    return max(1, sample_rate * max_ms // 1000)


def split_pcm16(
    pcm16: np.ndarray, sample_rate: int, max_ms: int = MAX_CHUNK_MS
) -> Iterator[np.ndarray]:
    """Split audio into consecutive views of at most ``max_ms`` each; nothing for empty audio."""
    step = max_chunk_samples(sample_rate, max_ms)
    for start in range(0, len(pcm16), step):
        yield pcm16[start : start + step]


def torch_device(device: str, backend: str) -> torch.device:
    """``device`` as a torch device, refusing one this machine does not have."""
    import torch

    try:
        found = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise SpeechOptionError(f"{backend} option device={device!r}: {exc}") from exc
    if found.type == "cuda" and not torch.cuda.is_available():
        raise SpeechOptionError(f"{backend} option device={device!r}: CUDA is not available here")
    return found


def set_torch_threads(num_threads: int | None, backend: str) -> None:
    """Set torch's intra-op threads for the process (None leaves torch's default)."""
    if num_threads is None:
        return
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise SpeechOptionError(f"{backend} option num_threads={num_threads!r} must be >= 1")
    import torch

    torch.set_num_threads(num_threads)


STREAM_PRIORITIES = ("normal", "high")


def gpu_stream(
    device: torch.device, priority: str, backend: str
) -> Callable[[], AbstractContextManager[Any]]:
    """A context to run the backend's GPU work in: the default stream (``priority`` "normal"),
    or a stream of the highest priority the GPU has ("high"), whose blocks its scheduler
    starts ahead of waiting blocks of other streams. Used where a short, latency-bound model
    (Whisper's turn, the first audio of a reply) shares the GPU with a long-running one
    (vLLM's decode). On the CPU either value runs as it is."""
    if priority not in STREAM_PRIORITIES:
        raise SpeechOptionError(
            f"{backend} option stream_priority={priority!r} must be one of {STREAM_PRIORITIES}"
        )
    if priority == "normal" or device.type != "cuda":
        return contextlib.nullcontext
    import torch

    streams: list[torch.cuda.Stream] = []
    lock = threading.Lock()

    def on_stream() -> AbstractContextManager[Any]:
        with lock:
            if not streams:  # made at first use, once the weights are on the GPU
                torch.cuda.synchronize(device)  # they were copied in on the default stream
                streams.append(torch.cuda.Stream(device, priority=-100))  # clamped to the top
                logger.info("%s: GPU work on a stream of priority %d", backend, streams[0].priority)
        return torch.cuda.stream(streams[0])

    return on_stream
