"""The ring benchmark, run small: every round's samples counted, and bad arguments refused."""

from __future__ import annotations

import json

import pytest

from loadtest.ring_bench import main


@pytest.mark.timeout(120)
def test_rounds_share_the_samples_and_are_pooled(tmp_path, capsys) -> None:
    out = tmp_path / "ring.json"
    args = ["--latency-count", "41", "--throughput-count", "300", "--rounds", "2"]
    assert main([*args, "--transports", "omni_ring", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {r["payload_bytes"] for r in report["results"]} == {6400, 16}
    for result in report["results"]:
        latency = result["latency_us"]
        assert latency["samples"] == 41 and len(latency["p99_by_round"]) == 2
        assert 0 < latency["p50"] <= latency["p99"] <= latency["max"]
        assert result["records_per_s"] > 0
    assert "6400-byte records" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rounds", "0"], "--rounds must be between 1"),
        (["--transports", "omni_ring,carrier_pigeon"], "unknown transports"),
    ],
)
def test_bad_arguments_are_named(args, message, capsys) -> None:
    with pytest.raises(SystemExit):
        main(args)
    assert message in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_crossing_link_is_measured_ring_to_ring_through_the_bridges(tmp_path) -> None:
    out = tmp_path / "crossing.json"
    args = ["--latency-count", "41", "--throughput-count", "300", "--rounds", "1"]
    assert main([*args, "--transports", "zmq_tcp,omni_bridged", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert {(r["transport"], r["payload_bytes"]) for r in results} == {
        (t, size) for t in ("zmq_tcp", "omni_bridged") for size in (6400, 16)
    }
    for result in results:
        assert result["latency_us"]["samples"] == 41 and result["records_per_s"] > 0
