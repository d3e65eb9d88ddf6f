"""A Whisper model in CTranslate2's format made into a transformers checkpoint.

The bundled Whisper weights come as CTranslate2 models (model.bin). The transformers backend
(stages.backends.asr_whisper) is the one that batches on a GPU with CUDA graphs, and
CTranslate2's wheels need CUDA 12's libraries where the GPU stack may carry another CUDA: the
same weights, read from model.bin and written as a folder transformers loads, serve both.

model.bin is CTranslate2's binary layout (its specs.model_spec writes it): a version, the spec's
name and revision, then each variable as name, shape, type and bytes, then aliases. The Whisper
converter fused the attention projections (query, key and value into one matrix, the cross
attention's key and value into another) and gave the key projection a zero bias it does not
have in transformers; they are split here. Only unquantized models (float16, float32, bfloat16)
convert: an int8 model has lost what its weights were.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

BINARY_VERSIONS = (5, 6)  # the layouts read here (CTranslate2 4.x writes 6)
# CTranslate2's DataType enum (include/ctranslate2/types.h), in order
DTYPES: tuple[Any, ...] = (np.float32, np.int8, np.int16, np.int32, np.float16, "bfloat16")


class ConversionError(ValueError):
    """model.bin is not a CTranslate2 Whisper model this converter can turn into a checkpoint;
    the message says what was found."""


def read_model_bin(path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """The spec name and the variables (aliases resolved) of a CTranslate2 model.bin. bfloat16
    variables come as float32."""
    data = path.read_bytes()
    at = 0

    def take(fmt: str) -> int:
        nonlocal at
        (value,) = struct.unpack_from(fmt, data, at)
        at += struct.calcsize(fmt)
        return value

    def text() -> str:
        nonlocal at
        size = take("H")  # with its terminating NUL
        value = data[at : at + size - 1].decode()
        at += size
        return value

    try:
        version = take("I")
        if version not in BINARY_VERSIONS:
            raise ConversionError(
                f"{path}: CTranslate2 binary version {version}; this converter reads "
                f"{' and '.join(map(str, BINARY_VERSIONS))}"
            )
        spec, _revision = text(), take("I")
        variables: dict[str, np.ndarray] = {}
        for _ in range(take("I")):
            name = text()
            shape = [take("I") for _ in range(take("B"))]
            kind, size = take("B"), take("I")
            raw = data[at : at + size]
            at += size
            if DTYPES[kind] == "bfloat16":  # numpy has none: the upper half of a float32
                value = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
            else:
                value = np.frombuffer(raw, DTYPES[kind])
            variables[name] = value.reshape(shape)
        for _ in range(take("I")):
            alias, target = text(), text()
            variables[alias] = variables[target]
    except ConversionError:
        raise
    except (struct.error, IndexError, KeyError, ValueError) as exc:  # cut short, or not one
        raise ConversionError(f"{path}: not a whole CTranslate2 model.bin ({exc})") from exc
    return spec, variables


def _layers(variables: dict[str, np.ndarray], side: str) -> int:
    prefix = f"{side}/layer_"  # layer_0, layer_1, ... (and layer_norm, not a layer)
    found = {k[len(prefix) :].split("/")[0] for k in variables if k.startswith(prefix)}
    return sum(1 for index in found if index.isdigit())


def whisper_state_dict(variables: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' WhisperForConditionalGeneration weights from CTranslate2's variables."""
    v = variables
    out: dict[str, np.ndarray] = {}

    def linear(to: str, name: str) -> None:
        out[f"{to}.weight"] = v[f"{name}/weight"]
        out[f"{to}.bias"] = v[f"{name}/bias"]

    def norm(to: str, name: str) -> None:
        out[f"{to}.weight"] = v[f"{name}/gamma"]
        out[f"{to}.bias"] = v[f"{name}/beta"]

    def split(to: str, name: str, parts: tuple[str, ...]) -> None:
        """A fused projection into its parts; k_proj has no bias in transformers."""
        weights = np.split(v[f"{name}/weight"], len(parts))
        biases = np.split(v[f"{name}/bias"], len(parts))
        for part, weight, bias in zip(parts, weights, biases, strict=True):
            out[f"{to}.{part}.weight"] = weight
            if part != "k_proj":
                out[f"{to}.{part}.bias"] = bias

    for conv in ("conv1", "conv2"):
        linear(f"model.encoder.{conv}", f"encoder/{conv}")
    out["model.encoder.embed_positions.weight"] = v["encoder/position_encodings/encodings"]
    norm("model.encoder.layer_norm", "encoder/layer_norm")
    out["model.decoder.embed_tokens.weight"] = v["decoder/embeddings/weight"]
    out["model.decoder.embed_positions.weight"] = v["decoder/position_encodings/encodings"]
    norm("model.decoder.layer_norm", "decoder/layer_norm")
    for side in ("encoder", "decoder"):
        for i in range(_layers(v, side)):
            to, name = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
            split(
                f"{to}.self_attn", f"{name}/self_attention/linear_0", ("q_proj", "k_proj", "v_proj")
            )
            linear(f"{to}.self_attn.out_proj", f"{name}/self_attention/linear_1")
            norm(f"{to}.self_attn_layer_norm", f"{name}/self_attention/layer_norm")
            if side == "decoder":
                linear(f"{to}.encoder_attn.q_proj", f"{name}/attention/linear_0")
                split(f"{to}.encoder_attn", f"{name}/attention/linear_1", ("k_proj", "v_proj"))
                linear(f"{to}.encoder_attn.out_proj", f"{name}/attention/linear_2")
                norm(f"{to}.encoder_attn_layer_norm", f"{name}/attention/layer_norm")
            linear(f"{to}.fc1", f"{name}/ffn/linear_0")
            linear(f"{to}.fc2", f"{name}/ffn/linear_1")
            norm(f"{to}.final_layer_norm", f"{name}/ffn/layer_norm")
    return out


def convert(source: Path, folder: Path) -> None:
    """Write the transformers checkpoint of the CTranslate2 Whisper model in `source` (its
    model.bin, config.json and tokenizer.json) into `folder`."""
    import torch
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperProcessor,
        WhisperTokenizerFast,
    )

    spec, variables = read_model_bin(source / "model.bin")
    if spec != "WhisperSpec":
        raise ConversionError(f"{source}/model.bin: a {spec}, not a Whisper model")
    quantized = sorted({str(a.dtype) for k, a in variables.items() if k.endswith("/weight")})
    if not set(quantized) <= {"float16", "float32"}:
        raise ConversionError(
            f"{source}/model.bin: weights of type {', '.join(quantized)}; only float16, "
            "bfloat16 and float32 models convert (quantized ones have lost their weights)"
        )
    ct2 = json.loads((source / "config.json").read_text())
    tokenizer = WhisperTokenizerFast(
        tokenizer_file=str(source / "tokenizer.json"),
        unk_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    token = tokenizer.convert_tokens_to_ids
    eot = token("<|endoftext|>")
    embeddings = variables["decoder/embeddings/weight"]
    d_model = embeddings.shape[1]
    multilingual = embeddings.shape[0] >= 51865  # the English-only models have 51864 tokens
    config = WhisperConfig(
        vocab_size=embeddings.shape[0],
        num_mel_bins=variables["encoder/conv1/weight"].shape[1],
        d_model=d_model,
        encoder_layers=_layers(variables, "encoder"),
        decoder_layers=_layers(variables, "decoder"),
        encoder_attention_heads=int(variables["encoder/num_heads"]),
        decoder_attention_heads=int(variables["decoder/num_heads"]),
        encoder_ffn_dim=variables["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=variables["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=variables["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=variables["decoder/position_encodings/encodings"].shape[0],
        decoder_start_token_id=token("<|startoftranscript|>"),
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        begin_suppress_tokens=ct2.get("suppress_ids_begin"),
        suppress_tokens=ct2.get("suppress_ids"),
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    weights = {
        k: torch.from_numpy(np.array(a, dtype=np.float32)).to(torch.float16)
        for k, a in whisper_state_dict(variables).items()
    }
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    missing = [k for k in missing if k != "proj_out.weight"]  # tied to the token embeddings
    if missing or unexpected:
        raise ConversionError(
            f"{source}/model.bin: its variables do not fill a Whisper model "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.tie_weights()
    languages = {
        tokenizer.convert_ids_to_tokens(i): i for i in ct2.get("lang_ids", [])
    }  # "<|en|>" -> its id
    model.generation_config = GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        max_length=config.max_target_positions,
        begin_suppress_tokens=config.begin_suppress_tokens,
        suppress_tokens=config.suppress_tokens,
        no_timestamps_token_id=token("<|notimestamps|>"),
        is_multilingual=multilingual,
        alignment_heads=ct2.get("alignment_heads"),
        **(
            {
                "lang_to_id": languages,
                "task_to_id": {
                    "transcribe": token("<|transcribe|>"),
                    "translate": token("<|translate|>"),
                },
            }
            if multilingual
            else {}
        ),
    )
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    extractor = WhisperFeatureExtractor(feature_size=config.num_mel_bins)
    WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(folder)
