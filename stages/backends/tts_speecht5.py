"""Neural voice: SpeechT5 text-to-speech with a HiFi-GAN vocoder, through transformers.

Real weights are microsoft/speecht5_tts and microsoft/speecht5_hifigan (local folders here, since
nothing can be downloaded). SpeechT5 is autoregressive over whole utterances; this backend runs
its decoder loop itself and vocodes every ``stream_steps`` steps (with a few frames of context
either side), so audio comes out while a phrase is being decoded, and a ``stop()`` ends it at the
next step. A text longer than the model's positions allow is spoken in word-boundary pieces.

The speaker is a 512-float x-vector from a ``.npy`` file; without one a fixed synthetic vector is
used (logged), which sounds like nobody in particular but is the same in every process.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stages.backends.speech import (
    MAX_CHUNK_MS,
    SpeechModelNotFoundError,
    SpeechOptionError,
    float_to_pcm16,
    gpu_stream,
    load_error,
    reject_unknown_options,
    resolve_model_path,
    set_torch_threads,
    speak_by_blocks,
    split_pcm16,
    warn_if_random_weights,
)
from stages.backends.speech import torch_device as load_device
from stages.backends.speecht5_batch import Utterance, decode

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: Seed of the fixed speaker vector used when no speaker embedding is given.
DEFAULT_SPEAKER_SEED = 5_1200
_DTYPES = ("float32", "float16", "bfloat16")


def load_speecht5(
    model: str,
    vocoder: str,
    speaker_embedding: str | None = None,
    device: str = "cpu",
    *,
    threshold: float = 0.5,
    minlenratio: float = 0.0,
    maxlenratio: float = 20.0,
    chunk_ms: int = MAX_CHUNK_MS,
    stream_steps: int = 4,
    dtype: str | None = None,
    num_threads: int | None = None,
    stream_priority: str = "normal",
    warmup: bool = True,
    **unknown: Any,
) -> SpeechT5Voice:
    """Load SpeechT5 (``model``: folder or cached hub id, with its processor) and its vocoder.

    ``speaker_embedding``: ``.npy`` file of the speaker's x-vector. ``threshold``, ``minlenratio``
    and ``maxlenratio`` go to ``generate_speech`` (stop probability, and bounds on mel frames per
    input token). ``chunk_ms``: the longest chunk yielded. ``stream_steps``: decoder steps (of
    ``reduction_factor`` mel frames each) per streamed block; 0 speaks whole phrases through
    ``generate_speech``. ``num_threads``: torch intra-op threads
    of this process (process-wide). ``stream_priority``: "high" runs synthesis on a CUDA stream the
    GPU schedules ahead of other processes' work (stages.backends.speech.gpu_stream).
    ``warmup``: speak one word now so the first phrase is not slow.
    """

    reject_unknown_options(
        "speecht5",
        unknown,
        (
            "model",
            "vocoder",
            "speaker_embedding",
            "device",
            "threshold",
            "minlenratio",
            "maxlenratio",
            "chunk_ms",
            "stream_steps",
            "dtype",
            "num_threads",
            "stream_priority",
            "warmup",
        ),
    )
    _check_number("threshold", threshold, 0.0, 1.0)
    _check_number("minlenratio", minlenratio, 0.0, 100.0)
    _check_number("maxlenratio", maxlenratio, 0.1, 100.0)
    if minlenratio > maxlenratio:
        raise SpeechOptionError(
            f"speecht5 options minlenratio={minlenratio} > maxlenratio={maxlenratio}"
        )
    if isinstance(chunk_ms, bool) or not isinstance(chunk_ms, int) or not 10 <= chunk_ms <= 100:
        raise SpeechOptionError(f"speecht5 option chunk_ms={chunk_ms!r} must be an int in 10..100")
    if not isinstance(stream_steps, int) or isinstance(stream_steps, bool) or stream_steps < 0:
        raise SpeechOptionError(
            f"speecht5 option stream_steps={stream_steps!r} must be an int >= 0"
        )
    torch_device = load_device(device, "speecht5")
    on_stream = gpu_stream(torch_device, stream_priority, "speecht5")
    torch_dtype = _torch_dtype(dtype)
    set_torch_threads(num_threads, "speecht5")

    from transformers import SpeechT5ForTextToSpeech, SpeechT5HifiGan, SpeechT5Processor

    model_path = resolve_model_path(model, "speecht5 model")
    vocoder_path = resolve_model_path(vocoder, "speecht5 vocoder")
    random_weights = warn_if_random_weights(model_path, "speecht5 model")
    random_weights |= warn_if_random_weights(vocoder_path, "speecht5 vocoder")
    started = time.perf_counter()
    try:
        processor = SpeechT5Processor.from_pretrained(model_path)
        network = SpeechT5ForTextToSpeech.from_pretrained(model_path, dtype=torch_dtype)
    except OSError as exc:
        raise load_error("speecht5 model", model_path, exc) from exc
    try:
        hifigan = SpeechT5HifiGan.from_pretrained(vocoder_path, dtype=torch_dtype)
    except OSError as exc:
        raise load_error("speecht5 vocoder", vocoder_path, exc) from exc
    network.to(torch_device).eval()
    hifigan.to(torch_device).eval()
    speaker = load_speaker_embedding(speaker_embedding, network.config.speaker_embedding_dim)
    voice = SpeechT5Voice(
        network,
        hifigan,
        processor,
        speaker,
        threshold=threshold,
        minlenratio=minlenratio,
        maxlenratio=maxlenratio,
        chunk_ms=chunk_ms,
        stream_steps=stream_steps,
        random_weights=random_weights,
        on_stream=on_stream,
    )
    if warmup:
        for _ in voice.synthesize("Hello."):
            pass
    logger.info(
        "speecht5 %s + %s loaded on %s in %.2f s",
        model_path,
        vocoder_path,
        torch_device,
        time.perf_counter() - started,
    )
    return voice


def load_speaker_embedding(path: str | None, dim: int) -> np.ndarray:
    """The speaker x-vector from a ``.npy`` file of ``dim`` floats, or a fixed synthetic one."""
    if path is None:
        logger.warning(
            "speecht5: no speaker_embedding given; using a fixed synthetic %d-dim speaker vector "
            "(give a .npy x-vector for a natural voice)",
            dim,
        )
        vector = np.random.default_rng(DEFAULT_SPEAKER_SEED).standard_normal(dim)
        return (vector / np.linalg.norm(vector)).astype(np.float32)
    file = Path(path).expanduser()
    if not file.is_file():
        raise SpeechModelNotFoundError(
            f"speecht5 speaker_embedding file {str(file)!r} does not exist"
        )
    try:
        vector = np.load(file, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise SpeechOptionError(
            f"speecht5 speaker_embedding {str(file)!r} is not a .npy array: {exc}"
        ) from exc
    if vector.size != dim or not np.issubdtype(vector.dtype, np.floating):
        raise SpeechOptionError(
            f"speecht5 speaker_embedding {str(file)!r} holds {vector.dtype} {vector.shape}; "
            f"the model needs {dim} floats"
        )
    return vector.reshape(-1).astype(np.float32)


def _never() -> bool:
    return False


def _check_number(option: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise SpeechOptionError(
            f"speecht5 option {option}={value!r} must be a number in {low}..{high}"
        )


def _torch_dtype(dtype: str | None) -> torch.dtype:
    import torch

    if dtype is None:
        return torch.float32
    if dtype not in _DTYPES:
        raise SpeechOptionError(f"speecht5 option dtype={dtype!r} must be one of {_DTYPES}")
    return getattr(torch, dtype)


class SpeechT5Voice:
    """A loaded SpeechT5 + HiFi-GAN with one speaker; one synthesis at a time."""

    name = "speecht5"

    def __init__(
        self,
        model: Any,
        vocoder: Any,
        processor: Any,
        speaker_embedding: np.ndarray,
        *,
        threshold: float = 0.5,
        minlenratio: float = 0.0,
        maxlenratio: float = 20.0,
        chunk_ms: int = MAX_CHUNK_MS,
        stream_steps: int = 4,
        random_weights: bool = False,
        on_stream: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        import torch

        self._on_stream = on_stream  # where its GPU work runs (gpu_stream)
        self._model = model
        self._vocoder = vocoder
        self._processor = processor
        with on_stream():  # copied in where it is used
            speaker = torch.from_numpy(speaker_embedding).reshape(1, -1)
            self._speaker = speaker.to(model.device, model.dtype)
        self._generate_kwargs = {
            "threshold": threshold,
            "minlenratio": minlenratio,
            "maxlenratio": maxlenratio,
        }
        self._chunk_ms = chunk_ms
        self.stream_steps = stream_steps
        self.random_weights = random_weights
        self.sample_rate: int = int(vocoder.config.sampling_rate)
        config = model.config
        # Tokens per call: the encoder's positions, and the decoder's when every token gets
        # maxlenratio frames (reduction_factor frames per decoder step).
        speech_limit = config.max_speech_positions * config.reduction_factor / maxlenratio
        self.max_tokens = int(min(config.max_text_positions, speech_limit)) - 2
        # frames either side that one post-net frame depends on: its convolutions' half-widths
        self._postnet_reach = config.speech_decoder_postnet_layers * (
            (config.speech_decoder_postnet_kernel - 1) // 2
        )
        self._lock = threading.Lock()

    def synthesize(self, text: str, stop: Callable[[], bool] | None = None) -> Iterator[np.ndarray]:
        """Yield int16 chunks of ``text`` spoken as they are made; closing stops the model at
        the next block (streaming) or between pieces, ``stop`` at the next decoder step."""
        if not self.stream_steps:
            stop = stop or _never
            for piece in _pieces(text, self.max_tokens):
                if stop():
                    return
                yield from split_pcm16(self._speak(piece), self.sample_rate, self._chunk_ms)
            return
        yield from speak_by_blocks(self, text, stop, self._chunk_ms)

    def begin(self, text: str, stop: Callable[[], bool] | None = None) -> SpeechT5PhraseStream:
        """A phrase to speak a block at a time with `advance`; ``stop`` as in `synthesize`."""
        return SpeechT5PhraseStream(
            collections.deque(_pieces(text, self.max_tokens)), stop or _never
        )

    def advance(self, streams: Sequence[SpeechT5PhraseStream]) -> list[np.ndarray]:
        """The next block of int16 audio of each stream (empty while a block is still short of
        its right context), the streams' decoder steps run as one batch.

        A block is `stream_steps` decoder steps (one more for a piece's first). Every block
        HiFi-GAN turns the frames that have their right context into audio (through the
        post-net, run over only the frames it needs), with some frames of left context whose
        samples are dropped, so block edges do not click. A piece's last
        block takes everything. A stream is `done` after its last block or once stopped.
        """
        import torch

        blocks = [_EMPTY] * len(streams)
        with self._lock, self._on_stream(), torch.inference_mode():
            active = [i for i, s in enumerate(streams) if self._next_piece(s)]
            decode(
                self._model,
                self._speaker,
                [streams[i].utterance for i in active],  # type: ignore[misc]
                self.stream_steps,
                self._generate_kwargs["threshold"],
            )
            due: list[tuple[int, _Segment]] = []
            for i in active:
                stream = streams[i]
                utterance = stream.utterance
                assert utterance is not None
                if utterance.cancelled:
                    stream.close()
                    continue
                if (segment := self._segment(stream)) is not None:
                    due.append((i, segment))
                if utterance.finished and not stream.pieces:
                    stream.close()
            for i, block in self._vocode(due):
                blocks[i] = block
        return blocks

    def _next_piece(self, stream: SpeechT5PhraseStream) -> bool:
        """Whether ``stream`` has decoding to do, starting its next piece if need be."""
        if stream.done:
            return False
        if stream.utterance is not None and not stream.utterance.finished:
            return True
        if not stream.pieces or stream.stop():
            stream.close()
            return False
        model, config = self._model, self._model.config
        input_ids = self._processor(text=stream.pieces.popleft(), return_tensors="pt").input_ids
        input_ids = input_ids[:, : self.max_tokens].to(model.device)
        mask = 1 - (input_ids == config.pad_token_id).int()
        encoded = model.speecht5.encoder(
            input_values=input_ids, attention_mask=mask, return_dict=True
        ).last_hidden_state
        kw, r = self._generate_kwargs, config.reduction_factor
        stream.utterance = Utterance(
            encoded,
            mask,
            minlen=int(encoded.size(1) * kw["minlenratio"] / r),
            maxlen=int(encoded.size(1) * kw["maxlenratio"] / r),
            stop=stream.stop,
            sequence=encoded.new_zeros(1, 1, config.num_mel_bins),
        )
        stream.vocoded = 0
        return True

    def _segment(self, stream: SpeechT5PhraseStream) -> _Segment | None:
        """What of the stream's spectrogram to vocode now, if anything; marks it vocoded.

        Frames that have their right context are due (all of them at a piece's end), with
        some frames of left context before them. The post-net only needs its own reach of
        frames before those, not the whole spectrogram so far.
        """
        utterance = stream.utterance
        assert utterance is not None
        total = utterance.steps * self._model.config.reduction_factor
        ready = total if utterance.finished else total - _RIGHT_CONTEXT
        if ready <= stream.vocoded:
            return None
        left = min(stream.vocoded, _LEFT_CONTEXT)
        start = stream.vocoded - left
        window = max(0, start - self._postnet_reach)
        stream.vocoded = ready
        return _Segment(utterance, window, total - window, start - window, left, total - ready)

    def _vocode(self, due: list[tuple[int, _Segment]]) -> Iterator[tuple[int, np.ndarray]]:
        """Audio of each due segment. Segments of one shape (every stream in mid-phrase is
        the same number of frames past its last block) go through the post-net and HiFi-GAN
        together, one pass for all of them."""
        import torch

        shapes: dict[tuple[int, ...], list[tuple[int, _Segment]]] = collections.defaultdict(list)
        for i, seg in due:
            shapes[seg.shape].append((i, seg))
        postnet = self._model.speech_decoder_postnet.postnet
        for group in shapes.values():
            frames = torch.cat(
                [torch.cat(seg.utterance.frames, dim=1)[:, seg.window :] for _, seg in group]
            )
            seg = group[0][1]
            mel = postnet(frames)[:, seg.offset :]
            waves = self._vocoder(mel).float()
            hop = waves.size(1) // mel.size(1)
            waves = waves[:, seg.left * hop : waves.size(1) - seg.right * hop].cpu().numpy()
            for (i, _), wave in zip(group, waves, strict=True):
                yield i, float_to_pcm16(wave)

    def _speak(self, text: str) -> np.ndarray:
        import torch

        input_ids = self._processor(text=text, return_tensors="pt").input_ids
        with self._lock, self._on_stream(), torch.inference_mode():
            input_ids = input_ids[:, : self.max_tokens].to(self._model.device)
            waveform = self._model.generate_speech(
                input_ids, self._speaker, vocoder=self._vocoder, **self._generate_kwargs
            )
            return float_to_pcm16(waveform.float().cpu().numpy())


class SpeechT5PhraseStream:
    """A phrase being spoken by a `SpeechT5Voice`, a block per `advance`."""

    def __init__(self, pieces: collections.deque[str], stop: Callable[[], bool]) -> None:
        self.pieces = pieces  # what is left to speak, in pieces the model's positions allow
        self.stop = stop
        self.utterance: Utterance | None = None  # the piece being decoded
        self.vocoded = 0  # its post-net frames already turned into audio
        self.done = False

    def close(self) -> None:
        """No more decoding for this phrase."""
        self.done = True


@dataclass(frozen=True)
class _Segment:
    """Frames of an utterance to vocode: from ``window`` its post-net input (``length`` frames),
    ``offset`` frames further the vocoder's, whose first ``left`` and last ``right`` frames are
    only context."""

    utterance: Utterance
    window: int
    length: int  # of the post-net's input
    offset: int
    left: int
    right: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.length, self.offset, self.left, self.right)


_EMPTY = np.zeros(0, dtype=np.int16)

# Frames of context a streamed block needs: the post-net's five 5-wide convolutions see 10
# frames either side; HiFi-GAN's receptive field is a few frames more.
_RIGHT_CONTEXT = 12
_LEFT_CONTEXT = 12


def _pieces(text: str, max_chars: int) -> Iterator[str]:
    """``text`` in pieces of at most ``max_chars``, cut at spaces (SpeechT5: a token per char)."""
    piece = ""
    for word in text.split():
        while len(word) > max_chars:  # one "word" longer than a piece: cut it
            if piece:
                yield piece
                piece = ""
            yield word[:max_chars]
            word = word[max_chars:]
        if piece and len(piece) + 1 + len(word) > max_chars:
            yield piece
            piece = word
        else:
            piece = f"{piece} {word}" if piece else word
    if piece:
        yield piece
