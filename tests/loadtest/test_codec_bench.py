"""The codec benchmark runs end to end on the CPU (eager only) and reports what it says."""

from __future__ import annotations

import json

import pytest

from loadtest.codec_bench import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_reports_a_pass_per_batch_size(tmp_path, capsys) -> None:
    assert (
        main(
            [
                "--device",
                "cpu",
                "--batches",
                "1,2",
                "--passes",
                "2",
                "--root",
                str(tmp_path),
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(report["results"]) == {"eager"}  # no CUDA graphs on a CPU
    for batch in ("1", "2"):
        figures = report["results"]["eager"][batch]
        assert figures["pass_ms"]["n"] == 2 and figures["pass_ms"]["p50"] > 0
        assert figures["audio_s_per_s"] > 0
    assert "| eager | 2 |" in (tmp_path / "out" / "table.md").read_text()
