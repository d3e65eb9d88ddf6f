"""A tiny offline chat model for tests and the CPU demo profile.

Machines here cannot download weights, so tests build a real Hugging Face model folder locally:
a byte-level BPE tokenizer trained on text that ships with Python (the pydoc topic pages), a ChatML
chat template, and a random-weight ``Qwen2ForCausalLM``. It loads through the same code as a real
model, but it babbles: the folder carries a ``random_weights`` marker so loaders can say so.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stages.backends.model_cache import build_once, cache_folder

logger = logging.getLogger(__name__)


#: Present in every folder this module builds: the weights are random, the output is noise.
RANDOM_WEIGHTS_MARKER = "random_weights"

VOCAB_SIZE = 2048
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Qwen2 shape small enough to build in seconds; CPU attention in vLLM needs head_dim >= 32.
MODEL_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
}


def default_cache_folder() -> Path:
    """``$OMNI_GATEWAY_CACHE/tiny-chat`` if set, else ``~/.cache/omni-gateway/tiny-chat``."""
    return cache_folder("tiny-chat")


def has_random_weights(folder: Path) -> bool:
    """True when the model in ``folder`` was built here with random weights."""
    return (folder / RANDOM_WEIGHTS_MARKER).is_file()


def ensure_tiny_chat_model(folder: Path | None = None) -> Path:
    """Build the tiny chat model into ``folder`` unless a finished build is already there."""
    folder = Path(folder) if folder is not None else default_cache_folder()
    return build_once(folder, _build, "tiny chat model (random weights)")


def ensure_chat_model(
    folder: Path, shape: dict[str, Any], vocab_size: int, device: str = "cpu"
) -> Path:
    """A random-weight Qwen2 chat model of any ``shape`` (e.g. Qwen2.5-7B's), built as the tiny
    one is, its weights initialised on ``device``; for runs that need real-size models."""
    return build_once(
        Path(folder),
        functools.partial(_build, shape=shape, vocab_size=vocab_size, device=device),
        "chat model (random weights)",
    )


def _training_text(source_bytes: int = 0) -> Iterator[str]:
    """English prose that ships with every CPython: the pydoc topic pages (~460 KB); then, for
    large vocabularies, up to ``source_bytes`` of the standard library's own source."""
    from pydoc_data.topics import topics

    for _name, text in sorted(topics.items()):
        yield from text.split("\n\n")
    yield from stdlib_sources(source_bytes)


def stdlib_sources(limit: int) -> Iterator[str]:
    """Up to ``limit`` characters of the standard library's .py files, in a fixed order:
    enough text for BPE vocabularies of real models' sizes (32k tokens from ~8 MB)."""
    import sysconfig

    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if total >= limit:
            return
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        total += len(text)
        yield text


def train_tokenizer(
    folder: Path, vocab_size: int, max_length: int, extra_specials: tuple[str, ...] = ()
) -> Any:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens (ChatML's specials first,
    then ``extra_specials``), trained on the pydoc pages (and the standard library's source
    for large vocabularies), with the ChatML template, saved in ``folder``; returns the
    `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *extra_specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # a vocabulary larger than the prose gives (~9k tokens) learns from source code too
    source_bytes = 0 if vocab_size <= VOCAB_SIZE else 8 << 20
    bpe.train_from_iterator(_training_text(source_bytes), trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=None,
        bos_token=None,
        model_max_length=max_length,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(folder)
    return bpe


def mark_random(folder: Path) -> None:
    (folder / RANDOM_WEIGHTS_MARKER).write_text(
        "This model has random weights: it was built offline for tests and its output is noise.\n"
    )


def _build(
    folder: Path,
    shape: dict[str, Any] = MODEL_SHAPE,
    vocab_size: int = VOCAB_SIZE,
    device: str = "cpu",
) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    bpe = train_tokenizer(folder, vocab_size, shape["max_position_embeddings"])
    endoftext_id = bpe.token_to_id(ENDOFTEXT)
    im_end_id = bpe.token_to_id(IM_END)
    config = Qwen2Config(
        **{"tie_word_embeddings": True, **shape},
        vocab_size=bpe.get_vocab_size(),  # what training reached, at most vocab_size
        bos_token_id=endoftext_id,
        eos_token_id=im_end_id,
        pad_token_id=endoftext_id,
    )
    torch.manual_seed(0)
    # bfloat16 is what vLLM runs on the CPU; saving float32 makes it convert (and warn) per tensor.
    # Initialised where it is built: a 7B-shaped model takes half a second on a GPU.
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext_id,
        eos_token_id=[im_end_id, endoftext_id],
        pad_token_id=endoftext_id,
    )
    model.save_pretrained(folder)

    mark_random(folder)
