"""The stages' own account of a GPU run, from its log: what each stage logged every 10 s,
gathered by variant and load.

    python -m loadtest.stage_log RUN_LOG [--json]

`loadtest.gpu_run`'s log (run.log on the GPU machine, see docs/gpu.md) interleaves its own
lines (`[12:00:00] layout one ...`, `[12:00:05] 8 caller(s), 10 turns each`, `[12:00:40] 8
callers: {...}`) with the stages' (`2026-12-01 12:00:10,123 reasoning[42] INFO ...`). A stage's
line belongs to the load during which it was written; it covers the 10 s before it, so the
first line of a load may hold a few seconds of the one before. For each variant and load this
prints, over its lines: vLLM's step times (p99 range, decoding only and finishing a prefill),
each hop of a cancel in the reasoning stage (p99 range and max), how the aborts' freed blocks
were seen, how the replies made at the caller's pause ended, the vocoder's passes and its first
audio after the first phrase, and Whisper's passes. The line formats are those of
stages/passlog.py, stages/backends/llm_vllm.py and stages/reasoning.py;
tests/loadtest/test_stage_log.py makes them with those classes.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stages.passlog import CancelHops

_NUM = r"([0-9.]+)"
_OWN = re.compile(r"^\[(\d\d):(\d\d):(\d\d)\] (.*)$")
_STAGE = re.compile(r"^\d{4}-\d\d-\d\d (\d\d):(\d\d):(\d\d),\d+ ([\w.]+)\[\d+\] \w+ (.*)$")
_VARIANT = re.compile(r"^layout (.+): \S+\.yaml$")
_LOAD = re.compile(r"^(\d+) caller\(s\)(?: over (\w+))?, \d+ turns each$")
_ITL = re.compile(r"^inter-token latency, (\d+) replies at once$")
_LOAD_END = re.compile(r"^(\d+) (callers|replies): ")
# loadtest.turn_taking's: "POLICY:CLASSIFIER / TURN DETECTION: 8 caller(s), 27 clips each"
_TURNS = re.compile(r"^(\S+ / \w+): (\d+) caller\(s\), \d+ clips each$")
_TURNS_END = re.compile(r"^\S+ / \w+ \d+ callers: ")
_STEPS = re.compile(
    rf"^vLLM steps in \d+ s, record to record: decoding only (\d+)(?:, p50 {_NUM} ms, "
    rf"p99 {_NUM} ms, max {_NUM} ms)?; finishing a prefill(?: \((\d+) prompt tokens a step\))? "
    rf"(\d+)(?:, p50 {_NUM} ms, p99 {_NUM} ms, max {_NUM} ms)?"
    rf"(?:; KV cache held p50 {_NUM}%, p99 {_NUM}%, max {_NUM}%)?$"
)
_LATENCY = re.compile(
    rf"^(.+): (\d+) in \d+ s, p50 {_NUM} ms, p95 {_NUM} ms, p99 {_NUM} ms, max {_NUM} ms$"
)
# a CountLog's line: how often each outcome came (vLLM's aborts, replies made at the pause)
_COUNTS = re.compile(r"^(.+) in \d+ s, ([^:]+): ((?:[\w ]+ \d+)(?:, [\w ]+ \d+)*)$")
_PASSES = re.compile(
    rf"^(vocoder|whisper|audio tower): (\d+) passes in \d+ s, {_NUM} \w+ a pass, {_NUM} ms a pass "
    rf"\(max {_NUM}\)"
)


@dataclass
class Spread:
    """One figure over a load's lines: how many events, and the range of its percentiles."""

    events: int = 0
    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)
    max: float = 0.0

    def add(self, events: int, p50: float, p99: float, top: float) -> None:
        self.events += events
        self.p50.append(p50)
        self.p99.append(p99)
        self.max = max(self.max, top)

    def report(self) -> dict[str, Any]:
        if not self.p99:
            return {"events": self.events}
        return {
            "events": self.events,
            "p50_ms": [min(self.p50), max(self.p50)],
            "p99_ms": [min(self.p99), max(self.p99)],
            "max_ms": self.max,
        }


@dataclass
class Load:
    """Everything the stages logged during one load of one variant."""

    spreads: dict[str, Spread] = field(default_factory=lambda: collections.defaultdict(Spread))
    counts: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    passes: dict[str, list[tuple[int, float, float]]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )

    def take(self, stage: str, text: str) -> None:
        if m := _STEPS.match(text):
            if m[2] is not None:
                self.spreads["vLLM step, decoding only"].add(
                    int(m[1]), float(m[2]), float(m[3]), float(m[4])
                )
            if m[8] is not None:
                self.spreads["vLLM step, finishing a prefill"].add(
                    int(m[6]), float(m[7]), float(m[8]), float(m[9])
                )
            if m[10] is not None:  # percent, over the busy steps
                steps = int(m[1]) + int(m[6])
                self.spreads["vLLM KV cache held, %"].add(
                    steps, float(m[10]), float(m[11]), float(m[12])
                )
        elif m := _COUNTS.match(text):
            for part in m[3].split(", "):
                outcome, _, count = part.rpartition(" ")
                self.counts[f"{m[1]}, {m[2]}"][outcome] += int(count)
        elif m := _PASSES.match(text):
            self.passes[m[1]].append((int(m[2]), float(m[3]), float(m[4])))
        elif m := _LATENCY.match(text):
            what = m[1].removeprefix(f"{stage.partition('.')[0]}: ")  # vocoder.1: a replica
            self.spreads[what].add(int(m[2]), float(m[3]), float(m[5]), float(m[6]))

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {what: s.report() for what, s in sorted(self.spreads.items())}
        for what, counts in sorted(self.counts.items()):
            out[what] = dict(sorted(counts.items()))
        for stage, lines in sorted(self.passes.items()):
            count = sum(n for n, _, _ in lines)
            out[f"{stage} passes"] = {
                "passes": count,
                "items_a_pass": round(sum(n * items for n, items, _ in lines) / count, 2),
                "ms_a_pass": round(sum(n * ms for n, _, ms in lines) / count, 1),
            }
        return out


def gather(lines: Iterable[str]) -> dict[str, dict[str, Load]]:
    """{variant: {load: Load}} from a gpu_run log, the load "8 callers" or "itl 8"; or from
    a turn_taking log, the variant "provisional:webrtc / semantic_vad"."""
    runs: dict[str, dict[str, Load]] = {}
    variant, load = "", None
    for line in lines:
        line = line.rstrip("\n")
        if m := _OWN.match(line):
            text = m[4]
            if v := _VARIANT.match(text):
                variant, load = v[1], None
            elif c := _LOAD.match(text):
                over = f" over {c[2]}" if c[2] else ""  # the callers' transport, where named
                load = runs.setdefault(variant, {}).setdefault(f"{c[1]} callers{over}", Load())
            elif i := _ITL.match(text):
                load = runs.setdefault(variant, {}).setdefault(f"itl {i[1]}", Load())
            elif t := _TURNS.match(text):
                load = runs.setdefault(t[1], {}).setdefault(f"{t[2]} callers", Load())
            elif _LOAD_END.match(text) or _TURNS_END.match(text):
                load = None
        elif (m := _STAGE.match(line)) and load is not None:
            load.take(m[4], m[5])
    return runs


def report(path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """{variant: {load: figures}} of the log at `path`."""
    with path.open(errors="replace") as lines:
        runs = gather(lines)
    return {v: {load: f.report() for load, f in loads.items()} for v, loads in runs.items()}


def _range(values: list[float] | None) -> str:
    if not values:
        return ""
    low, high = values
    return f"{low:.1f}" if low == high else f"{low:.1f}-{high:.1f}"


def table(report: dict[str, dict[str, dict[str, Any]]]) -> str:
    head = (
        "| variant | load | vLLM step p99: decoding only / finishing a prefill | cancel hop p99:"
        " pushed to read / to abort sent / to freed blocks seen | aborts seen: first step /"
        " later step / hidden | vocoder first audio p99: at the pause / other | vocoder"
        " replies a pass, ms a pass |"
    )
    rows = [head, "|---|---|---|---|---|---|---|"]
    hops = [log.what for log in CancelHops().logs]
    audio = (
        "first audio after the first phrase, replies made at the pause",
        "first audio after the first phrase, other replies",
    )
    for variant, loads in report.items():
        for load, f in loads.items():

            def p99(what: str, f: dict[str, Any] = f) -> str:
                return _range(f.get(what, {}).get("p99_ms"))

            steps = f"{p99('vLLM step, decoding only')} / {p99('vLLM step, finishing a prefill')}"
            aborts = f.get("vLLM aborts, how their freed blocks were seen", {})
            seen = " / ".join(
                str(aborts.get(k, 0)) for k in ("freed_first_step", "freed_later_step", "hidden")
            )
            vocoder = f.get("vocoder passes")
            passes = f"{vocoder['items_a_pass']}, {vocoder['ms_a_pass']}" if vocoder else ""
            rows.append(
                f"| {variant} | {load} | {steps} | {' / '.join(p99(h) for h in hops)} | {seen} "
                f"| {' / '.join(p99(a) for a in audio)} | {passes} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="loadtest.gpu_run's log (run.log)")
    parser.add_argument("--json", action="store_true", help="print the JSON only")
    args = parser.parse_args()
    if not args.log.is_file():
        parser.error(f"no such log file: {args.log}")
    figures = report(args.log)
    if not figures:
        parser.error(f"{args.log}: no load of loadtest.gpu_run found in it")
    print(json.dumps(figures, indent=1))
    if not args.json:
        print(table(figures))


if __name__ == "__main__":
    main()
