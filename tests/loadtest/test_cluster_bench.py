"""loadtest.cluster_bench's table and its refusals (the benchmark itself starts two pipelines a
round: tests/stages/test_cluster.py runs the hop layout's placement end to end)."""

from __future__ import annotations

import pytest

from loadtest.cluster_bench import STAGES, TURN_HOPS, main, summary, table


def test_the_table_has_a_row_per_hop_and_stage_and_a_column_per_layout() -> None:
    ring = {
        "turn_hops_ms": {h: summary([10.0, 20.0]) for h in TURN_HOPS},
        "cancel_ms": {s: summary([1.0, 3.0]) for s in (*STAGES, "last")},
    }
    hop = {
        "turn_hops_ms": {h: summary([]) for h in TURN_HOPS},
        "cancel_ms": {s: summary([2.0]) for s in (*STAGES, "last")},
    }
    lines = table({"ring": ring, "hop": hop}).splitlines()
    assert lines[0] == "| ms, p50 / p99 | ring | hop |"
    assert len(lines) == 2 + len(TURN_HOPS) + len(STAGES) + 1
    assert lines[2] == f"| turn: {TURN_HOPS[0]} | 15.0 / 19.9 | - / - |"
    assert lines[-1] == "| cancel to ack: last | 2.0 / 2.98 | 2.0 / 2.0 |"


@pytest.mark.parametrize(
    "args, message",
    [(["--layouts", "ring,mesh"], "--layouts"), (["--rounds", "0"], "at least 1")],
)
def test_bad_arguments_are_named(args, message, capsys) -> None:
    with pytest.raises(SystemExit):
        main(args)
    assert message in capsys.readouterr().err
