"""Idle CPU: `omni-gateway start` left running with no calls, as a user leaves it.

    python -m loadtest.idle_cpu [--config configs/offline.yaml] [--settle 20] [--seconds 60]
                                [--variant NAME:VAR=VALUE ...] [--out DIR]

DESIGN.md's target: under 1% of a core with zero sessions. The service is started as a user
starts it (loadtest.service), and once it serves and `--settle` seconds more have passed
(start-up work: vLLM's warm-up, the first garbage collections), the CPU time of each of its
processes (the gateway and supervisor, the stage processes and what they start, such as
vLLM's engine core) is read every second for `--seconds`. Printed per process and in all, as
JSON and a table; with `--out`, results.json and table.md there too.

Each `--variant` runs the service once more in the same command with an environment variable
set, for an A/B in one sitting: `--variant gloo-per-group:OMNI_GATEWAY_SHARED_GLOO=0` measures
vLLM's engine with a gloo device per process group (stages/backends/gloo_device.py) beside the
default, which shares one.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.bench import describe_machine, log
from loadtest.service import ROOT, Service

TARGET_PERCENT = 1.0  # of one core, DESIGN.md
VLLM_PREFIX = "VLLM::"  # vLLM names its engine-core and worker processes so


@dataclass(frozen=True)
class Sample:
    """One process's name and CPU seconds (user + system) at one moment."""

    name: str
    cpu_s: float


def stage_pids(log_lines: list[str]) -> dict[int, str]:
    """The stage of each pid, from the supervisor's `STAGE ready in ... (pid=N, ...)` lines."""
    found = (re.search(r"(\S+) ready in [0-9.]+ s \(pid=(\d+)", line) for line in log_lines)
    return {int(m[2]): f"stage {m[1]}" for m in found if m}


def read_tree(root_pid: int, names: dict[int, str] | None = None) -> dict[int, Sample]:
    """Every process of the service now: the one started and all its descendants, named
    from `names` (pid -> name) where given, else by the name the process gave itself."""
    import psutil

    names = names or {}
    out: dict[int, Sample] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(root_pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                times = proc.cpu_times()
                name = "gateway + supervisor" if proc.pid == root_pid else names.get(proc.pid)
                if name is None:
                    cmdline = " ".join(proc.cmdline())
                    tracker = "resource_tracker" in cmdline  # multiprocessing's, for the stages
                    name = "multiprocessing resource tracker" if tracker else proc.name()
                out[proc.pid] = Sample(name, times.user + times.system)
    return out


def cpu_between(before: dict[int, Sample], after: dict[int, Sample]) -> dict[str, float]:
    """CPU seconds each process name used between two readings. A process that started in
    between counts from zero; one that ended in between is not seen at the end, and is left
    out (the idle service starts and ends none)."""
    used: dict[str, float] = {}
    for pid, sample in after.items():
        start = before[pid].cpu_s if pid in before and before[pid].name == sample.name else 0.0
        used[sample.name] = used.get(sample.name, 0.0) + max(sample.cpu_s - start, 0.0)
    return used


def figures(readings: list[tuple[float, dict[int, Sample]]]) -> dict[str, Any]:
    """Per process name and in all: % of one core over the whole window, and the busiest
    second; the spread of the one-second windows in all."""
    (t0, first), (t1, last) = readings[0], readings[-1]
    seconds = t1 - t0
    whole = cpu_between(first, last)
    per_second = [(cpu_between(a, b), tb - ta) for (ta, a), (tb, b) in itertools.pairwise(readings)]
    totals = [100 * sum(used.values()) / dt for used, dt in per_second]
    processes = {
        name: {
            "percent_of_a_core": round(100 * cpu / seconds, 3),
            "busiest_second_percent": round(
                max(100 * used.get(name, 0.0) / dt for used, dt in per_second), 2
            ),
            "processes": sum(1 for s in last.values() if s.name == name),
        }
        for name, cpu in sorted(whole.items(), key=lambda kv: -kv[1])
    }
    total = 100 * sum(whole.values()) / seconds
    vllm = 100 * sum(cpu for name, cpu in whole.items() if name.startswith(VLLM_PREFIX)) / seconds
    return {
        "seconds": round(seconds, 1),
        "processes": processes,
        "total_percent_of_a_core": round(total, 3),
        # the gateway and the stage processes, without the engine processes vLLM starts
        "without_vllm_processes_percent": round(total - vllm, 3),
        "one_second_windows_percent": {
            "p50": round(float(np.percentile(totals, 50)), 2),
            "p95": round(float(np.percentile(totals, 95)), 2),
            "max": round(max(totals), 2),
        },
        "target_percent": TARGET_PERCENT,
        "target_met": total < TARGET_PERCENT,
    }


def table(result: dict[str, Any]) -> str:
    rows = [
        "| process | count | % of a core | busiest second % |",
        "|---|---:|---:|---:|",
    ]
    for name, p in result["processes"].items():
        rows.append(
            f"| {name} | {p['processes']} | {p['percent_of_a_core']:.3f} "
            f"| {p['busiest_second_percent']:.2f} |"
        )
    w = result["one_second_windows_percent"]
    met = "met" if result["target_met"] else "NOT met"
    rows.append(
        f"| **all** | {sum(p['processes'] for p in result['processes'].values())} "
        f"| **{result['total_percent_of_a_core']:.3f}** | {w['max']:.2f} |"
    )
    rows.append(
        f"| all but vLLM's engine processes | | {result['without_vllm_processes_percent']:.3f} | |"
    )
    rows.append("")
    rows.append(
        f"{result['seconds']} s idle; one-second windows p50 {w['p50']} %, p95 {w['p95']} %, "
        f"max {w['max']} %; target under {result['target_percent']} % of a core: {met}"
    )
    return "\n".join(rows)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`NAME:VAR=VALUE[,VAR=VALUE...]` -> (NAME, {VAR: VALUE}); ValueError naming what is wrong."""
    name, sep, assignments = text.partition(":")
    if not sep or not name or not assignments:
        raise ValueError(f"{text!r}: expected NAME:VAR=VALUE[,VAR=VALUE...]")
    env: dict[str, str] = {}
    for item in assignments.split(","):
        var, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", var):
            raise ValueError(f"{text!r}: {item!r} is not VAR=VALUE")
        env[var] = value
    return name, env


def measure(
    config: Path, settle_s: float, seconds: int, env: dict[str, str] | None = None
) -> dict[str, Any]:
    with Service(config, echo=True, env=env) as service:
        url, gateways = service.started()
        names = stage_pids(service.seen)
        names |= {pid: name for name, pid in gateways.items() if name != "gateway"}  # gateway.N
        log(f"serving on {url}; settling for {settle_s:.0f} s")
        time.sleep(settle_s)  # a wait of a set length is what is measured, not a sync
        log(f"reading every process's CPU time each second for {seconds} s")
        readings = [(time.monotonic(), read_tree(service.proc.pid, names))]
        for _ in range(seconds):
            time.sleep(1.0)
            readings.append((time.monotonic(), read_tree(service.proc.pid, names)))
        if service.proc.poll() is not None:
            raise RuntimeError(f"the service ended while idle (exit {service.proc.returncode})")
        result = figures(readings)
        code = service.stop()
        if code != 0:
            raise RuntimeError(f"the service exited {code} on Ctrl-C")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "offline.yaml")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds after it serves")
    parser.add_argument("--seconds", type=int, default=60, help="seconds measured")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:VAR=VALUE",
        help="also run the service with these variables set (repeatable)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if not args.config.is_file():
        parser.error(f"--config {args.config}: no such file")
    if not 0 <= args.settle <= 600:
        parser.error(f"--settle {args.settle}: must be 0..600")
    if not 2 <= args.seconds <= 3600:
        parser.error(f"--seconds {args.seconds}: must be 2..3600")
    try:
        variants = dict(parse_variant(v) for v in args.variant)
    except ValueError as exc:
        parser.error(f"--variant {exc}")
    if "default" in variants:
        parser.error("--variant: the name 'default' is the run without variables")
    config = args.config.resolve()
    result: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m loadtest.idle_cpu " + " ".join(argv or sys.argv[1:]),
        "machine": describe_machine(),
        "config": str(config.relative_to(ROOT)) if config.is_relative_to(ROOT) else str(config),
        "settle_s": args.settle,
        **measure(config, args.settle, args.seconds),
    }
    texts = [table(result)]
    if variants:
        result["variants"] = {}
        for name, env in variants.items():
            log(f"variant {name}: {env}")
            figures_ = measure(config, args.settle, args.seconds, env)
            result["variants"][name] = {"env": env, **figures_}
            texts.append(f"variant {name} ({env}):\n\n{table(figures_)}")
    text = "\n\n".join(texts)
    print(json.dumps(result, indent=1))
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
