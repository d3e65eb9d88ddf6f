"""Random-weight talkers and SNAC codecs of real shapes, built offline.

Nothing can be downloaded here, so the talker voice's tests (and GPU timing runs) build their
own: a Llama talker with Orpheus's vocabulary layout (text tokens from a BPE trained here, the
audio tokens where Orpheus has them) and SNAC with snac_24khz's configuration, its weights
random and saved as `SNAC.from_pretrained` reads a folder. Their output is noise; each folder
carries the `random_weights` marker, so the stages say so in their logs.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from stages.backends.model_cache import build_once, cache_folder
from stages.backends.snac_codec import SNAC_24KHZ, TOKENS_PER_FRAME, CodeLayout
from stages.backends.tiny_chat_model import mark_random, train_tokenizer

#: Orpheus's vocabulary: Llama 3's 128,256, 10 control tokens, 7 x 4,096 audio tokens.
ORPHEUS_VOCAB = CodeLayout().offset + TOKENS_PER_FRAME * CodeLayout().codebook_size + 2
#: Orpheus-3B: Llama-3.2-3B's architecture (its config.json).
ORPHEUS_3B_SHAPE: dict[str, Any] = {
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rope_theta": 500_000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
#: A talker small enough to build in seconds and run on a CPU (vLLM's CPU attention needs
#: head_dim >= 32); its embedding of Orpheus's vocabulary is most of its 20 M parameters.
TINY_TALKER_SHAPE: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
TEXT_VOCAB = 2048  # the BPE's text tokens (Orpheus's are Llama 3's 128k)


def ensure_tiny_talker(folder: Path | None = None) -> Path:
    """The tiny talker (random weights), built once under the cache."""
    folder = Path(folder) if folder is not None else cache_folder("tiny-talker")
    return ensure_talker(folder, TINY_TALKER_SHAPE)


def ensure_talker(
    folder: Path,
    shape: dict[str, Any],
    text_vocab: int = TEXT_VOCAB,
    device: str = "cpu",
    tokenizer_from: Path | None = None,
) -> Path:
    """A random-weight Llama talker of ``shape`` with Orpheus's vocabulary layout, its
    weights initialised on ``device``; its text tokenizer trained here, or copied from the
    model folder ``tokenizer_from`` (one built by tiny_chat_model, of the size wanted)."""
    build = functools.partial(
        _build_talker, shape=shape, text_vocab=text_vocab, device=device, source=tokenizer_from
    )
    return build_once(Path(folder), build, "talker (random weights)")


def ensure_snac(folder: Path | None = None, device: str = "cpu") -> Path:
    """SNAC 24 kHz's shape with random weights, as a folder `SNAC.from_pretrained` loads."""
    folder = Path(folder) if folder is not None else cache_folder("snac-24khz-random")
    return build_once(
        Path(folder), functools.partial(_build_snac, device=device), "SNAC (random weights)"
    )


def _build_talker(
    folder: Path, shape: dict[str, Any], text_vocab: int, device: str, source: Path | None
) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if source is None:
        train_tokenizer(folder, text_vocab, shape["max_position_embeddings"])
    else:
        AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    config = LlamaConfig(**shape, vocab_size=ORPHEUS_VOCAB, bos_token_id=0, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
        _speak_audio_tokens(model, shape["hidden_size"])
        model = model.to(torch.bfloat16)
    model.save_pretrained(folder)
    mark_random(folder)


def _speak_audio_tokens(model: Any, hidden_size: int) -> None:
    """Give the audio tokens' rows of the output head logits of a std of about 8 (the others
    keep the initialiser's, about 1): a random talker then samples audio tokens, as a trained
    one does, instead of a vocabulary that is 82% text. (Restricting sampling to them is no
    way: vLLM's GPU model runner takes at most 1,024 allowed token ids.) The final norm makes
    the hidden state's entries about 1, so a row of std 8 / sqrt(hidden) gives logits of std 8.
    """
    import torch

    head = model.get_output_embeddings().weight  # the input embedding too, when tied
    audio = CodeLayout().audio_token_ids()
    with torch.no_grad():
        head[audio.start : audio.stop].normal_(0.0, 8.0 / hidden_size**0.5)


def _build_snac(folder: Path, device: str) -> None:
    import torch
    from snac import SNAC

    torch.manual_seed(0)
    with torch.device(device):
        model = SNAC(**SNAC_24KHZ)
    (folder / "config.json").write_text(json.dumps(SNAC_24KHZ, indent=2))
    torch.save({k: v.cpu() for k, v in model.state_dict().items()}, folder / "pytorch_model.bin")
    mark_random(folder)
