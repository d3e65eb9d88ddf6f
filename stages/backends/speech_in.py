"""Speech-in models: the caller's speech into the LLM as its audio tower's embeddings.

A speech-in checkpoint holds an audio tower, a projector into the language model's embedding
space, and the language model. The pipeline splits it. The encoder stage runs the tower and
projector on the caller's audio as it comes (`AudioTower`, a window at a time); the reasoning
stage's vLLM engine serves the language model alone (`SpeechInModel.language_model`) and takes
the rows as `prompt_embeds` where the user turn's audio goes (`AudioLayout`), the rest of the
prompt as token ids (vLLM's mixed prompts: `prompt_is_token_ids`).

Why the language model alone, with `prompt_embeds` (measured on vLLM 0.32 with tiny models of
both families): Qwen2.5-Omni's model class takes no audio embeddings as multimodal data, only
mel features or audio, which would run the tower inside the engine; Ultravox's refuses its
own `audio_embeds` shape. `prompt_embeds` work for both, give the same first-token logprobs as
the models' own audio paths, and prefix caching hashes their rows, so a turn prefilled while it
is spoken is found in the cache when it ends. The engine then holds no tower, and the model
classes' multimodal processors (Qwen2.5-Omni's needs torchvision) are never made.

Families:
- Ultravox (`model_type: ultravox`): a Whisper encoder, its frames stacked by `stack_factor`
  (8) and projected by a SwiGLU; 6.25 rows a second. Whisper attends across its whole window,
  so a row would change as more audio came; the tower therefore reads fixed windows
  (`speech_in.window_ms`, 1.92 s: 12 rows) and a window's rows are final once it is complete.
  What that costs: no attention across a window's edge (the model reads up to 30 s at once).
- Qwen2.5-Omni's thinker (`model_type: qwen2_5_omni`): its own audio encoder, 25 rows a second,
  attending within blocks of 2 s (`n_window` x 2 mel frames): a complete block's rows are those
  of the whole clip, so the windows cost nothing. Its language model is a Qwen2 with M-RoPE,
  whose three position sections are equal for text and audio rows alike, so it is served as a
  plain Qwen2: the same positions, the same output.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from stages.backends.model_cache import (
    build_once,
    copy_tokenizer,
    is_complete,
    language_model_folder,
)
from stages.messages import CALLER_RATE

logger = logging.getLogger(__name__)

HOP = 160  # Whisper's mel frames: 10 ms at 16 kHz
N_FFT = 400  # and the width of their STFT
ULTRAVOX_WINDOW_MS = 1920  # 192 mel frames: 12 whole rows of 16 frames
TORCH_DTYPES = ("bfloat16", "float16", "float32")


class SpeechInError(ValueError):
    """A model that is not a speech-in model, or one this gateway cannot serve; the message
    says which and why."""


@dataclass(frozen=True)
class AudioLayout:
    """Where a user turn's audio rows go in its message: `before` + the rows + `after`.
    `marker` stands for the rows in the rendered chat text (a special token of the family's,
    so that the template leaves it alone); its tokens are replaced by the rows."""

    marker: str
    before: str = ""
    after: str = ""

    @property
    def content(self) -> str:
        """A user message's content that holds a turn's audio."""
        return self.before + self.marker + self.after


class AudioTower(Protocol):
    """A family's audio tower and projector, loaded on a device."""

    window_samples: int  # caller samples a window holds; its rows are final once complete
    dim: int  # the language model's hidden size: a row's width
    dtype: str

    def rows(self, audio: np.ndarray) -> np.ndarray:
        """The rows of one window (or of the last, shorter one) of PCM16 caller audio, as a
        (rows, dim) array of `dtype` (bfloat16 as its 16-bit pattern, in uint16)."""

    def rows_of(self, audios: Sequence[np.ndarray]) -> list[np.ndarray]:
        """`rows` of several windows (of any sessions) in as few passes as the family
        allows: the same rows as one at a time."""


@dataclass(frozen=True)
class SpeechInModel:
    """A speech-in checkpoint, as the stages use it."""

    family: str  # "ultravox" or "qwen2_5_omni"
    folder: Path  # the checkpoint's files, local
    config: dict[str, Any]  # its config.json
    layout: AudioLayout
    extract: Callable[[], str]  # the language model for vLLM, made once (the cache)
    tower: Callable[[str, str], AudioTower]  # (device, dtype) -> the loaded tower

    def language_model(self) -> str:
        """What vLLM serves: a folder (extracted from the checkpoint once, then cached), or a
        hub id (Ultravox's text_model_id). Only the reasoning stage asks."""
        return self.extract()

    @property
    def random_weights(self) -> bool:
        from stages.backends.tiny_chat_model import has_random_weights

        return has_random_weights(self.folder)


def load_speech_in(model: str, window_ms: int | None = None) -> SpeechInModel:
    """The speech-in model `model` names (a local folder, a Hugging Face id, or bundled:NAME).
    `window_ms`: Ultravox's tower window. Raises SpeechInError for a model of no speech-in
    family."""
    folder = _local(model)
    config = json.loads((folder / "config.json").read_text())
    kind = config.get("model_type")
    if kind == "ultravox":
        return _ultravox(model, folder, config, window_ms)
    if kind in ("qwen2_5_omni", "qwen2_5_omni_thinker"):
        return _omni(model, folder, config, window_ms)
    raise SpeechInError(
        f"{model}: model_type {kind!r} is no speech-in family this gateway serves (ultravox, "
        "qwen2_5_omni); unset reasoning.speech_in to serve it as a chat model"
    )


def _local(model: str) -> Path:
    from stages.backends import bundled

    path = Path(bundled.resolve(model)).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpeechInError(f"{model}: the folder has no config.json")
        return path.absolute()
    if model.startswith(("/", ".", "~")):
        raise SpeechInError(f"{model}: no such folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model))
    except Exception as exc:
        raise SpeechInError(f"{model}: not a folder here, and the hub gave {exc}") from exc


def _weights(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text())["weight_map"]
        return {name: folder / file for name, file in mapping.items()}
    from safetensors import safe_open

    names: dict[str, Path] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names.update(dict.fromkeys(f.keys(), file))
    return names


def _tensors(weights: dict[str, Path], prefix: str) -> dict[str, Any]:
    """The tensors under `prefix`, the prefix taken off their names."""
    from safetensors import safe_open

    out: dict[str, Any] = {}
    by_file: dict[Path, list[str]] = {}
    for name, file in weights.items():
        if name.startswith(prefix):
            by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                out[name[len(prefix) :]] = f.get_tensor(name)
    return out


def _extract_language_model(
    source: str,
    folder: Path,
    prefixes: dict[str, str],
    config: dict[str, Any],
) -> Path:
    """The language model of the checkpoint in `folder` as a folder of its own that vLLM
    serves as a plain decoder: the tensors under `prefixes` (old -> new prefix) renamed,
    `config`, the checkpoint's tokenizer. Written once to the model cache."""
    dest = language_model_folder(source, folder)

    def build(staging: Path) -> None:

        from safetensors import safe_open
        from safetensors.torch import save_file

        weights = _weights(folder)
        shard: dict[str, Any] = {}
        shard_bytes, shards, index = 0, 0, {}

        def flush() -> None:
            nonlocal shard, shard_bytes, shards
            if shard:
                shards += 1
                name = f"model-{shards:05d}.safetensors"
                save_file(shard, str(staging / name), metadata={"format": "pt"})
                index.update(dict.fromkeys(shard, name))
                shard, shard_bytes = {}, 0

        for name, file in sorted(weights.items()):
            old = next((o for o in prefixes if name.startswith(o)), None)
            if old is None:
                continue
            new = prefixes[old] + name[len(old) :]
            with safe_open(str(file), framework="pt") as f:
                tensor = f.get_tensor(name).contiguous()
            shard[new] = tensor
            shard_bytes += tensor.numel() * tensor.element_size()
            if shard_bytes >= 4 << 30:
                flush()
        flush()
        if not index:
            raise SpeechInError(f"{source}: no language-model weights under {list(prefixes)}")
        total = {"metadata": {}, "weight_map": index}
        (staging / "model.safetensors.index.json").write_text(json.dumps(total, indent=1))
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        copy_tokenizer(folder, staging)
        from stages.backends.tiny_chat_model import RANDOM_WEIGHTS_MARKER

        if (folder / RANDOM_WEIGHTS_MARKER).is_file():
            shutil.copy(folder / RANDOM_WEIGHTS_MARKER, staging / RANDOM_WEIGHTS_MARKER)

    logger.info("speech-in: %s's language model for vLLM: %s", source, dest)
    return build_once(dest, build, f"language model of {source}")


# -- Ultravox ------------------------------------------------------------------------------


def _ultravox(
    source: str, folder: Path, config: dict[str, Any], window_ms: int | None
) -> SpeechInModel:
    if config.get("num_projector_layers"):
        raise SpeechInError(
            f"{source}: Ultravox's transformer projector (num_projector_layers "
            f"{config['num_projector_layers']}) is not supported; its feed-forward one is"
        )
    weights = _weights(folder)
    text_model_id = config.get("text_model_id")
    built_beside = is_complete(language_model_folder(source, folder))  # a random-weight build
    if built_beside or any(name.startswith("language_model.") for name in weights):
        text = dict(config["text_config"])
        if not text.get("architectures"):
            text["architectures"] = [_causal_lm(text.get("model_type", "llama"))]
        text["torch_dtype"] = config.get("torch_dtype", "bfloat16")

        def language_model() -> str:
            extracted = _extract_language_model(source, folder, {"language_model.": ""}, text)
            return str(extracted)

    elif text_model_id:

        def language_model() -> str:
            return str(text_model_id)

    else:
        raise SpeechInError(f"{source}: no language-model weights and no text_model_id")
    window_ms = window_ms or ULTRAVOX_WINDOW_MS
    if window_ms % 160:
        raise SpeechInError(
            f"reasoning.speech_in.window_ms {window_ms}: Ultravox's rows are 160 ms of audio "
            "each; give a multiple of 160"
        )

    def tower(device: str, dtype: str) -> AudioTower:
        return UltravoxTower(folder, config, weights, window_ms, device, dtype)

    layout = AudioLayout("<|audio|>")
    return SpeechInModel("ultravox", folder, config, layout, language_model, tower)


def _causal_lm(model_type: str) -> str:
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    AutoConfig.for_model(model_type)  # an unknown type fails here, naming it
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def _torch_dtype(dtype: str) -> Any:
    import torch

    if dtype not in TORCH_DTYPES:
        raise SpeechInError(f"dtype {dtype!r}: one of {TORCH_DTYPES}")
    return getattr(torch, dtype)


def _as_rows(tensor: Any, dtype: str) -> np.ndarray:
    """A (rows, dim) tensor as numpy, bfloat16 kept as its bit pattern (numpy has none)."""
    import torch

    tensor = tensor.detach().to("cpu", _torch_dtype(dtype)).contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


class UltravoxTower:
    """Whisper's encoder as Ultravox runs it (mel inputs shorter than 30 s, positions cut to
    the input), frames stacked and projected, over fixed windows of `window_ms`."""

    def __init__(
        self,
        folder: Path,
        config: dict[str, Any],
        weights: dict[str, Path],
        window_ms: int,
        device: str,
        dtype: str,
    ) -> None:
        from transformers import WhisperConfig, WhisperFeatureExtractor
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        torch_dtype = _torch_dtype(dtype)
        self.dtype, self.device = dtype, device
        self.stack = int(config.get("stack_factor", 8))
        self.window_samples = window_ms * CALLER_RATE // 1000
        audio_model_id = config.get("audio_model_id")
        tower_weights = _tensors(weights, "audio_tower.")
        if not tower_weights:
            if not audio_model_id:
                raise SpeechInError(f"{folder}: no audio-tower weights and no audio_model_id")
            from transformers import WhisperModel

            whisper = WhisperModel.from_pretrained(audio_model_id, torch_dtype=torch_dtype)
            self.encoder = whisper.encoder
            self.features = WhisperFeatureExtractor.from_pretrained(audio_model_id)
        else:
            audio = {k: v for k, v in config["audio_config"].items() if k != "model_type"}
            self.encoder = WhisperEncoder(WhisperConfig(**audio)).to(torch_dtype)
            self.encoder.load_state_dict(
                {k.removeprefix("model.encoder."): v for k, v in tower_weights.items()}
            )
            self.features = WhisperFeatureExtractor.from_pretrained(folder)
        self.encoder.to(device).eval()
        projector = _tensors(weights, "multi_modal_projector.")
        self.projector = {k: v.to(device, torch_dtype) for k, v in projector.items()}
        self.ln_mid = bool(config.get("projector_ln_mid", True))
        self.dim = int(self.projector["linear_2.weight"].shape[0])

    def _mel(self, audio: np.ndarray) -> Any:
        wave = audio.astype(np.float32) / 32768.0
        if len(wave) < 2 * HOP:
            wave = np.pad(wave, (0, 2 * HOP - len(wave)))
        out = self.features(
            [wave],
            sampling_rate=CALLER_RATE,
            padding="longest",
            pad_to_multiple_of=HOP,
            truncation=False,
            return_attention_mask=True,
            return_tensors="pt",
        )
        frames = int(out.attention_mask.sum())
        return out.input_features[0, :, :frames]

    def rows(self, audio: np.ndarray) -> np.ndarray:
        return self.rows_of([audio])[0]

    def rows_of(self, audios: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Windows of one length in one pass (Whisper's attention sees the whole input, so
        a shorter one padded would not give its own rows)."""
        import torch

        mels = [self._mel(audio) for audio in audios]
        by_length: dict[int, list[int]] = collections.defaultdict(list)
        for i, mel in enumerate(mels):
            by_length[mel.shape[-1]].append(i)
        out: dict[int, np.ndarray] = {}
        with torch.inference_mode():
            for same in by_length.values():
                batch = torch.stack([mels[i] for i in same])
                out.update(zip(same, self._pass(batch), strict=True))
        return [out[i] for i in range(len(mels))]

    def _pass(self, mel: Any) -> list[np.ndarray]:
        """The rows of a (windows, mels, frames) batch of equal windows."""
        import torch.nn.functional as F

        enc = self.encoder
        x = mel.to(self.device, enc.conv1.weight.dtype)
        x = F.gelu(enc.conv1(x))
        x = F.gelu(enc.conv2(x)).permute(0, 2, 1)
        x = x + enc.embed_positions.weight[: x.shape[1]]
        for layer in enc.layers:
            out = layer(x, attention_mask=None)
            x = out[0] if isinstance(out, tuple) else out
        return [self._project(frames, mel.shape[-1]) for frames in enc.layer_norm(x)]

    def _project(self, frames: Any, mel_frames: int) -> np.ndarray:
        """One window's encoder frames, stacked and projected into the language model's rows."""
        import torch.nn.functional as F

        n_rows = math.ceil(mel_frames / (2 * self.stack))
        stacked = F.pad(frames, (0, 0, 0, -frames.shape[0] % self.stack))
        stacked = stacked.reshape(-1, frames.shape[1] * self.stack)
        p = self.projector
        h = _rms_norm(stacked, p["ln_pre.weight"]) @ p["linear_1.weight"].T
        half = h.shape[-1] // 2
        h = h[..., :half] * F.silu(h[..., half:])
        if self.ln_mid:
            h = _rms_norm(h, p["ln_mid.weight"])
        h = h @ p["linear_2.weight"].T
        if not self.ln_mid:
            h = _rms_norm(h, p["ln_post.weight"])
        return _as_rows(h[:n_rows], self.dtype)


def _rms_norm(x: Any, weight: Any, eps: float = 1e-6) -> Any:
    import torch

    y = x.float()
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


# -- Qwen2.5-Omni's thinker ----------------------------------------------------------------

OMNI_TEXT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "head_dim",
)


def _omni(
    source: str, folder: Path, config: dict[str, Any], window_ms: int | None
) -> SpeechInModel:
    if window_ms is not None:
        raise SpeechInError(
            "reasoning.speech_in.window_ms: Qwen2.5-Omni's tower has windows of its own (2 s); "
            "unset it"
        )
    thinker = config.get("thinker_config", config)
    text = thinker["text_config"]
    qwen2 = {k: text[k] for k in OMNI_TEXT_KEYS if k in text}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = rope.get("rope_theta", text.get("rope_theta", 1_000_000.0))
    qwen2.update(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        rope_theta=theta,  # M-RoPE's sections all alike for text and audio: plain RoPE
        torch_dtype=config.get("torch_dtype", "bfloat16"),
        sliding_window=None,
        use_sliding_window=False,
    )
    prefix = "thinker." if "thinker_config" in config else ""
    renamed = {f"{prefix}model.": "model.", f"{prefix}lm_head.": "lm_head."}

    def language_model() -> str:
        return str(_extract_language_model(source, folder, renamed, qwen2))

    def tower(device: str, dtype: str) -> AudioTower:
        return OmniTower(folder, thinker, prefix, device, dtype)

    layout = AudioLayout("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>")
    return SpeechInModel("qwen2_5_omni", folder, config, layout, language_model, tower)


class OmniTower:
    """Qwen2.5-Omni's audio encoder (transformers' class, the one vLLM runs too), on windows of
    its own attention blocks: 2 s, 50 rows."""

    def __init__(
        self, folder: Path, thinker: dict[str, Any], prefix: str, device: str, dtype: str
    ) -> None:
        from transformers import WhisperFeatureExtractor
        from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
            Qwen2_5OmniAudioEncoderConfig,
        )
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniAudioEncoder,
        )

        audio = {k: v for k, v in thinker["audio_config"].items() if k != "model_type"}
        config = Qwen2_5OmniAudioEncoderConfig(**audio)
        config._attn_implementation = "sdpa"
        torch_dtype = _torch_dtype(dtype)
        self.dtype, self.device = dtype, device
        self.encoder = Qwen2_5OmniAudioEncoder(config).to(torch_dtype)
        self.encoder.load_state_dict(_tensors(_weights(folder), f"{prefix}audio_tower."))
        self.encoder.to(device).eval()
        self.features = WhisperFeatureExtractor.from_pretrained(folder)
        self.window_samples = 2 * config.n_window * HOP
        self.dim = int(config.output_dim)

    def rows(self, audio: np.ndarray) -> np.ndarray:
        return self.rows_of([audio])[0]

    def _mel(self, audio: np.ndarray) -> Any:
        wave = audio.astype(np.float32) / 32768.0
        # the window and an STFT's width of the silence that padding to 30 s (the processor's
        # way) would put after it: the same frames, without 30 s of spectrogram a window
        out = self.features(
            [np.pad(wave, (0, N_FFT))],
            sampling_rate=CALLER_RATE,
            padding="longest",
            return_tensors="pt",
        )
        frames = max(math.ceil(len(wave) / HOP), 4)
        return out.input_features[0, :, :frames]

    def rows_of(self, audios: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Every window in one pass, as the encoder takes several audios (vLLM's way): each
        window's attention blocks are its own, so its rows are what it gets alone."""
        import torch

        mels = [self._mel(audio) for audio in audios]
        mel = torch.cat(mels, dim=-1).to(self.device, _torch_dtype(self.dtype))
        with torch.inference_mode():
            lengths = torch.tensor([m.shape[-1] for m in mels], device=self.device)
            after_cnn = (lengths - 1) // 2 + 1
            hidden = self.encoder(mel, feature_lens=lengths, aftercnn_lens=after_cnn)
            rows = _as_rows(hidden.last_hidden_state, self.dtype)
        # each window's rows: its frames after the convolutions, pooled in pairs
        counts = (after_cnn // 2).tolist()
        return list(np.split(rows, np.cumsum(counts)[:-1]))
