"""Which GPUs each stage process sees, checked against the machine before anything starts.

A deployment sizes hardware per stage: the reasoning LLM tensor-parallel over some GPUs, the
encoder and the vocoder on another, or everything on one. The configuration names them per
stage (`gpus`, indices of the GPUs the supervisor sees); `plan()` checks the layout against the
GPUs present and gives each stage process its environment: CUDA_VISIBLE_DEVICES set to its
GPUs, and NVLink multicast off in it and in every process it starts (vLLM's engine core and
tensor-parallel workers inherit it).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stages.config import PipelineConfig

#: Set in every stage process: a program using NVLink multicast (NVLS) can put a shared host's
#: GPUs out of service, so it stays off in NCCL, PyTorch's symmetric memory and NVSHMEM; and
#: vLLM's tensor-parallel all-reduce paths that assume it stay off too (FlashInfer's "mnnvl"
#: backend, auto-selected on one node, hung and then faulted in vLLM 0.26 with multicast off;
#: "trtllm" uses plain CUDA IPC buffers).
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
    "VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm",
}
#: The talker voice's vLLM engine, in the vocoder's share of a GPU (stages.backends.tts_talker).
TALKER_ENGINE = "vocoder's talker engine"
#: vLLM's default gpu_memory_utilization; too much when another stage shares its GPU.
VLLM_DEFAULT_MEMORY_UTILIZATION = 0.9


#: A GPU's total memory in bytes, by the supervisor's index of it and its environment; None
#: where it cannot be read.
GpuMemory = Callable[[int, Mapping[str, str]], "int | None"]


class PlacementError(ValueError):
    """A layout the GPUs present cannot run; the message names the stage and the GPUs."""


@dataclass(frozen=True)
class StagePlacement:
    stage: str
    gpus: tuple[int, ...] | None  # indices of the GPUs the supervisor sees; None: all of them
    env: dict[str, str]  # set in the stage's process before anything else runs

    def describe(self) -> str:
        where = "all GPUs" if self.gpus is None else f"GPUs {list(self.gpus)}"
        visible = self.env.get("CUDA_VISIBLE_DEVICES")
        return f"{self.stage}: {where} (CUDA_VISIBLE_DEVICES={visible})"


def wants_gpus(config: PipelineConfig) -> bool:
    """True when the configuration places any stage on a GPU explicitly."""
    torch_stages = (config.encoder, config.vocoder)
    return (
        any(s.cuda_index is not None or s.gpus for s in torch_stages)
        or bool(config.reasoning.gpus)
        or config.reasoning.parallel_size > 1
    )


def count_gpus() -> int:
    """CUDA GPUs this process sees (its CUDA_VISIBLE_DEVICES applied); 0 without torch/CUDA."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_memory(gpu: int, environ: Mapping[str, str]) -> int | None:
    """GPU `gpu`'s total memory, from nvidia-smi: the supervisor opens no CUDA context of its
    own, which would hold memory on the GPU for as long as it runs. nvidia-smi numbers GPUs in
    bus order and CUDA fastest first: on a host whose GPUs differ in size, set
    CUDA_DEVICE_ORDER=PCI_BUS_ID so that the two agree."""
    ids = _visible_ids(environ)
    ident = ids[gpu] if ids is not None and gpu < len(ids) else str(gpu)
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run([*query, "-i", ident], capture_output=True, text=True, timeout=10)
        return int(float(done.stdout.split()[0]) * 2**20) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def plan(
    config: PipelineConfig,
    gpu_count: int | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    count: Callable[[], int] = count_gpus,
    memory: GpuMemory = gpu_memory,
) -> dict[str, StagePlacement]:
    """Each stage's GPUs and environment, or PlacementError for a layout that cannot run here.

    `gpu_count`: GPUs the supervisor sees (counted with `count` when the config asks for GPUs
    and it is not given). `environ`: the supervisor's environment, whose CUDA_VISIBLE_DEVICES
    (when set) maps our indices to the ids the driver knows. `memory`: a shared GPU's size,
    asked for only where a vLLM engine on it sizes its KV cache in bytes.
    """
    environ = os.environ if environ is None else environ
    if gpu_count is None and wants_gpus(config):
        gpu_count = count()
    parent_ids = _visible_ids(environ)
    layout = {
        "encoder": config.encoder.gpus,
        "reasoning": config.reasoning.gpus,
        "vocoder": config.vocoder.gpus,
    }
    if gpu_count is not None:
        _check_layout(config, gpu_count, environ, memory)
    placements = {}
    for stage, gpus in layout.items():
        env = dict(MULTICAST_OFF)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(
                parent_ids[g] if parent_ids is not None else str(g) for g in gpus
            )
        placements[stage] = StagePlacement(stage, None if gpus is None else tuple(gpus), env)
    return placements


def _visible_ids(environ: Mapping[str, str]) -> list[str] | None:
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [part.strip() for part in value.split(",") if part.strip()]


def engine_bytes(model: str | None, engine_args: Mapping[str, Any], parallel: int = 1) -> int:
    """The least a vLLM engine that sizes its KV cache in bytes (`kv_cache_memory_bytes`)
    holds on each of its GPUs: that cache and its part of the weights, as they lie in `model`
    where it is a local folder (a hub id's are not known before they are fetched). vLLM then
    sizes the cache from the bytes and not from gpu_memory_utilization. 0: not sized so."""
    kv = engine_args.get("kv_cache_memory_bytes")
    if kv is None:
        return 0
    weights = 0
    folder = Path(model) if model else None
    if folder is not None and folder.is_dir():
        for pattern in ("*.safetensors", "*.bin", "*.pt"):
            if files := list(folder.glob(pattern)):
                weights = sum(f.stat().st_size for f in files)
                break
    return int(kv) + weights // parallel


def _check_layout(
    config: PipelineConfig, gpu_count: int, environ: Mapping[str, str], memory: GpuMemory
) -> None:
    seen = f"{gpu_count} GPU(s) visible here"
    if "CUDA_VISIBLE_DEVICES" in environ:
        seen += f" (CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r})"
    # GPU -> stage -> (its memory share per process, its processes)
    used: dict[int, dict[str, tuple[float | None, int]]] = {}
    held: dict[str, int] = {}  # vLLM engine -> bytes it holds whatever its share (engine_bytes)
    for stage, cfg in (("encoder", config.encoder), ("vocoder", config.vocoder)):
        if cfg.cuda_index is None:
            continue
        if gpu_count == 0:
            raise PlacementError(f"{stage}.device is {cfg.device!r} but there is no GPU: {seen}")
        gpu = cfg.gpus[cfg.cuda_index] if cfg.gpus is not None else cfg.cuda_index
        if gpu >= gpu_count:
            raise PlacementError(f"{stage} is placed on GPU {gpu} but there are {seen}")
        processes = config.vocoder.replicas if stage == "vocoder" else 1
        used.setdefault(gpu, {})[stage] = (cfg.gpu_memory_fraction, processes)
        if stage == "vocoder" and config.vocoder.backend == "talker":
            # the talker's vLLM engine core: a process of the stage's own, with its own share
            engine_args = config.vocoder.options.get("engine_args") or {}
            share = engine_args.get("gpu_memory_utilization")
            if share is None:
                raise PlacementError(
                    f"the vocoder's talker runs vLLM on GPU {gpu}: set "
                    "vocoder.options.engine_args.gpu_memory_utilization (vLLM's default "
                    f"{VLLM_DEFAULT_MEMORY_UTILIZATION} leaves the other stages too little)"
                )
            used[gpu][TALKER_ENGINE] = (share, processes)
            held[TALKER_ENGINE] = engine_bytes(config.vocoder.model, engine_args)
    reasoning = config.reasoning
    if gpu_count == 0:
        if reasoning.gpus or reasoning.parallel_size > 1:
            raise PlacementError(
                f"reasoning needs {reasoning.parallel_size} GPU(s) "
                f"(tensor_parallel_size x pipeline_parallel_size) but there is no GPU: {seen}"
            )
        return  # the CPU build of vLLM
    gpus = reasoning.gpus if reasoning.gpus is not None else list(range(reasoning.parallel_size))
    if missing := [g for g in gpus if g >= gpu_count]:
        raise PlacementError(
            f"reasoning is placed on GPUs {gpus} (tensor_parallel_size x pipeline_parallel_size"
            f" = {reasoning.parallel_size}) but there are {seen}: no GPU {missing}"
        )
    share = reasoning.engine_args.get("gpu_memory_utilization")
    held["reasoning"] = engine_bytes(
        reasoning.model, reasoning.engine_args, reasoning.parallel_size
    )
    for gpu in gpus:
        used.setdefault(gpu, {})["reasoning"] = (share, reasoning.replicas)
    for gpu, stages in sorted(used.items()):
        if "reasoning" not in stages or (len(stages) == 1 and reasoning.replicas == 1):
            continue
        others = ", ".join(s for s in stages if s != "reasoning")
        if reasoning.replicas > 1:
            others = ", ".join(filter(None, (f"{reasoning.replicas - 1} more engine(s)", others)))
        if share is None:
            raise PlacementError(
                f"reasoning shares GPU {gpu} with {others}: set "
                "reasoning.engine_args.gpu_memory_utilization (vLLM's default "
                f"{VLLM_DEFAULT_MEMORY_UTILIZATION} leaves them too little)"
            )
        shares = {s: (v, n) for s, (v, n) in stages.items() if v is not None}
        why = []
        sized = {s: held[s] for s in shares if held.get(s)}
        total = memory(gpu, environ) if sized else None
        for s, nbytes in sized.items():
            if total and nbytes / total > shares[s][0]:
                shares[s] = (round(nbytes / total, 2), shares[s][1])
                why.append(f"{s} holds {_gib(nbytes)} an engine")
        if sum(v * n for v, n in shares.values()) > 1.0:  # each replica takes its own share
            parts = " + ".join(
                f"{s} {v}" if n == 1 else f"{s} {n} x {v}" for s, (v, n) in shares.items()
            )
            of = (
                f" (of the GPU's {_gib(total)}, " + ", ".join(why) + ": its KV cache, "
                "kv_cache_memory_bytes, and its weights; vLLM sizes that cache whatever "
                "gpu_memory_utilization says)"
                if why and total
                else ""
            )
            raise PlacementError(f"GPU {gpu} is given out beyond its memory: {parts} > 1.0{of}")


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def apply_memory_share(device: str, fraction: float | None) -> None:
    """In a torch stage's process: cap its share of the GPU's memory (torch's allocator)."""
    if fraction is None or not device.startswith("cuda"):
        return
    import torch

    torch.cuda.set_per_process_memory_fraction(fraction, torch.device(device).index or 0)


def visible_report() -> dict[str, object]:
    """What a stage process sees, for its ready report: its CUDA_VISIBLE_DEVICES and, where
    torch is loaded with CUDA, the GPU count and names torch sees."""
    import sys

    report: dict[str, object] = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "multicast_off": all(os.environ.get(k) == v for k, v in MULTICAST_OFF.items()),
    }
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        report["gpus_seen"] = torch.cuda.device_count()
    return report
