"""The idle-CPU benchmark's accounting (the benchmark itself runs the real service)."""

from __future__ import annotations

import os

import pytest

from loadtest.idle_cpu import (
    Sample,
    cpu_between,
    figures,
    main,
    parse_variant,
    read_tree,
    stage_pids,
    table,
)


def test_cpu_is_counted_per_process_name_and_a_new_process_from_zero() -> None:
    before = {1: Sample("gateway + supervisor", 10.0), 2: Sample("omni-reasoning", 5.0)}
    after = {
        1: Sample("gateway + supervisor", 10.2),
        2: Sample("omni-reasoning", 5.1),
        3: Sample("omni-reasoning", 0.05),  # started in between
        # a pid reused by another program in between starts from zero too
    }
    assert cpu_between(before, after) == pytest.approx(
        {"gateway + supervisor": 0.2, "omni-reasoning": 0.15}
    )
    reused = {2: Sample("sh", 0.01)}
    assert cpu_between(before, reused) == pytest.approx({"sh": 0.01})


def test_figures_are_shares_of_one_core_against_the_target() -> None:
    def at(gateway: float, engine: float) -> dict[int, Sample]:
        return {1: Sample("gateway + supervisor", gateway), 7: Sample("VLLM::EngineCore", engine)}

    # 3 s: the gateway uses 3 ms a second; the engine core 4 ms, all in the second second
    readings = [(0.0, at(0.0, 0.0)), (1.0, at(0.003, 0.0)), (2.0, at(0.006, 0.004))]
    readings.append((3.0, at(0.009, 0.004)))
    result = figures(readings)
    assert result["seconds"] == 3.0
    assert result["processes"]["gateway + supervisor"]["percent_of_a_core"] == pytest.approx(0.3)
    assert result["processes"]["VLLM::EngineCore"]["percent_of_a_core"] == pytest.approx(0.133)
    assert result["processes"]["VLLM::EngineCore"]["busiest_second_percent"] == pytest.approx(0.4)
    assert result["total_percent_of_a_core"] == pytest.approx(0.433)
    assert result["without_vllm_processes_percent"] == pytest.approx(0.3)
    assert result["one_second_windows_percent"]["max"] == pytest.approx(0.7)
    assert result["target_met"] is True
    busy = figures([(0.0, at(0.0, 0.0)), (2.0, at(0.0, 0.03))])
    assert busy["target_met"] is False
    assert "1.5" in table(busy) and "NOT met" in table(busy)


def test_the_tree_read_is_this_process_and_its_children() -> None:
    tree = read_tree(os.getpid())
    assert tree[os.getpid()].name == "gateway + supervisor"  # the root is named as the service
    assert tree[os.getpid()].cpu_s > 0
    assert read_tree(2**22 + 1) == {}  # no such process: nothing, not an error


def test_stage_processes_are_named_from_the_supervisors_log() -> None:
    log = [
        "omni-gateway: encoder ready in 2.1 s (pid=101, backend=whisper, cuda_visible_devices=0)",
        "omni-gateway: vocoder.1 ready in 12.0 s (pid=103, backend=speecht5, sample_rate=16000)",
        "omni-gateway: all stages ready",
    ]
    assert stage_pids(log) == {101: "stage encoder", 103: "stage vocoder.1"}
    assert read_tree(os.getpid(), {os.getpid(): "ignored"})[os.getpid()].name == (
        "gateway + supervisor"
    )


def test_bad_arguments_are_named(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--config", str(tmp_path / "none.yaml")])
    assert "none.yaml: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--seconds", "1"])
    assert "--seconds 1: must be 2..3600" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--variant", "no-assignment"])
    assert "--variant 'no-assignment': expected NAME:VAR=VALUE" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--variant", "default:A=1"])
    assert "the name 'default' is the run without variables" in capsys.readouterr().err


def test_a_variant_is_a_name_and_the_variables_it_sets() -> None:
    assert parse_variant("gloo-per-group:OMNI_GATEWAY_SHARED_GLOO=0") == (
        "gloo-per-group",
        {"OMNI_GATEWAY_SHARED_GLOO": "0"},
    )
    assert parse_variant("two:A=1,B=x=y") == ("two", {"A": "1", "B": "x=y"})
    with pytest.raises(ValueError, match="'1A=2' is not VAR=VALUE"):
        parse_variant("bad:1A=2")
    with pytest.raises(ValueError, match="expected NAME:VAR=VALUE"):
        parse_variant(":A=1")
