"""Whisper's greedy decode with the decoder's caches in fixed buffers, one CUDA graph a step.

`whisper_greedy` still runs the decoder through transformers: a step is some 20 kernels a
layer launched one by one from Python, and on a GPU that vLLM keeps busy each launch waits its
turn, so a pass of 8 tokens took 80 ms alone and 250 ms beside 8 callers' replies (H200,
whisper-small). Here a step reads and writes only buffers of fixed shape (the self-attention
keys and values of every position, those of the audio, the token and its position), so on CUDA
it is recorded once per batch size as a CUDA graph and each step is one launch. On the CPU the
same step runs as it is (the tests compare it with generate() there).

Batches are padded to a power of two (their graphs share one set of buffers, sized for the
largest batch seen); positions past the current one are masked, so buffers need no clearing
between decodes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from stages.backends.whisper_greedy import GreedyDecoder

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class StaticDecoder(GreedyDecoder):
    """`GreedyDecoder`'s tokens from fixed buffers and, on CUDA, replayed graphs."""

    def __init__(self, model: Any, generation_config: Any, language: str | None, task: str) -> None:
        super().__init__(model, generation_config, language, task)
        decoder = model.model.decoder
        self._decoder = decoder
        self._layers = list(decoder.layers)
        attention = self._layers[0].self_attn
        self._heads, self._head_dim = attention.num_heads, attention.head_dim
        self._length = len(self.prompt) + self.max_new_tokens  # positions a decode may fill
        self._graphed = model.device.type == "cuda"
        self._capacity = 0  # batch the buffers hold
        self._graphs: dict[int, Any] = {}  # batch size -> torch.cuda.CUDAGraph
        self._logits: dict[int, torch.Tensor] = {}  # batch size -> the step's output

    def decode(self, features: torch.Tensor) -> torch.Tensor:
        audio = self._model.model.encoder(features).last_hidden_state
        batch = audio.shape[0]
        size = _padded(batch)
        self._ensure_buffers(size, audio.shape[1], audio.dtype)
        self._load_audio(audio, size)

        def logits_after(token: torch.Tensor | None) -> torch.Tensor:
            if token is None:
                for position, prompt_token in enumerate(self.prompt):
                    self._token[:size].fill_(prompt_token)
                    self._position.fill_(position)
                    self._step(size)
            else:
                self._token[:batch].copy_(token)
                self._position.add_(1)
                self._step(size)
            return self._logits[size][:batch]

        return self._pick_tokens(batch, logits_after)

    def record(self, max_batch: int) -> None:
        """On CUDA, size the buffers for `max_batch` windows and record the step of every
        batch size now, so that no turn waits for a recording (each one a few decoder steps;
        a bigger batch than ever before would otherwise re-record them all)."""
        if not self._graphed:
            return
        model = self._model
        frames = model.config.max_source_positions  # the encoder's output for a window
        self._ensure_buffers(_padded(max_batch), frames, model.dtype)
        size = 1
        while size <= self._capacity and self._graphed:
            self._step(size)
            size *= 2

    # -- the buffers and the step ---------------------------------------------------------

    def _ensure_buffers(self, size: int, frames: int, dtype: torch.dtype) -> None:
        import torch

        if size <= self._capacity:
            return
        layers, heads, dim = len(self._layers), self._heads, self._head_dim
        device = self._model.device
        options = {"device": device, "dtype": dtype}
        self._keys = torch.zeros(layers, size, heads, self._length, dim, **options)
        self._values = torch.zeros_like(self._keys)
        self._audio_keys = torch.zeros(layers, size, heads, frames, dim, **options)
        self._audio_values = torch.zeros_like(self._audio_keys)
        self._token = torch.zeros(size, dtype=torch.long, device=device)
        self._position = torch.zeros((), dtype=torch.long, device=device)
        self._positions = torch.arange(self._length, device=device)
        self._capacity = size
        self._graphs.clear()  # they point into the old buffers
        self._logits.clear()

    def _load_audio(self, audio: torch.Tensor, size: int) -> None:
        """The audio's keys and values for every layer's cross-attention (rows past the batch
        keep what they had: their tokens are never read)."""
        batch, frames = audio.shape[0], audio.shape[1]
        shape = (batch, frames, self._heads, self._head_dim)
        for i, layer in enumerate(self._layers):
            attention = layer.encoder_attn
            self._audio_keys[i, :batch] = attention.k_proj(audio).view(shape).transpose(1, 2)
            self._audio_values[i, :batch] = attention.v_proj(audio).view(shape).transpose(1, 2)

    def _step(self, size: int) -> None:
        """One decoder step of the first `size` rows; its logits in `_logits[size]`."""
        if not self._graphed:
            self._logits[size] = self._forward(size)
            return
        graph = self._graphs.get(size)
        if graph is None:
            try:
                graph = self._graphs[size] = self._capture(size)
            except Exception:  # slower, not wrong: steps run as they are from now on
                logger.exception("whisper: recording the decoder step failed; running it eagerly")
                self._graphed = False
                self._logits[size] = self._forward(size)
                return
        graph.replay()

    def _capture(self, size: int) -> Any:
        import torch

        # a few eager runs on a side stream first, as CUDA graphs want (allocator, kernels)
        side = torch.cuda.Stream(self._model.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(size)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the other threads' feature extraction may use the GPU meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._logits[size] = self._forward(size)
        logger.info("whisper: decoder step recorded as a CUDA graph for %d windows", size)
        return graph

    def _forward(self, size: int) -> torch.Tensor:
        """The decoder on `_token[:size]` at `_position`: its keys and values written at that
        position, the logits of the next token returned. Fixed shapes only."""
        from torch.nn.functional import scaled_dot_product_attention as attend

        decoder, heads, dim = self._decoder, self._heads, self._head_dim
        position = self._position
        token = self._token[:size]
        at = position.view(1)  # a tensor index: indexing with a 0-d one would read it back
        where = decoder.embed_positions.weight.index_select(0, at)
        hidden = (decoder.embed_tokens(token) + where)[:, None]  # (size, 1, d_model)
        seen = (self._positions <= position).view(1, 1, 1, -1)
        for i, layer in enumerate(self._layers):
            attention = layer.self_attn
            x = layer.self_attn_layer_norm(hidden)
            query = (attention.q_proj(x) * attention.scaling).view(size, 1, heads, dim)
            key = attention.k_proj(x).view(size, 1, heads, dim).transpose(1, 2)
            value = attention.v_proj(x).view(size, 1, heads, dim).transpose(1, 2)
            keys, values = self._keys[i, :size], self._values[i, :size]
            keys.index_copy_(2, at, key)
            values.index_copy_(2, at, value)
            out = attend(query.transpose(1, 2), keys, values, attn_mask=seen, scale=1.0)
            hidden = hidden + attention.out_proj(out.transpose(1, 2).reshape(size, 1, -1))

            attention = layer.encoder_attn
            x = layer.encoder_attn_layer_norm(hidden)
            query = (attention.q_proj(x) * attention.scaling).view(size, 1, heads, dim)
            out = attend(
                query.transpose(1, 2),
                self._audio_keys[i, :size],
                self._audio_values[i, :size],
                scale=1.0,
            )
            hidden = hidden + attention.out_proj(out.transpose(1, 2).reshape(size, 1, -1))

            x = layer.final_layer_norm(hidden)
            hidden = hidden + layer.fc2(layer.activation_fn(layer.fc1(x)))
        hidden = decoder.layer_norm(hidden)
        return self._model.proj_out(hidden[:, 0])


def _padded(batch: int) -> int:
    """The batch size a batch runs at: the next power of two."""
    return 1 << (batch - 1).bit_length()
