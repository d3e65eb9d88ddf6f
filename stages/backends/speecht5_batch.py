"""SpeechT5's decoder stepped for several utterances at once.

A vocoder process speaks for every caller it serves. Stepping each caller's phrase on its own
costs a whole pass of small kernels (and of Python) per caller per step; on a GPU that pass is
bound by launches, not arithmetic, so stacking the callers into one batch costs about one pass
for all of them. Utterances differ in length: the self-attention caches are left-padded to the
longest and the text encodings right-padded, and masks hide the padding, so each utterance gets
the frames it would get alone (tests/stages/test_tts_speecht5.py holds this). Positions come from
the prenet's encoding of each utterance's own sequence, never from the padded cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache

KeyValues = list[tuple[torch.Tensor, torch.Tensor]]  # one (keys, values) per decoder layer


@dataclass(eq=False)
class Utterance:
    """One piece of text being decoded into mel frames, step by step."""

    encoded: torch.Tensor  # (1, T, D): the text encoder's output
    mask: torch.Tensor  # (1, T): 1 for the text's tokens
    minlen: int  # decoder steps before "stop" is believed
    maxlen: int  # decoder steps at most
    stop: Callable[[], bool]  # asked before every step: a cancel
    sequence: torch.Tensor  # (1, steps + 1, bins): the decoder's inputs, a zero frame first
    frames: list[torch.Tensor] = field(default_factory=list)  # (1, r, bins) per step
    past: KeyValues | None = None  # self-attention keys and values, (1, H, steps, d)
    cross: KeyValues | None = None  # cross-attention keys and values, (1, H, T, d)
    finished: bool = False  # the model said stop, maxlen was reached, or it was cancelled
    cancelled: bool = False

    @property
    def steps(self) -> int:
        return len(self.frames)


def decode(
    model: Any, speaker: torch.Tensor, utterances: Sequence[Utterance], steps: int, threshold: float
) -> None:
    """Advance every unfinished utterance by up to ``steps`` decoder steps, all in one batch
    (one more for an utterance just begun: its first step runs on its own, to fill its
    cross-attention cache). Call under ``torch.inference_mode()``.
    """
    live = [u for u in utterances if not _check_stop(u)]
    for u in live:
        if u.past is None:
            _first_step(model, speaker, u, threshold)
    live = [u for u in live if not u.finished]
    if live:
        _batched_steps(model, speaker, live, steps, threshold)


def _check_stop(u: Utterance) -> bool:
    if not u.finished and u.stop():
        u.finished = u.cancelled = True
    return u.finished


def _first_step(model: Any, speaker: torch.Tensor, u: Utterance, threshold: float) -> None:
    decoder = model.speecht5.decoder
    hidden = decoder.prenet(u.sequence, speaker)[:, -1:]
    out = decoder.wrapped_decoder(
        hidden_states=hidden,
        encoder_hidden_states=u.encoded,
        encoder_attention_mask=u.mask,
        use_cache=True,
        return_dict=True,
    )
    cache = out.past_key_values
    u.past = _key_values(cache.self_attention_cache)
    u.cross = _key_values(cache.cross_attention_cache)
    spectra = _take_outputs(model, [u], out.last_hidden_state.squeeze(1), threshold)
    u.sequence = torch.cat((u.sequence, spectra[:, -1:]), dim=1)


def _batched_steps(
    model: Any, speaker: torch.Tensor, batch: list[Utterance], steps: int, threshold: float
) -> None:
    decoder = model.speecht5.decoder
    n = len(batch)
    past_len = max(u.steps for u in batch)
    text_len = max(u.encoded.size(1) for u in batch)
    first = batch[0].encoded
    # decoder inputs, right-padded: row i's last real frame is at lengths[i] - 1
    lengths = torch.tensor([u.sequence.size(1) for u in batch], device=first.device)
    longest = max(u.sequence.size(1) for u in batch)
    sequence = first.new_zeros(n, longest + steps, batch[0].sequence.size(2))
    encoded = first.new_zeros(n, text_len, first.size(2))
    text_mask = batch[0].mask.new_zeros(n, text_len)
    self_mask = batch[0].mask.new_zeros(n, past_len + steps)
    for i, u in enumerate(batch):
        sequence[i, : u.sequence.size(1)] = u.sequence[0]
        encoded[i, : u.encoded.size(1)] = u.encoded[0]
        text_mask[i, : u.mask.size(1)] = u.mask[0]
        self_mask[i, past_len - u.steps :] = 1  # its past, left-padded, and every new step
    cache = EncoderDecoderCache(
        DynamicCache(_stacked([u.past for u in batch], past_len, left=True)),
        DynamicCache(_stacked([u.cross for u in batch], text_len, left=False)),
    )
    rows = torch.arange(n, device=first.device)
    speakers = speaker.expand(n, -1)
    start_steps = [u.steps for u in batch]
    start_lengths = [u.sequence.size(1) for u in batch]
    for step in range(steps):
        for u in batch:
            _check_stop(u)
        if all(u.finished for u in batch):
            break
        # the prenet is pointwise in time: the right padding never reaches a real frame
        hidden = decoder.prenet(sequence[:, : longest + step], speakers)
        out = decoder.wrapped_decoder(
            hidden_states=hidden[rows, lengths - 1].unsqueeze(1),
            attention_mask=self_mask[:, : past_len + step + 1],
            encoder_hidden_states=encoded,
            encoder_attention_mask=text_mask,
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
        )
        cache = out.past_key_values
        spectra = _take_outputs(model, batch, out.last_hidden_state.squeeze(1), threshold)
        sequence[rows, lengths] = spectra[:, -1]
        lengths = lengths + 1
    # each utterance keeps its own rows of the batch's cache (views): the next batch may differ
    grown = _key_values(cache.self_attention_cache)
    for i, u in enumerate(batch):
        taken = len(u.frames) - start_steps[i]
        u.sequence = sequence[i : i + 1, : start_lengths[i] + taken]
        end = past_len + taken
        u.past = [
            (k[i : i + 1, :, end - u.steps : end], v[i : i + 1, :, end - u.steps : end])
            for k, v in grown
        ]


def _take_outputs(
    model: Any, batch: list[Utterance], hidden: torch.Tensor, threshold: float
) -> torch.Tensor:
    """Record one step's frames for each unfinished utterance; mark those that end."""
    config, postnet = model.config, model.speech_decoder_postnet
    r, bins = config.reduction_factor, config.num_mel_bins
    spectra = postnet.feat_out(hidden).view(len(batch), r, bins)
    stops = (torch.sigmoid(postnet.prob_out(hidden)).sum(-1) >= threshold).tolist()
    for i, u in enumerate(batch):
        if u.finished:
            continue
        u.frames.append(spectra[i : i + 1])
        if u.steps >= u.maxlen or (u.steps >= u.minlen and stops[i]):
            u.finished = True
    return spectra


def _key_values(cache: Any) -> KeyValues:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _stacked(per_utterance: list[KeyValues | None], length: int, *, left: bool) -> KeyValues:
    """Every utterance's keys and values of each layer in one batch, padded to ``length``."""
    stacked: KeyValues = []
    first = per_utterance[0]
    assert first is not None
    for layer in range(len(first)):
        pair = []
        for which in (0, 1):
            sample = first[layer][which]
            out = sample.new_zeros(len(per_utterance), sample.size(1), length, sample.size(3))
            for i, kv in enumerate(per_utterance):
                assert kv is not None
                t = kv[layer][which]
                if left:
                    out[i, :, length - t.size(2) :] = t[0]
                else:
                    out[i, :, : t.size(2)] = t[0]
            pair.append(out)
        stacked.append((pair[0], pair[1]))
    return stacked
