"""SNAC codec tokens to audio, streamed: the decoder half of a talker voice (tts_talker).

A talker LM speaks in SNAC 24 kHz codes laid out as Orpheus lays them out: 7 tokens a frame
of 2,048 samples (85 ms), one code of the coarse level, two of the middle, four of the fine,
token ``offset + (i % 7) * codebook_size + code`` at the i-th audio token. `CodeLayout` turns
token ids into frames; `SnacDecoder` turns windows of frames into audio, many streams' windows
in one batch, a window of a regular shape replayed as a CUDA graph on a GPU.

Streaming: a window is decoded with up to `context` frames before the frames it emits (so
block edges do not click) and `lookahead` frames after them (the decoder's convolutions see
both ways); the first block of a phrase emits `first_frames`, later ones `stream_frames`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from stages.backends.speech import (
    SpeechModelNotFoundError,
    SpeechOptionError,
    warn_if_random_weights,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

#: hubertsiuzdak/snac_24khz's configuration (19.8 M parameters; the codec Orpheus speaks in).
SNAC_24KHZ: dict[str, Any] = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}
TOKENS_PER_FRAME = 7
#: which of a frame's 7 tokens belong to each level, in time order (coarse, middle, fine)
_LEVELS = ((0,), (1, 4), (2, 3, 5, 6))
#: batch sizes a CUDA graph is recorded for; a batch is padded up to the next
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class CodeLayout:
    """Where a talker's audio tokens lie in its vocabulary (Orpheus's by default)."""

    offset: int = 128266  # the first audio token: <custom_token_10>
    codebook_size: int = 4096

    @property
    def end(self) -> int:
        return self.offset + TOKENS_PER_FRAME * self.codebook_size

    def audio_token_ids(self) -> range:
        return range(self.offset, self.end)

    def codes(self, token_ids: Sequence[int]) -> list[int]:
        """The codes of the audio tokens among ``token_ids`` (others are dropped). The i-th
        audio token's code is taken modulo the codebook: a token of the wrong position in its
        frame still decodes, as a code of the level its position says."""
        offset, end, size = self.offset, self.end, self.codebook_size
        return [(t - offset) % size for t in token_ids if offset <= t < end]


def frames_of(codes: Sequence[int]) -> np.ndarray:
    """Whole frames of ``codes``, shape (frames, 7); a partial frame at the end is left out."""
    n = len(codes) // TOKENS_PER_FRAME
    return np.asarray(codes[: n * TOKENS_PER_FRAME], dtype=np.int64).reshape(n, TOKENS_PER_FRAME)


@dataclass(frozen=True)
class Window:
    """Frames to decode, of which ``[left, left + emit)`` are the ones whose audio is kept."""

    frames: np.ndarray  # (n, 7)
    left: int
    emit: int


class SnacDecoder:
    """A loaded SNAC model that decodes windows of frames, in batches."""

    def __init__(self, model: Any, device: torch.device, use_graphs: bool, name: str) -> None:
        self.model = model
        self.device = device
        self.name = name
        self.sample_rate = int(model.sampling_rate)
        self.codebook_size = int(model.codebook_size)
        strides = list(model.vq_strides)
        if len(strides) != 3 or strides[0] != 4 * strides[2] or strides[1] != 2 * strides[2]:
            raise SpeechOptionError(
                f"SNAC model {name}: vq_strides {strides} are not a 3-level 4:2:1 layout "
                "(the 7-token frame of a talker needs SNAC 24 kHz's)"
            )
        # samples per frame: a coarse code spans vq_strides[0] latent steps of hop_length
        self.frame_samples = int(model.hop_length) * strides[0]
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._use_graphs = use_graphs
        # one memory pool for every graph: they replay one at a time, under the lock, and each
        # replay's audio is copied out before the next (own pools took 3.5 GB for 14 graphs)
        self._pool: Any = None
        self._lock = threading.Lock()

    def decode(self, windows: Sequence[Window]) -> list[np.ndarray]:
        """Float audio (in [-1, 1]) of each window's emitted frames; windows of one shape go
        through the model as one batch."""
        import torch

        out: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(windows)
        by_shape: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            by_shape.setdefault(len(w.frames), []).append(i)
        with self._lock, torch.inference_mode():
            for n, indices in by_shape.items():
                batch = np.stack([windows[i].frames for i in indices])
                audio = self._run(batch, n)
                for row, i in enumerate(indices):
                    w = windows[i]
                    a, b = w.left * self.frame_samples, (w.left + w.emit) * self.frame_samples
                    out[i] = audio[row, a:b]
        return out

    def _run(self, batch: np.ndarray, n: int) -> np.ndarray:
        """Audio of (B, n, 7) frames as (B, n * frame_samples) floats."""
        import torch

        graph = self._graph(n, len(batch)) if self._use_graphs else None
        if graph is not None:
            return graph.run(batch)
        codes = _level_codes(torch.from_numpy(batch).to(self.device))
        audio = self.model.decode(codes)
        return audio[:, 0].float().cpu().numpy()

    def _graph(self, n: int, batch: int) -> _Graph | None:
        bucket = next((b for b in _BATCH_BUCKETS if b >= batch), None)
        if bucket is None:
            return None
        key = (n, bucket)
        graph = self._graphs.get(key)
        if graph is None:
            if self._pool is None:
                import torch

                self._pool = torch.cuda.graph_pool_handle()
            graph = self._graphs[key] = _Graph(self.model, self.device, n, bucket, self._pool)
        return graph

    def warm_up(self, shapes: Sequence[int]) -> None:
        """Record (on a GPU) or run once (on a CPU) every batch size of these window sizes,
        so the first replies do not pay for it."""
        dummy = [Window(np.zeros((n, TOKENS_PER_FRAME), np.int64), 0, n) for n in shapes]
        if not self._use_graphs:
            self.decode(dummy)
            return
        # the largest first, so that the smaller ones fit in the memory it leaves in the pool
        for n in sorted(shapes, reverse=True):
            for bucket in reversed(_BATCH_BUCKETS):
                with self._lock:
                    self._graph(n, bucket)


class _Graph:
    """One window size and batch size of the decoder, recorded as a CUDA graph."""

    def __init__(
        self, model: Any, device: torch.device, frames: int, batch: int, pool: Any
    ) -> None:
        import torch

        self.batch = batch
        self.frames = torch.zeros((batch, frames, TOKENS_PER_FRAME), dtype=torch.int64)
        self.frames = self.frames.to(device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):  # warm-up passes before recording, as torch asks
                model.decode(_level_codes(self.frames))
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph, pool=pool):
            self.audio = model.decode(_level_codes(self.frames))[:, 0].float()

    def run(self, batch: np.ndarray) -> np.ndarray:
        import torch

        n = len(batch)
        padded = np.zeros((self.batch, *batch.shape[1:]), dtype=np.int64)
        padded[:n] = batch
        self.frames.copy_(torch.from_numpy(padded), non_blocking=False)
        self.graph.replay()
        return self.audio[:n].cpu().numpy()


def _level_codes(frames: torch.Tensor) -> list[torch.Tensor]:
    """(B, n, 7) frames as SNAC's three levels: (B, n), (B, 2n), (B, 4n). Slices, not an
    index list: a list is a host tensor copied in, which a CUDA graph cannot record."""
    import torch

    b = frames.shape[0]
    return [
        torch.stack([frames[:, :, i] for i in level], dim=2).reshape(b, -1) for level in _LEVELS
    ]


def load_snac(
    model: str, device: torch.device, dtype: str = "float32", cuda_graphs: bool = True
) -> SnacDecoder:
    """SNAC from a local folder (config.json + pytorch_model.bin) or a Hugging Face id that is
    in the cache, weight norm folded into the weights, on ``device``."""
    import torch

    try:
        from snac import SNAC
    except ImportError as exc:  # pragma: no cover - a dependency of the project
        raise SpeechOptionError("the talker voice needs the `snac` package") from exc
    path = Path(model).expanduser()
    if model.startswith(("/", ".", "~")) and not path.is_dir():
        raise SpeechModelNotFoundError(f"SNAC codec path {str(path)!r} does not exist")
    if path.is_dir():
        for name in ("config.json", "pytorch_model.bin"):
            if not (path / name).is_file():
                raise SpeechModelNotFoundError(f"SNAC codec folder {str(path)!r} has no {name}")
        warn_if_random_weights(str(path), "SNAC codec")
    try:
        snac = SNAC.from_pretrained(str(path) if path.is_dir() else model)
    except Exception as exc:
        raise SpeechModelNotFoundError(
            f"cannot load SNAC codec {model!r}: {type(exc).__name__}: {exc}. Pass a local "
            "folder; hub ids work only when the model is already in the HF cache."
        ) from exc
    _fold_weight_norm(snac)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise SpeechOptionError(f"talker option codec_dtype={dtype!r}: float32, bfloat16, float16")
    snac = snac.to(device=device, dtype=getattr(torch, dtype)).eval()
    # codebook lookups stay exact: embeddings are indexed, not multiplied
    return SnacDecoder(snac, device, cuda_graphs and device.type == "cuda", model)


def _fold_weight_norm(model: Any) -> None:
    """Replace weight-norm parametrisations by the weights they compute: the same output,
    without recomputing every weight on every pass."""
    from torch.nn.utils import parametrize

    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
