"""Random-weight models of real deployment sizes, for GPU runs on machines without a model hub.

Built where they run (weights initialised on the GPU), saved with `save_pretrained` and loaded
through the same backends as real checkpoints. Their output is noise: Whisper transcribes
babble, the chat model answers with random tokens, SpeechT5 speaks static, the talker
(Orpheus-3B's shape) speaks SNAC codes that decode to noise, the speech-in model (Qwen2.5-Omni-
7B's thinker: its audio tower, and the chat model's shape for its language model; on request
Ultravox v0.5's: whisper-large-v3-turbo's encoder before Llama-3.1-8B) hears rows of noise. Every
folder carries the `random_weights` marker, so the stages say so in their logs.

    python -m loadtest.gpu_models [--root .cache/gpu-models] [--device cuda] [--preset real]
                                  [--ultravox]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stages.backends.model_cache import build_once, language_model_folder
from stages.backends.tiny_chat_model import MODEL_SHAPE, VOCAB_SIZE, ensure_chat_model
from stages.backends.tiny_speech_in import (
    REAL_OMNI_AUDIO,
    REAL_WHISPER,
    TINY_OMNI_AUDIO,
    TINY_WHISPER,
    build_omni,
    build_ultravox,
)
from stages.backends.tiny_speech_models import (
    HIFIGAN_SHAPE,
    SPEECHT5_SHAPE,
    WHISPER_SHAPE,
    WHISPER_VOCAB_SIZE,
    ensure_speecht5,
    ensure_whisper,
)
from stages.backends.tiny_talker import (
    ORPHEUS_3B_SHAPE,
    TINY_TALKER_SHAPE,
    ensure_snac,
    ensure_talker,
)

DEFAULT_ROOT = Path(".cache/gpu-models")

#: Qwen2.5-7B-Instruct's architecture (its config.json), with a 32k tokenizer trained here
#: instead of its 152k one: 6.8 B parameters instead of 7.6 B, the same per-token work.
QWEN25_7B_SHAPE = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 32768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
QWEN25_VOCAB = 32768
#: Llama-3.1-8B's architecture (Ultravox v0.5's language model), the same 32k tokenizer
LLAMA31_8B_SHAPE = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rope_theta": 500_000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
#: openai/whisper-small (244 M parameters); the tokenizer trained here reaches fewer than its
#: 51,865 tokens (the vocabulary size is in the results).
WHISPER_SMALL_SHAPE = {
    "d_model": 768,
    "encoder_layers": 12,
    "decoder_layers": 12,
    "encoder_attention_heads": 12,
    "decoder_attention_heads": 12,
    "encoder_ffn_dim": 3072,
    "decoder_ffn_dim": 3072,
    "num_mel_bins": 80,
    "max_source_positions": 1500,
    "max_target_positions": 448,
}
WHISPER_SMALL_VOCAB = 51865
#: transformers' defaults are microsoft/speecht5_tts (144 M) and speecht5_hifigan (13 M).
SPEECHT5_REAL_SHAPE: dict[str, object] = {}
HIFIGAN_REAL_SHAPE: dict[str, object] = {}

PRESETS = {
    # name: (chat shape, chat vocab, whisper shape, whisper vocab, speecht5, hifigan, talker,
    # the speech-in model's audio tower, Ultravox's whisper encoder and language model)
    "real": (
        QWEN25_7B_SHAPE,
        QWEN25_VOCAB,
        WHISPER_SMALL_SHAPE,
        WHISPER_SMALL_VOCAB,
        SPEECHT5_REAL_SHAPE,
        HIFIGAN_REAL_SHAPE,
        ORPHEUS_3B_SHAPE,  # Orpheus-3B, the chat model's tokenizer for its text tokens
        REAL_OMNI_AUDIO,  # Qwen2.5-Omni-7B's; its language model of the chat model's shape
        (REAL_WHISPER, LLAMA31_8B_SHAPE),  # whisper-large-v3-turbo's encoder, Llama-3.1-8B
    ),
    # the test-sized models, to try the GPU run's script on a CPU
    "tiny": (
        MODEL_SHAPE,
        VOCAB_SIZE,
        WHISPER_SHAPE,
        WHISPER_VOCAB_SIZE,
        SPEECHT5_SHAPE,
        HIFIGAN_SHAPE,
        TINY_TALKER_SHAPE,
        TINY_OMNI_AUDIO,
        (TINY_WHISPER, MODEL_SHAPE),
    ),
}


@dataclass(frozen=True)
class GpuModels:
    chat: str
    whisper: str
    speecht5: str
    hifigan: str
    talker: str
    snac: str
    omni: str  # the speech-in model (reasoning.speech_in)
    ultravox: str | None  # the other speech-in family, when asked for
    preset: str
    build_s: float


def ensure_models(
    root: Path = DEFAULT_ROOT, device: str = "cuda", preset: str = "real", ultravox: bool = False
) -> GpuModels:
    """Build (once) the preset's models under `root` (Ultravox's only with `ultravox`);
    returns their folders."""
    chat_shape, chat_vocab, whisper_shape, whisper_vocab, t5_shape, gan_shape, talker_shape = (
        PRESETS[preset][:7]
    )
    omni_audio, (ultravox_audio, ultravox_text) = PRESETS[preset][7:]
    root = Path(root).absolute()
    t0 = time.monotonic()
    chat = ensure_chat_model(root / f"chat-{preset}", chat_shape, chat_vocab, device)
    whisper = ensure_whisper(root / f"whisper-{preset}", whisper_shape, whisper_vocab, device)
    speech = ensure_speecht5(root / f"speecht5-{preset}", t5_shape, gan_shape, device)
    talker = ensure_talker(
        root / f"talker-{preset}", talker_shape, device=device, tokenizer_from=chat
    )
    omni = root / f"omni-{preset}"
    # its language model straight where the reasoning stage looks for it (one copy, not two)
    build = functools.partial(
        build_omni,
        audio=omni_audio,
        text=chat_shape,
        vocab=chat_vocab,
        device=device,
        language_model=language_model_folder(str(omni), omni),
    )
    build_once(omni, build, "Qwen2.5-Omni thinker (random weights)")
    uv = root / f"ultravox-{preset}"
    if ultravox:
        build = functools.partial(
            build_ultravox,
            whisper=ultravox_audio,
            text=ultravox_text,
            vocab=chat_vocab,
            device=device,
            text_type="llama",
            language_model=language_model_folder(str(uv), uv),
        )
        build_once(uv, build, "Ultravox v0.5 (random weights)")
    snac = ensure_snac(root / "snac-24khz", device)  # last: its package may come later
    return GpuModels(
        str(chat),
        str(whisper),
        str(speech.model),
        str(speech.vocoder),
        str(talker),
        str(snac),
        str(omni),
        str(uv) if ultravox else None,
        preset,
        round(time.monotonic() - t0, 1),
    )


def describe(models: GpuModels) -> dict[str, object]:
    """The shapes as built (each folder's config.json), for the results."""
    out: dict[str, object] = {"preset": models.preset, "random_weights": True}
    names = ("chat", "whisper", "speecht5", "hifigan", "talker", "snac", "omni", "ultravox")

    def shape(config: dict[str, Any]) -> dict[str, Any]:
        keys = [k for k in config if k.endswith(("_size", "_layers", "_heads", "_dim"))]
        return {k: config[k] for k in sorted(keys) if isinstance(config[k], int)}

    for name in (n for n in names if getattr(models, n)):
        config = json.loads((Path(getattr(models, name)) / "config.json").read_text())
        out[name] = shape(config)
        out[name]["architecture"] = (config.get("architectures") or ["?"])[0]
        inner = config.get("thinker_config", config)  # a speech-in model's two halves
        for part in ("audio_config", "text_config"):
            if part in inner:
                out[name][part] = shape(inner[part])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="real")
    parser.add_argument("--ultravox", action="store_true", help="build Ultravox's too")
    args = parser.parse_args()
    models = ensure_models(args.root, args.device, args.preset, args.ultravox)
    print(json.dumps({**asdict(models), "shapes": describe(models)}, indent=2))


if __name__ == "__main__":
    main()
