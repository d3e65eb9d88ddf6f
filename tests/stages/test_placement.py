"""Per-stage GPU placement: the layout checks, each stage's environment, and that a stage
process really starts with it. No GPU needed: the GPU count is given to `plan()`."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config import load_config
from stages.config import PipelineConfig
from stages.placement import MULTICAST_OFF, PlacementError, apply_memory_share, plan, wants_gpus
from stages.rings import RingNames
from stages.stage_process import StageSpec, stage_main
from stages.supervisor import Supervisor

CONFIGS = Path(__file__).parents[2] / "configs"


def config(**stages: dict) -> PipelineConfig:
    return PipelineConfig.model_validate(stages)


def split_layout(tp: int = 2) -> PipelineConfig:
    """Reasoning tensor-parallel on GPUs 0..tp-1, encoder and vocoder together on GPU tp."""
    return config(
        encoder={"backend": "whisper", "model": "m", "device": "cuda", "gpus": [tp]},
        vocoder={"device": "cuda", "gpus": [tp]},
        reasoning={
            "gpus": list(range(tp)),
            "engine_args": {"tensor_parallel_size": tp, "gpu_memory_utilization": 0.8},
        },
    )


def test_cpu_config_needs_no_gpu_and_still_turns_multicast_off() -> None:
    cpu = load_config(CONFIGS / "tiny.yaml")
    assert not wants_gpus(cpu)
    placements = plan(cpu, count=lambda: pytest.fail("a CPU layout must not count GPUs"))
    for p in placements.values():
        assert p.gpus is None and "CUDA_VISIBLE_DEVICES" not in p.env
        assert p.env == MULTICAST_OFF


def test_split_layout_gives_each_stage_only_its_gpus() -> None:
    placements = plan(split_layout(), gpu_count=3, environ={})
    assert placements["reasoning"].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert placements["encoder"].env["CUDA_VISIBLE_DEVICES"] == "2"
    assert placements["vocoder"].env["CUDA_VISIBLE_DEVICES"] == "2"
    for p in placements.values():
        assert {k: p.env[k] for k in MULTICAST_OFF} == MULTICAST_OFF


def test_indices_are_of_the_gpus_the_supervisor_sees() -> None:
    """Under CUDA_VISIBLE_DEVICES=4,5,6 our GPU 0 is the driver's GPU 4."""
    placements = plan(split_layout(), gpu_count=3, environ={"CUDA_VISIBLE_DEVICES": "4,5,6"})
    assert placements["reasoning"].env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert placements["vocoder"].env["CUDA_VISIBLE_DEVICES"] == "6"


TALKER = {
    "backend": "talker",
    "model": "talker",
    "vocoder": "snac",
    "device": "cuda",
    "gpus": [0],
    "gpu_memory_fraction": 0.1,
}


def test_the_shipped_gpu_layouts_fit_one_h200() -> None:
    for name in ("gpu-one.yaml", "gpu-talker.yaml"):
        layout = load_config(CONFIGS / name)
        placements = plan(layout, gpu_count=1, environ={})
        assert {p.env["CUDA_VISIBLE_DEVICES"] for p in placements.values()} == {"0"}, name


def test_all_stages_on_one_gpu() -> None:
    one = config(
        encoder={"backend": "whisper", "model": "m", "device": "cuda", "gpus": [0]},
        vocoder={"device": "cuda", "gpus": [0], "gpu_memory_fraction": 0.1},
        reasoning={"gpus": [0], "engine_args": {"gpu_memory_utilization": 0.6}},
    )
    placements = plan(one, gpu_count=1, environ={})
    assert {p.env["CUDA_VISIBLE_DEVICES"] for p in placements.values()} == {"0"}


def test_the_gpus_present_are_counted_when_the_config_asks_for_gpus() -> None:
    with pytest.raises(PlacementError, match=r"encoder is placed on GPU 2 but there are 1 GPU"):
        plan(split_layout(), environ={}, count=lambda: 1)


@pytest.mark.parametrize(
    ("layout", "gpu_count", "message"),
    [
        (split_layout(), 2, r"encoder is placed on GPU 2 but there are 2 GPU\(s\) visible"),
        (
            config(reasoning={"gpus": [2, 3], "engine_args": {"tensor_parallel_size": 2}}),
            3,
            r"reasoning is placed on GPUs \[2, 3\].*3 GPU\(s\) visible here: no GPU \[3\]",
        ),
        (
            config(encoder={"backend": "whisper", "model": "m", "device": "cuda"}),
            0,
            r"encoder.device is 'cuda' but there is no GPU",
        ),
        (
            config(reasoning={"engine_args": {"tensor_parallel_size": 2}}),
            1,
            r"no GPU \[1\]",
        ),
        (
            config(reasoning={"engine_args": {"tensor_parallel_size": 2}}),
            0,
            r"reasoning needs 2 GPU\(s\).*no GPU",
        ),
        (
            config(vocoder={"device": "cuda", "gpus": [0]}, reasoning={"gpus": [0]}),
            1,
            r"reasoning shares GPU 0 with vocoder: set reasoning.engine_args"
            r".gpu_memory_utilization",
        ),
        (
            config(
                vocoder={"device": "cuda", "gpus": [0], "gpu_memory_fraction": 0.3},
                reasoning={"gpus": [0], "engine_args": {"gpu_memory_utilization": 0.8}},
            ),
            1,
            r"GPU 0 is given out beyond its memory: vocoder 0.3 \+ reasoning 0.8 > 1.0",
        ),
        (  # a talker's vLLM engine needs a share of its own
            config(
                vocoder=TALKER | {"options": {}},
                reasoning={"gpus": [0], "engine_args": {"gpu_memory_utilization": 0.5}},
            ),
            1,
            r"the vocoder's talker runs vLLM on GPU 0: set "
            r"vocoder.options.engine_args.gpu_memory_utilization",
        ),
        (  # ... counted with the others: 0.5 + 0.1 + 0.6 > 1
            config(
                vocoder=TALKER | {"options": {"engine_args": {"gpu_memory_utilization": 0.6}}},
                reasoning={"gpus": [0], "engine_args": {"gpu_memory_utilization": 0.5}},
            ),
            1,
            r"vocoder 0.1 \+ vocoder's talker engine 0.6 \+ reasoning 0.5 > 1.0",
        ),
        (  # each vocoder process takes its own share: 0.5 + 3 x 0.2 > 1
            config(
                vocoder={"device": "cuda", "gpus": [0], "gpu_memory_fraction": 0.2, "replicas": 3},
                reasoning={"gpus": [0], "engine_args": {"gpu_memory_utilization": 0.5}},
            ),
            1,
            r"GPU 0 is given out beyond its memory: vocoder 3 x 0.2 \+ reasoning 0.5 > 1.0",
        ),
        (  # and each reasoning replica its engine's: 2 x 0.6 > 1, with no other stage there
            config(reasoning={"replicas": 2, "engine_args": {"gpu_memory_utilization": 0.6}}),
            1,
            r"GPU 0 is given out beyond its memory: reasoning 2 x 0.6 > 1.0",
        ),
        (  # two engines on one GPU with vLLM's default share each
            config(reasoning={"replicas": 2}),
            1,
            r"reasoning shares GPU 0 with 1 more engine\(s\): set reasoning.engine_args",
        ),
    ],
)
def test_impossible_layouts_are_refused_naming_the_stage(
    layout: PipelineConfig, gpu_count: int, message: str
) -> None:
    with pytest.raises(PlacementError, match=message):
        plan(layout, gpu_count=gpu_count, environ={})


H100, H200 = int(79.18 * 2**30), int(139.8 * 2**30)  # total memory, as nvidia-smi gives it


def talker_layout(tmp_path: Path, replicas: int, share: float) -> PipelineConfig:
    """gpu-talker.yaml with `replicas` reasoning engines of `share` each, its models folders
    of weights of their real sizes (sparse files: nothing is written)."""
    layout = load_config(CONFIGS / "gpu-talker.yaml")
    for name, size in (("chat", 15_231_233_024), ("talker", 6_602_104_832)):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "model.safetensors", "wb") as weights:
            weights.truncate(size)
    reasoning = layout.reasoning.model_copy(
        update={
            "model": str(tmp_path / "chat"),
            "replicas": replicas,
            "engine_args": layout.reasoning.engine_args | {"gpu_memory_utilization": share},
        }
    )
    vocoder = layout.vocoder.model_copy(update={"model": str(tmp_path / "talker")})
    return layout.model_copy(update={"reasoning": reasoning, "vocoder": vocoder})


def test_engines_that_size_their_kv_cache_in_bytes_are_counted_by_what_they_hold(
    tmp_path: Path,
) -> None:
    """vLLM sizes a KV cache given in bytes (kv_cache_memory_bytes) from them, whatever
    gpu_memory_utilization says: on an H100 two of gpu-talker's engines took 29.7 GB each at
    0.3 and left the talker's engine no room. Counted by their cache and weights, they are
    refused before anything starts; one engine fits, and two fit an H200."""
    two = talker_layout(tmp_path, replicas=2, share=0.3)
    with pytest.raises(PlacementError) as refused:
        plan(two, gpu_count=1, environ={}, memory=lambda gpu, env: H100)
    assert "reasoning 2 x 0.38" in str(refused.value)
    assert "of the GPU's 79.2 GiB, reasoning holds 30.2 GiB an engine: its KV cache" in str(
        refused.value
    )
    plan(two, gpu_count=1, environ={}, memory=lambda gpu, env: H200)
    plan(two, gpu_count=1, environ={}, memory=lambda gpu, env: None)  # size unknown: shares
    one = load_config(CONFIGS / "gpu-talker.yaml")
    plan(one, gpu_count=1, environ={}, memory=lambda gpu, env: H100)
    asked: list[tuple[int, dict]] = []
    plan(split_layout(), gpu_count=3, environ={}, memory=lambda *a: asked.append(a) or H100)
    assert asked == []  # no engine sized in bytes: the GPU's size is not asked for


@pytest.mark.parametrize(
    ("stages", "message"),
    [
        ({"reasoning": {"gpus": [0], "engine_args": {"tensor_parallel_size": 2}}}, "needs"),
        ({"reasoning": {"engine_args": {"tensor_parallel_size": 0}}}, "int >= 1"),
        ({"vocoder": {"device": "cuda:1", "gpus": [3]}}, "past the 1 GPU"),
        ({"vocoder": {"device": "cpu", "gpus": [0]}}, "device is 'cpu'"),
        ({"vocoder": {"device": "cuda", "gpus": []}}, "gpus is \\[\\]"),
        ({"encoder": {"gpus": [1, 1], "device": "cuda"}}, "listed twice"),
        ({"encoder": {"device": "gpu0"}}, "use 'cpu', 'cuda' or 'cuda:N'"),
    ],
)
def test_layouts_wrong_on_any_machine_fail_validation(stages: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        config(**stages)


def test_supervisor_refuses_an_impossible_layout_before_starting_anything() -> None:
    layout = config(reasoning={"engine_args": {"tensor_parallel_size": 64}})
    sup = Supervisor(layout)
    with pytest.raises(PlacementError, match="reasoning"):
        sup.start()
    assert sup.rings is None and all(s.process is None for s in sup.stages.values())


@pytest.mark.timeout(60)
def test_a_stage_process_starts_with_its_environment() -> None:
    """stage_main applies the spec's environment before anything else: a stage that fails to
    start (here: no rings to attach to) reports the failure from inside that environment."""
    env = {"CUDA_VISIBLE_DEVICES": "", **MULTICAST_OFF, "OMNI_PLACEMENT_PROBE": "yes"}
    spec = StageSpec("encoder", RingNames("omni-test-placement-none"), {}, env=env)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_probe_stage, args=(spec, child))
    proc.start()
    child.close()
    assert parent.poll(50), "the stage process reported nothing"
    seen = parent.recv()
    proc.join(10)
    assert seen["env"] == env
    assert seen["status"] == "failed"


def _probe_stage(spec: StageSpec, conn) -> None:
    import os

    class Probe:  # what stage_main sends, plus the environment it ran in
        def send(self, message: tuple) -> None:
            conn.send({"status": message[0], "env": {k: os.environ.get(k) for k in spec.env}})

    with contextlib.suppress(SystemExit):
        stage_main(spec, Probe())


@pytest.mark.parametrize(("device", "index"), [("cuda", 0), ("cuda:1", 1)])
def test_memory_share_goes_to_the_stage_s_own_device(monkeypatch, device, index) -> None:
    """torch wants an indexed device: a bare 'cuda' (seen failing on the H200) is GPU 0."""
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *a: calls.append(a))
    apply_memory_share(device, 0.05)
    apply_memory_share("cpu", None)
    assert calls == [(0.05, index)]
