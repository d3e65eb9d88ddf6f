"""Speech-in checkpoints with random weights, built offline in the layouts of the real ones
(stages.backends.speech_in reads them as it reads Ultravox's and Qwen2.5-Omni's): for tests, in
tiny shapes, and for GPU timing, in real ones. Their folders carry the random-weights marker."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from stages.backends.model_cache import build_once, cache_folder, copy_tokenizer
from stages.backends.tiny_chat_model import (
    ENDOFTEXT,
    IM_END,
    MODEL_SHAPE,
    VOCAB_SIZE,
    mark_random,
    train_tokenizer,
)

ULTRAVOX_MARKERS = ("<|audio|>",)
OMNI_MARKERS = ("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>", "<|IMAGE|>", "<|VIDEO|>")

# Whisper's encoder and Qwen2.5-Omni's audio encoder, tiny; CPU attention wants head_dim >= 32
TINY_WHISPER = {
    "d_model": 64,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 128,
    "decoder_layers": 1,
    "decoder_attention_heads": 2,
    "decoder_ffn_dim": 128,
    "num_mel_bins": 80,
    "max_source_positions": 1500,
    "vocab_size": 64,
}
TINY_OMNI_AUDIO = {
    "num_mel_bins": 128,
    "encoder_layers": 2,
    "encoder_attention_heads": 2,
    "encoder_ffn_dim": 128,
    "d_model": 64,
    "max_source_positions": 1500,
    "n_window": 100,
}
# the real ones: Ultravox v0.5's (whisper-large-v3-turbo's encoder, Llama-3.1-8B) and
# Qwen2.5-Omni-7B's thinker
REAL_WHISPER = {
    **TINY_WHISPER,
    "d_model": 1280,
    "encoder_layers": 32,
    "encoder_attention_heads": 20,
    "encoder_ffn_dim": 5120,
    "num_mel_bins": 128,
}
REAL_OMNI_AUDIO = {
    **TINY_OMNI_AUDIO,
    "encoder_layers": 32,
    "encoder_attention_heads": 20,
    "encoder_ffn_dim": 5120,
    "d_model": 1280,
}
STACK = 8


def ensure_tiny_ultravox(folder: Path | None = None) -> Path:
    folder = Path(folder) if folder is not None else cache_folder("tiny-ultravox")
    build = functools.partial(build_ultravox, whisper=TINY_WHISPER, text=MODEL_SHAPE)
    return build_once(folder, build, "tiny Ultravox (random weights)")


def ensure_tiny_omni(folder: Path | None = None) -> Path:
    folder = Path(folder) if folder is not None else cache_folder("tiny-qwen2.5-omni")
    build = functools.partial(build_omni, audio=TINY_OMNI_AUDIO, text=MODEL_SHAPE)
    return build_once(folder, build, "tiny Qwen2.5-Omni thinker (random weights)")


def _tokenizer(folder: Path, markers: tuple[str, ...], text: dict[str, Any], vocab: int) -> Any:
    bpe = train_tokenizer(folder, vocab, text["max_position_embeddings"], markers)
    return bpe


def _language_model(
    text: dict[str, Any], bpe: Any, model_type: str, device: str
) -> tuple[Any, dict[str, Any]]:
    """A random-weight causal LM of `text`'s shape over `bpe`'s vocabulary; its config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    pad, eos = bpe.token_to_id(ENDOFTEXT), bpe.token_to_id(IM_END)
    fields = {
        "tie_word_embeddings": False,
        **text,
        "vocab_size": bpe.get_vocab_size(),
        "bos_token_id": pad,
        "eos_token_id": eos,
        "pad_token_id": pad,
    }
    llama = model_type == "llama"
    config_class = LlamaConfig if llama else Qwen2Config
    model_class = LlamaForCausalLM if llama else Qwen2ForCausalLM
    config = config_class(**fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config).to(torch.bfloat16)
    return model, config.to_dict()


def _save(folder: Path, tensors: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if size >= 4 << 30:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
        size += tensor.numel() * tensor.element_size()
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    index = {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index})
    )


def _save_beside(lm: Any, bpe: Any, folder: Path, language_model: Path) -> None:
    """`lm` saved alone at `language_model` with `folder`'s tokenizer: the plain decoder that
    stages.backends.speech_in would extract from the checkpoint."""

    def save(staging: Path) -> None:
        lm.save_pretrained(staging)
        copy_tokenizer(folder, staging)
        _generation_config(staging, bpe)
        mark_random(staging)

    build_once(language_model, save, "a speech-in model's language model")


def _generation_config(folder: Path, bpe: Any) -> None:
    pad, eos = bpe.token_to_id(ENDOFTEXT), bpe.token_to_id(IM_END)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [eos, pad], "pad_token_id": pad})
    )


def build_ultravox(
    folder: Path,
    whisper: dict[str, Any],
    text: dict[str, Any],
    vocab: int = VOCAB_SIZE,
    device: str = "cpu",
    text_type: str = "qwen2",
    language_model: Path | None = None,
) -> None:
    """An Ultravox checkpoint: a Whisper encoder (`audio_tower.`), the v0.5 feed-forward
    projector (`multi_modal_projector.`) and the language model (`language_model.`, or with
    `language_model` written there instead, as for `build_omni`)."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    bpe = _tokenizer(folder, ULTRAVOX_MARKERS, text, vocab)
    lm, text_config = _language_model(text, bpe, text_type, device)
    torch.manual_seed(1)
    with torch.device(device):
        tower = WhisperEncoder(WhisperConfig(**whisper)).to(torch.bfloat16)
    d_in, hidden, d_out = whisper["d_model"] * STACK, 2 * text["hidden_size"], text["hidden_size"]
    with torch.device(device):
        projector = {
            "ln_pre.weight": torch.ones(d_in),
            "linear_1.weight": torch.randn(hidden, d_in) * d_in**-0.5,
            "ln_mid.weight": torch.ones(hidden // 2),
            "linear_2.weight": torch.randn(d_out, hidden // 2) * (hidden // 2) ** -0.5,
        }
    tensors = {f"audio_tower.{k}": v for k, v in tower.state_dict().items()}
    if language_model is None:
        tensors.update({f"language_model.{k}": v for k, v in lm.state_dict().items()})
    else:
        _save_beside(lm, bpe, folder, language_model)
    tensors.update(
        {f"multi_modal_projector.{k}": v.to(torch.bfloat16) for k, v in projector.items()}
    )
    _save(folder, tensors)
    config = {
        "architectures": ["UltravoxModel"],
        "model_type": "ultravox",
        "audio_config": {"model_type": "whisper", **whisper},
        "text_config": text_config,
        "audio_token_index": bpe.token_to_id("<|audio|>"),
        "hidden_size": hidden,
        "stack_factor": STACK,
        "projector_act": "swiglu",
        "projector_ln_mid": True,
        "num_projector_layers": 0,
        "torch_dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
    WhisperFeatureExtractor(feature_size=whisper["num_mel_bins"]).save_pretrained(folder)
    _generation_config(folder, bpe)
    mark_random(folder)


def build_omni(
    folder: Path,
    audio: dict[str, Any],
    text: dict[str, Any],
    vocab: int = VOCAB_SIZE,
    device: str = "cpu",
    language_model: Path | None = None,
) -> None:
    """A Qwen2.5-Omni checkpoint of the thinker alone (no talker): its audio encoder
    (`thinker.audio_tower.`) and language model (`thinker.model.`, `thinker.lm_head.`), and a
    config in the real one's form. Its vision tower, which speech never reaches, is left out.
    With `language_model`, the language model is written there instead, as the plain decoder
    that stages.backends.speech_in would extract (for a real size: one copy of 15 GB, not
    two); the checkpoint is then of no use elsewhere."""
    import torch
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
        Qwen2_5OmniAudioEncoderConfig,
    )
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    bpe = _tokenizer(folder, OMNI_MARKERS, text, vocab)
    lm, text_config = _language_model(text, bpe, "qwen2", device)
    head_dim = text.get("head_dim", text["hidden_size"] // text["num_attention_heads"])
    quarter = head_dim // 4
    text_config["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 1_000_000.0,
        "mrope_section": [head_dim // 2 - 2 * quarter, quarter, quarter],
    }
    audio_config = {**audio, "output_dim": text["hidden_size"]}
    torch.manual_seed(1)
    with torch.device(device):
        tower = Qwen2_5OmniAudioEncoder(Qwen2_5OmniAudioEncoderConfig(**audio_config))
        tower = tower.to(torch.bfloat16)
    tensors = {f"thinker.audio_tower.{k}": v for k, v in tower.state_dict().items()}
    if language_model is None:
        for k, v in lm.state_dict().items():
            tensors[f"thinker.{k}"] = v  # model.* and lm_head.*, as the thinker names them
    else:
        _save_beside(lm, bpe, folder, language_model)
    _save(folder, tensors)
    token = bpe.token_to_id
    config = {
        "architectures": ["Qwen2_5OmniModel"],
        "model_type": "qwen2_5_omni",
        "enable_audio_output": False,
        "torch_dtype": "bfloat16",
        "thinker_config": {
            "model_type": "qwen2_5_omni_thinker",
            "audio_config": {"model_type": "qwen2_5_omni_audio_encoder", **audio_config},
            "text_config": {**text_config, "model_type": "qwen2_5_omni_text"},
            "audio_token_index": token("<|AUDIO|>"),
            "image_token_index": token("<|IMAGE|>"),
            "video_token_index": token("<|VIDEO|>"),
            "audio_start_token_id": token("<|audio_bos|>"),
            "audio_end_token_id": token("<|audio_eos|>"),
        },
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
    WhisperFeatureExtractor(feature_size=audio["num_mel_bins"]).save_pretrained(folder)
    _generation_config(folder, bpe)
    mark_random(folder)
