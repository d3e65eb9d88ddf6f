"""The GPU layouts (configs/gpu-*.yaml) with the built random-weight models' folders, the
variants of a layout a run compares, and the models built once for them (loadtest.gpu_models).

Stage processes are spawned and re-import the running script as __mp_main__: torch, vLLM and
CUDA stay out of this module's imports, so that nothing initialises CUDA before a stage's
CUDA_VISIBLE_DEVICES is set."""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing as mp
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from loadtest.settings import setting_overrides

CONFIGS = Path(__file__).parents[1] / "configs"
LAYOUT_CONFIGS = {
    "one": "gpu-one.yaml",
    "tp2": "gpu-tp2.yaml",
    "talker": "gpu-talker.yaml",
    "speech-in": "gpu-speech-in.yaml",
    # speech-in whose turns are prefilled only when they end: what prefilling while the
    # caller speaks saves
    "speech-in-at-end": "gpu-speech-in.yaml",
    # the other family: Ultravox v0.5's shapes (loadtest.gpu_models --ultravox)
    "speech-in-ultravox": "gpu-speech-in.yaml",
}
#: what a layout changes from its file
LAYOUT_SETTINGS: dict[str, dict[str, Any]] = {
    "speech-in-at-end": {"reasoning.speech_in.prefill_while_speaking": False},
}
#: layouts whose reasoning model is a speech-in model (loadtest.gpu_models' omni, or ultravox)
SPEECH_IN_LAYOUTS = frozenset({"speech-in", "speech-in-at-end", "speech-in-ultravox"})
ULTRAVOX_LAYOUTS = frozenset({"speech-in-ultravox"})
#: layouts whose voice is the talker (vLLM speaking SNAC codes), not SpeechT5
TALKER_LAYOUTS = frozenset({"talker"})
VOCODER_DTYPES = ("float32", "bfloat16", "float16")


def gpu_sharing_modes() -> tuple[str, ...]:
    """The values of PipelineConfig.gpu_sharing, read off the config's own Literal."""
    from stages.config import PipelineConfig

    return typing.get_args(PipelineConfig.model_fields["gpu_sharing"].annotation)


@dataclass(frozen=True)
class Vocoders:
    """A vocoder variant to run: processes, and replies each steps together (REPLICASxBATCH)."""

    replicas: int
    batch: int

    @classmethod
    def parse(cls, text: str) -> Vocoders:
        try:
            replicas, batch = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"vocoder variant {text!r} is not REPLICASxBATCH, e.g. 4x1 or 1x8"
            ) from None
        if not (1 <= replicas <= 16 and 1 <= batch <= 64):
            raise argparse.ArgumentTypeError(f"vocoder variant {text!r}: 1-16 x 1-64")
        return cls(replicas, batch)

    def __str__(self) -> str:
        return f"{self.replicas}x{self.batch}"


@dataclass(frozen=True)
class ThreadShares:
    """Per-stage caps on the SMs a stage's kernels may use under MPS, e.g.
    `reasoning=60:vocoder=40` (`none`: no caps)."""

    shares: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, text: str) -> ThreadShares:
        if text == "none":
            return cls(())
        shares = []
        for part in text.split(":"):
            stage, _, value = part.partition("=")
            valid = value.isdigit() and 1 <= int(value) <= 100
            if stage not in ("encoder", "reasoning", "vocoder") or not valid:
                raise argparse.ArgumentTypeError(
                    f"MPS thread shares {text!r}: STAGE=PERCENT (1-100) joined by ':', e.g. "
                    "reasoning=60:vocoder=40, or none"
                )
            shares.append((stage, int(value)))
        return cls(tuple(shares))

    def __str__(self) -> str:
        return "sm " + (" ".join(f"{s} {v}" for s, v in self.shares) or "uncapped")


@dataclass(frozen=True)
class Variant:
    """What one run of a layout changes from its file; None: as the file says."""

    vocoders: Vocoders | None = None
    sharing: str | None = None
    prepare_ms: int | None = None
    vocoder_dtype: str | None = None
    thread_shares: ThreadShares | None = None
    gateway_processes: int | None = None
    transport: str | None = None  # caller_load.TRANSPORTS; None: WebRTC, not in the key
    settings: tuple[tuple[str, Any], ...] = ()  # any other config key: --set KEY=V1,V2

    def key(self, layout: str) -> str:
        """The run's name in the results, e.g. "one 1x8 mps prepare 200 websocket"."""
        parts = (
            layout,
            self.vocoders,
            self.sharing,
            None if self.prepare_ms is None else f"prepare {self.prepare_ms}",
            None if self.vocoder_dtype is None else f"vocoder {self.vocoder_dtype}",
            self.thread_shares,
            None if self.gateway_processes is None else f"gw {self.gateway_processes}",
            self.transport,
            *(
                f"{k}={'+'.join(map(str, v)) if isinstance(v, tuple) else v}"
                for k, v in self.settings
            ),
        )
        return " ".join(str(part) for part in parts if part is not None)

    def overrides(self) -> tuple[dict[str, Any], list[str]]:
        """Config overrides, and a note on each for the results."""
        overrides: dict[str, Any] = {}
        if self.vocoders is not None:
            overrides["vocoder.replicas"] = self.vocoders.replicas
            overrides["vocoder.batch"] = self.vocoders.batch
        if self.sharing is not None:
            overrides["gpu_sharing"] = self.sharing
        if self.prepare_ms is not None:
            overrides["gateway.turns.prepare_reply_ms"] = self.prepare_ms
        if self.vocoder_dtype is not None:
            overrides["vocoder.options.dtype"] = self.vocoder_dtype
        if self.thread_shares is not None:
            overrides["experiments.mps_thread_percent"] = dict(self.thread_shares.shares)
        if self.gateway_processes is not None:
            overrides["gateway.processes"] = self.gateway_processes
        overrides |= setting_overrides(self.settings)
        notes = [f"{k}: {v} (from the command line)" for k, v in overrides.items()]
        return overrides, notes


def layout_config(
    name: str,
    models: Any,
    gpu_count: int,
    device: str,
    variant: Variant = Variant(),
    trace_dir: str | None = None,
) -> tuple[Any, list[str]]:
    """The layout's configuration with the built models' folders; notes on what was changed.
    `trace_dir`: where the gateway processes trace the stage records they receive, when there
    are several (one is tapped in place)."""
    from gateway.config import GatewayConfig, load_config

    talker = name in TALKER_LAYOUTS
    overrides: dict[str, Any] = {
        "encoder.model": models.whisper,
        "reasoning.model": (
            models.ultravox
            if name in ULTRAVOX_LAYOUTS
            else models.omni
            if name in SPEECH_IN_LAYOUTS
            else models.chat
        ),
        "vocoder.model": models.talker if talker else models.speecht5,
        "vocoder.vocoder": models.snac if talker else models.hifigan,
        "gateway.port": 0,
    }
    if "auth" in GatewayConfig.model_fields:  # callers on 127.0.0.1 carry no API key
        overrides["gateway.auth.enabled"] = False
    chosen, notes = variant.overrides()
    if name == "tp2" and gpu_count == 2:
        overrides["encoder.gpus"] = overrides["vocoder.gpus"] = [1]
        notes.append("only 2 GPUs: encoder and vocoder share GPU 1 with vLLM's second shard")
    if device == "cpu":  # trying the script without a GPU: the CPU build of vLLM, tiny models
        for stage in ("encoder", "vocoder"):
            overrides |= {f"{stage}.device": "cpu", f"{stage}.gpus": None}
            overrides[f"{stage}.gpu_memory_fraction"] = None
        overrides["encoder.options"] = {"max_new_tokens": 8}
        overrides["vocoder.options"] = (
            {
                "max_frames_per_char": 0.8,
                "engine_args": {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 1024},
            }
            if talker
            else {"maxlenratio": 4.0}
        )
        overrides["reasoning.gpus"] = None
        overrides["reasoning.engine_args"] = {
            "enforce_eager": True,
            "max_model_len": 1024,
            "max_num_seqs": 32,
            "kv_cache_memory_bytes": 256 << 20,
        }
        notes.append("CPU try-out: every stage on the CPU, tiny models")
    overrides |= LAYOUT_SETTINGS.get(name, {})
    overrides |= chosen  # after the try-out's options, which replace the file's whole dicts
    config = load_config(CONFIGS / LAYOUT_CONFIGS[name], overrides)
    if trace_dir is not None and config.gateway.processes > 1:  # the file's, --set's or a variant's
        gateway = config.gateway.model_copy(update={"trace_dir": trace_dir})
        config = config.model_copy(update={"gateway": gateway})
    return config, notes


#: stand-ins for the models' folders, to check layouts and variants before anything is built
PLACEHOLDER_MODELS = SimpleNamespace(
    whisper="w", chat="c", speecht5="t", hifigan="h", talker="o", snac="s", omni="m", ultravox="u"
)


def build_models(root: Path, device: str, preset: str, layouts: Sequence[str] = ()) -> Any:
    """The layouts' models (loadtest.gpu_models), built once under `root` in a process of
    its own: CUDA memory the build used (27 GiB for the 7B model) is given back with it
    instead of staying on GPU 0 beside the stages for the whole run. Ultravox's only when
    one of `layouts` needs it."""
    from loadtest.gpu_models import ensure_models

    ultravox = any(name in ULTRAVOX_LAYOUTS for name in layouts)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(ensure_models, root, device, preset, ultravox).result()
