"""The vocoder benchmark's two ways on the tiny SpeechT5: the same speech either way."""

from __future__ import annotations

import json

import pytest

from loadtest.vocoder_bench import main


@pytest.mark.timeout(180)
def test_both_ways_make_the_same_speech_and_report_it(tmp_path, capsys) -> None:
    args = ["--tiny", "--replies", "1,3", "--blocks", "3", "--models-root", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    results = json.loads(out.strip().splitlines()[-1])
    assert "| 3 |" in out and results["machine"]["device"] == "cpu"
    for n in ("1", "3"):
        alone, together = results["replies"][n]["one_at_a_time"], results["replies"][n]["together"]
        assert alone["rounds"] == together["rounds"] == 3
        assert alone["speech_s"] == together["speech_s"] > 0
