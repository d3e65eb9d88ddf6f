"""Tiny offline Whisper and SpeechT5 (+HiFi-GAN) models for tests and the CPU demo profile.

Machines here cannot download weights, so tests build real Hugging Face model folders locally: the
tokenizers are trained on text that ships with Python (the pydoc topic pages), the weights are
random, and everything is saved with ``save_pretrained`` so it loads through the same code as a real
checkpoint. The output is noise (Whisper babbles tokens, SpeechT5 speaks static); every folder
carries the ``random_weights`` marker so loaders say so in their logs.

Builds take about a second, are idempotent (a finished folder is reused) and atomic (built in a
temporary sibling that is renamed into place).
"""

from __future__ import annotations

import functools
import io
import itertools
import json
import logging
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from stages.backends.model_cache import build_once, cache_folder
from stages.backends.tiny_chat_model import mark_random, stdlib_sources

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

WHISPER_SPECIAL_TOKENS = [
    "<|startoftranscript|>",
    "<|en|>",
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
]
WHISPER_ENDOFTEXT = "<|endoftext|>"
WHISPER_VOCAB_SIZE = 512
#: Random weights rarely sample <|endoftext|>: every decode runs to this many tokens.
WHISPER_MAX_LENGTH = 32
WHISPER_SHAPE = {
    "d_model": 64,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "num_mel_bins": 80,
    "max_source_positions": 1500,  # 30 s of 10 ms mel frames, halved by the conv front end
    "max_target_positions": 128,
}
SPEECHT5_SHAPE = {
    "hidden_size": 64,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "speech_decoder_prenet_units": 64,
    "speech_decoder_postnet_units": 64,
    "speech_decoder_postnet_layers": 2,
    "speaker_embedding_dim": 512,  # as the real checkpoint, so the same x-vector files fit
}
HIFIGAN_SHAPE = {
    "upsample_initial_channel": 32,
    "resblock_kernel_sizes": [3],
    "resblock_dilation_sizes": [[1, 3]],
}
#: Stop-token logit bias: the random decoder never says "stop", so it speaks for exactly
#: ``maxlenratio`` mel frames per input token (pass ``maxlenratio=4`` for a speech-like length).
SPEECHT5_STOP_BIAS = -20.0


class TinySpeechT5(NamedTuple):
    """Folders of a built SpeechT5 text-to-speech model and its HiFi-GAN vocoder."""

    model: Path
    vocoder: Path


TINY_WHISPER = "whisper model (random weights)"
TINY_SPEECHT5 = "speecht5 voice (random weights)"


def ensure_tiny_whisper(folder: Path | None = None) -> Path:
    """Build a tiny random Whisper (model, tokenizer, feature extractor) unless already built."""
    return build_once(folder or cache_folder("tiny-whisper"), _build_whisper, TINY_WHISPER)


def ensure_tiny_speecht5(folder: Path | None = None) -> TinySpeechT5:
    """Build a tiny random SpeechT5 (model + processor) and HiFi-GAN (in ``vocoder/``)."""
    folder = build_once(folder or cache_folder("tiny-speecht5"), _build_speecht5, TINY_SPEECHT5)
    return TinySpeechT5(model=folder, vocoder=folder / "vocoder")


def ensure_whisper(
    folder: Path, shape: dict[str, Any], vocab_size: int, device: str = "cpu"
) -> Path:
    """A random Whisper of any ``shape`` (e.g. whisper-small's), built as the tiny one is."""
    build = functools.partial(
        _build_whisper, shape=shape, vocab_size=vocab_size, paragraphs=None, device=device
    )
    return build_once(Path(folder), build, TINY_WHISPER)


def ensure_speecht5(
    folder: Path, shape: dict[str, Any], hifigan_shape: dict[str, Any], device: str = "cpu"
) -> TinySpeechT5:
    """A random SpeechT5 + HiFi-GAN of any shapes ({}: the real checkpoints' defaults)."""
    build = functools.partial(
        _build_speecht5, shape=shape, hifigan_shape=hifigan_shape, device=device
    )
    folder = build_once(Path(folder), build, TINY_SPEECHT5)
    return TinySpeechT5(model=folder, vocoder=folder / "vocoder")


def _training_text(paragraphs: int | None = 400) -> Iterator[str]:
    """English prose that ships with every CPython: paragraphs of the pydoc topic pages."""
    from pydoc_data.topics import topics

    def all_paragraphs() -> Iterator[str]:
        for _name, text in sorted(topics.items()):
            yield from (p for p in text.split("\n\n") if p.strip())

    return islice(all_paragraphs(), paragraphs)


def _build_whisper(
    folder: Path,
    shape: dict[str, Any] = WHISPER_SHAPE,
    vocab_size: int = WHISPER_VOCAB_SIZE,
    paragraphs: int | None = 400,
    device: str = "cpu",
) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizer,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[WHISPER_ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = _training_text(paragraphs)
    if vocab_size > WHISPER_VOCAB_SIZE:  # real sizes learn from source code too
        text = itertools.chain(text, stdlib_sources(8 << 20))
    bpe.train_from_iterator(text, trainer=trainer)
    tokenizer = WhisperTokenizer(vocab=bpe.get_vocab(), merges=_bpe_merges(bpe))
    tokenizer.add_special_tokens({"additional_special_tokens": WHISPER_SPECIAL_TOKENS})
    processor = WhisperProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=shape["num_mel_bins"]),
        tokenizer=tokenizer,
    )
    processor.save_pretrained(folder)

    token_id = tokenizer.convert_tokens_to_ids
    eot = token_id(WHISPER_ENDOFTEXT)
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        pad_token_id=eot,
        bos_token_id=eot,
        eos_token_id=eot,
        decoder_start_token_id=token_id("<|startoftranscript|>"),
        # Generation settings live in generation_config.json, as in real checkpoints.
        begin_suppress_tokens=None,
        suppress_tokens=None,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=token_id("<|startoftranscript|>"),
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        max_length=WHISPER_MAX_LENGTH,
        begin_suppress_tokens=[eot],
        # As in real checkpoints: never sample the task and language markers as text.
        suppress_tokens=[token_id(t) for t in WHISPER_SPECIAL_TOKENS],
        no_timestamps_token_id=token_id("<|notimestamps|>"),
        is_multilingual=True,
        lang_to_id={"<|en|>": token_id("<|en|>")},
        task_to_id={
            "transcribe": token_id("<|transcribe|>"),
            "translate": token_id("<|translate|>"),
        },
    )
    model.save_pretrained(folder)
    mark_random(folder)


def _bpe_merges(bpe: Tokenizer) -> list[tuple[str, str]]:
    """The merges of a trained ``tokenizers`` BPE, in the form ``WhisperTokenizer`` takes."""
    merges = json.loads(bpe.to_str())["model"]["merges"]
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]


def _build_speecht5(
    folder: Path,
    shape: dict[str, Any] = SPEECHT5_SHAPE,
    hifigan_shape: dict[str, Any] = HIFIGAN_SHAPE,
    device: str = "cpu",
) -> None:
    import sentencepiece
    import torch
    from transformers import (
        SpeechT5Config,
        SpeechT5FeatureExtractor,
        SpeechT5ForTextToSpeech,
        SpeechT5HifiGan,
        SpeechT5HifiGanConfig,
        SpeechT5Processor,
        SpeechT5Tokenizer,
    )

    # A character-level sentencepiece model with the real checkpoint's special-token ids.
    spm_model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=_training_text(),
        model_writer=spm_model,
        model_type="char",
        vocab_size=128,
        hard_vocab_limit=False,
        character_coverage=1.0,
        bos_id=0,
        pad_id=1,
        eos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    spm_path = folder / "spm_char.model"
    spm_path.write_bytes(spm_model.getvalue())
    tokenizer = SpeechT5Tokenizer(str(spm_path))
    processor = SpeechT5Processor(feature_extractor=SpeechT5FeatureExtractor(), tokenizer=tokenizer)
    processor.save_pretrained(folder)

    torch.manual_seed(0)
    config = SpeechT5Config(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **shape,
    )
    with torch.device(device):
        model = SpeechT5ForTextToSpeech(config)
    with torch.no_grad():
        model.speech_decoder_postnet.prob_out.bias.fill_(SPEECHT5_STOP_BIAS)
    model.save_pretrained(folder)
    mark_random(folder)

    with torch.device(device):
        vocoder = SpeechT5HifiGan(SpeechT5HifiGanConfig(**hifigan_shape))
    # transformers initializes convolutions with std 0.01, which makes a silent vocoder (~1e-8);
    # torch's default init makes audible noise, so a pipeline test can see the audio.
    for module in vocoder.modules():
        if isinstance(module, torch.nn.Conv1d | torch.nn.ConvTranspose1d):
            module.reset_parameters()
    vocoder_folder = folder / "vocoder"
    vocoder.save_pretrained(vocoder_folder)
    mark_random(vocoder_folder)
