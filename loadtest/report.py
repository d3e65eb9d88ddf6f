"""The load report: conversing WebRTC callers against the gateway and the stages of
configs/tiny.yaml on 127.0.0.1, at several concurrencies in one run. (About 500 lines: the
run, its figures and their tables stay together, as one command prints them.)

    python -m loadtest.report [--loads 1,2,4,8,10] [--max-calls 8] [--turns 3] [--out DIR]
        [--config configs/tiny.yaml] [--set KEY=V1,V2 ...]

Callers (loadtest.conversation: real aiortc peers, real Opus, in processes of their own) speak
questions made by espeak-ng, wait for the agent, listen a moment and talk over it (every turn
after the first is a barge-in). A load above `--max-calls` (gateway.max_calls) has its extra
callers refused with 503. For each load it reports:
- turn latency (the caller's end of speech to the first agent audio it receives) p50/p95/p99,
  and the same split into hops from the ring records' CLOCK_MONOTONIC stamps (loadtest.latency);
- the pipeline overhead: the turn less the VAD silence window and the model time the stages
  timed on its path (final decode, first token, the first phrase's words, its first chunk),
  in all and by hop;
- barge-in latency at the client, and the server's cancel latency per stage;
- audio gaps both ways: intervals between frames the callers received, and between frames the
  gateway received from them (20 ms apart when nothing is lost; over 80 ms is a gap over 60 ms);
- sessions admitted and refused; CPU per admitted session of the gateway process and of each
  stage (the reasoning stage's with vLLM's engine-core process);
- RSS of every process and the shared memory in use, sampled each second over the whole run.
Writes results.json, table.md and latency.png under --out, and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.bench import describe_machine, log, summary
from loadtest.caller_load import run_callers
from loadtest.latency import HOPS, load_figures
from loadtest.settings import add_set_argument, setting_overrides
from loadtest.tap import calls_gone, tapped_gateway
from loadtest.voices import spoken

CONFIG = Path(__file__).parents[1] / "configs" / "tiny.yaml"
QUESTIONS = (
    "what is the weather like today",
    "tell me something nice about the sea",
    "can you book a table for two tonight",
)
FRAME_S = 0.02
GAP_INTERVAL_MS = 80.0  # a frame interval over this is an audio gap over 60 ms
SHM = Path("/dev/shm")


# -- the callers' voices -----------------------------------------------------------------


def spoken_questions(questions: tuple[str, ...] = QUESTIONS) -> list[np.ndarray]:
    """Each question spoken by espeak-ng, 48 kHz, leading silence cut (a clip's first frame
    is speech)."""
    return [spoken(text) for text in questions]


# -- analysis ----------------------------------------------------------------------------


def frame_intervals_ms(arrivals: list[float]) -> np.ndarray:
    """Intervals between consecutive frame arrivals (ms)."""
    return np.diff(np.asarray(arrivals, dtype=np.float64)) * 1000


def gap_figures(per_call_arrivals: list[list[float]]) -> dict[str, Any]:
    """Audio gaps over a load's calls: the worst frame interval of each call, and how many
    intervals exceed GAP_INTERVAL_MS (a gap of more than 60 ms in a 20 ms frame stream)."""
    worst, gaps, intervals = [], 0, 0
    for arrivals in per_call_arrivals:
        iv = frame_intervals_ms(arrivals)
        if not len(iv):
            continue
        worst.append(float(iv.max()))
        gaps += int((iv > GAP_INTERVAL_MS).sum())
        intervals += len(iv)
    return {
        "calls": len(worst),
        "worst_interval_ms": summary(worst, 50, 95),
        "intervals": intervals,
        "intervals_over_80ms": gaps,
        "share_over_80ms_pct": round(100 * gaps / intervals, 3) if intervals else None,
    }


def saturation(loads: dict[str, dict[str, Any]], factor: float = 2.0) -> int | None:
    """The first load whose turn p95 is over `factor` times the lightest load's, or that left
    a turn unanswered (refused callers aside): where the pipeline stops keeping up."""
    ordered = sorted(((int(n), f) for n, f in loads.items() if "turn_ms" in f), key=lambda x: x[0])
    if not ordered:
        return None
    base = ordered[0][1]["turn_ms"]["p95"]
    for n, f in ordered:
        p95 = f["turn_ms"]["p95"]
        if f["turns_answered"] < f["turns_asked"] or (base and p95 and p95 > factor * base):
            return n
    return None


def growth(samples: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """First, last and largest value of `key` (bytes) over the samples, in MiB, and the
    least-squares slope in MiB per minute: flat memory has a slope near 0."""
    points = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
    if len(points) < 2:
        return None
    t, v = np.array(points, dtype=np.float64).T
    slope = float(np.polyfit(t - t[0], v, 1)[0]) * 60 if np.ptp(t) > 0 else 0.0
    mib = 1 << 20
    return {
        "first_mib": round(v[0] / mib, 1),
        "last_mib": round(v[-1] / mib, 1),
        "max_mib": round(v.max() / mib, 1),
        "slope_mib_per_min": round(slope / mib, 2),
    }


# -- the processes -----------------------------------------------------------------------


@dataclass
class Processes:
    """The gateway (this process alone: the stages and the callers are its children) and the
    stage processes with their children (vLLM's engine core is the reasoning stage's)."""

    pids: dict[str, int]
    alone: frozenset[str] = frozenset({"gateway"})
    _procs: dict[str, Any] = field(default_factory=dict)

    def _tree(self, name: str) -> list[Any]:
        import psutil

        proc = self._procs.get(name)
        if proc is None or not proc.is_running():
            proc = self._procs[name] = psutil.Process(self.pids[name])
        if name in self.alone:
            return [proc]
        with contextlib.suppress(psutil.Error):
            return [proc, *proc.children(recursive=True)]
        return []

    def _sum(self, name: str, read: Any) -> float:
        import psutil

        total = 0.0
        for p in self._tree(name):
            with contextlib.suppress(psutil.Error):
                total += read(p)
        return total

    def cpu_s(self) -> dict[str, float]:
        def cpu(p: Any) -> float:
            t = p.cpu_times()
            return t.user + t.system

        return {name: self._sum(name, cpu) for name in self.pids}

    def rss(self) -> dict[str, float]:
        return {name: self._sum(name, lambda p: p.memory_info().rss) for name in self.pids}


def shm_bytes(prefix: str | None = None, allocated: bool = False) -> int:
    """Bytes of shared memory in use (pages touched) or `allocated` (segment sizes): the
    segments under /dev/shm named with `prefix`, or all of them."""
    total = 0
    for entry in os.scandir(SHM):
        if prefix is None or entry.name.startswith(prefix):
            with contextlib.suppress(OSError):
                st = entry.stat()
                total += st.st_size if allocated else st.st_blocks * 512
    return total


async def sample_resources(
    procs: Processes, gateway: Any, samples: list[dict[str, Any]], every_s: float = 1.0
) -> None:
    t0 = time.monotonic()
    while True:
        rss = procs.rss()
        samples.append(
            {
                "t": round(time.monotonic() - t0, 2),
                "calls": len(gateway.calls),
                "shm": shm_bytes(),
                "shm_allocated": shm_bytes(allocated=True),
                **{f"rss_{k}": v for k, v in rss.items()},
            }
        )
        await asyncio.sleep(every_s)  # a sampling period, not synchronisation


async def log_gateway_frames(gateway: Any, frames: dict[str, list[float]]) -> None:
    """Copies of each call's received-frame times (the calls vanish when callers hang up;
    `frame_arrivals` holds the last 60 s)."""
    while True:
        for call_id, call in list(gateway.calls.items()):
            frames[call_id] = list(call.frame_arrivals)
        await asyncio.sleep(0.5)  # a sampling period, not synchronisation


# -- one run -----------------------------------------------------------------------------


async def measure(config: Any, supervisor: Any, clips: list[np.ndarray], args: Any) -> dict:
    async with tapped_gateway(config, supervisor) as (base, gateway, tap):
        pids = {"gateway": os.getpid()}
        pids |= {name: s.process.pid for name, s in supervisor.stages.items()}
        procs = Processes(pids)
        samples: list[dict[str, Any]] = []
        frames: dict[str, list[float]] = {}
        background = [
            asyncio.create_task(sample_resources(procs, gateway, samples), name="resources"),
            asyncio.create_task(log_gateway_frames(gateway, frames), name="gateway-frames"),
        ]
        out: dict[str, Any] = {"loads": {}, "resources": samples}
        try:
            log("warm-up: one caller, two turns (not counted)")
            await run_callers(base, 1, clips, 2, opus=config.experiments.opus)
            await calls_gone(gateway)
            after_warm_up = len(samples)
            silence_ms = config.gateway.turns.detection.silence_duration_ms
            for n in args.loads:
                log(f"{n} caller(s), {args.turns} turns each (max_calls {args.max_calls})")
                mark, sample_mark = len(tap.seen), len(samples)
                cpu0, t0 = procs.cpu_s(), time.monotonic()
                try:
                    reports = await run_callers(
                        base, n, clips, args.turns, config.experiments.opus, args.per_process
                    )
                    figures = load_report(
                        n,
                        reports,
                        tap.since(mark),
                        silence_ms,
                        frames,
                        cpu0,
                        procs.cpu_s(),
                        time.monotonic() - t0,
                        samples[sample_mark:],
                    )
                except Exception as exc:  # the other loads still run; the failure is reported
                    log(f"{n} callers failed: {type(exc).__name__}: {exc}")
                    figures = {"error": f"{type(exc).__name__}: {exc}"}
                out["loads"][str(n)] = figures
                log(f"{n} callers: {json.dumps(_brief(figures))}")
                await calls_gone(gateway)
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
    out["memory_over_run"] = {  # from the end of the warm-up (first calls load code)
        k: growth(samples[after_warm_up:], k)
        for k in ("shm", "shm_allocated", *(f"rss_{p}" for p in pids))
    }
    out["saturates_at"] = saturation(out["loads"])
    return out


def load_report(
    callers: int,
    reports: list[dict[str, Any]],
    seen: list[Any],
    silence_ms: int,
    gateway_frames: dict[str, list[float]],
    cpu_before: dict[str, float],
    cpu_after: dict[str, float],
    wall_s: float,
    samples: list[dict[str, Any]],
) -> dict[str, Any]:
    """One load's figures: loadtest.latency's (with p99), sessions admitted and
    refused, audio gaps both ways, CPU per admitted session, and memory during the load."""
    figures = load_figures(reports, seen, silence_ms, qs=(50, 95, 99))
    admitted = [r for r in reports if r.get("call_id")]
    figures["sessions"] = {
        "callers": callers,
        "admitted": len(admitted),
        "refused": sum(bool(r.get("refused")) for r in reports),
        "no_report": callers - len(reports),  # their process missed the deadline
    }
    figures["errors"] = [e for e in figures["errors"] if not e.startswith("gateway answered 503")]
    figures["gaps_at_callers"] = gap_figures([r.get("arrivals", []) for r in admitted])
    figures["gaps_at_gateway"] = gap_figures(
        [gateway_frames[r["call_id"]] for r in admitted if r["call_id"] in gateway_frames]
    )
    sessions = max(1, len(admitted))
    used = {k: cpu_after[k] - cpu_before[k] for k in cpu_before}
    figures["cpu_pct_of_a_core_per_session"] = {
        k: round(100 * v / wall_s / sessions, 2) for k, v in used.items()
    }
    figures["cpu_pct_of_a_core_total"] = {k: round(100 * v / wall_s, 1) for k, v in used.items()}
    figures["wall_s"] = round(wall_s, 1)
    keys = sorted({k for s in samples for k in s if k.startswith(("shm", "rss_"))})
    figures["memory"] = {k: growth(samples, k) for k in keys}
    return figures


def _brief(f: dict[str, Any]) -> dict[str, Any]:
    if "error" in f:
        return f
    return {
        "turn_ms": f["turn_ms"],
        "answered": f"{f['turns_answered']}/{f['turns_asked']}",
        "sessions": f["sessions"],
    }


# -- report ------------------------------------------------------------------------------


def _f(x: Any) -> str:
    return "-" if x is None else f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}"


def table(results: dict[str, Any]) -> str:
    loads = results["loads"]
    rows = [
        "| callers | admitted / refused / no report | turns | turn p50 / p95 / p99 ms | "
        + " | ".join(f"{h} p50" for h, _, _ in HOPS)
        + " | overhead p50 / p95 | barge-in p50 / p95 | cancel last ack p50 / p99 |",
        "|---:|---:|---:|---:|" + "---:|" * len(HOPS) + "---:|---:|---:|",
    ]
    for n, f in loads.items():
        if "error" in f:
            rows.append(f"| {n} | failed: {f['error']} |")
            continue
        t, b, s = f["turn_ms"], f["barge_in_at_client_ms"], f["sessions"]
        c = f["cancel_ms"].get("last_ack", {})
        o = f.get("pipeline_overhead_ms", {})
        rows.append(
            f"| {n} | {s['admitted']} / {s['refused']} / {s['no_report']} | "
            f"{f['turns_answered']} of {f['turns_asked']} | "
            f"{_f(t['p50'])} / {_f(t['p95'])} / {_f(t['p99'])} | "
            + " | ".join(_f(f["hops_ms"][h]["p50"]) for h, _, _ in HOPS)
            + f" | {_f(o.get('p50'))} / {_f(o.get('p95'))}"
            + f" | {_f(b['p50'])} / {_f(b['p95'])} | {_f(c.get('p50'))} / {_f(c.get('p99'))} |"
        )
    rows += [
        "",
        "| callers | cancel p99: encoder / reasoning / vocoder ms | worst interval at callers "
        "p50 / max ms | > 80 ms at callers | worst interval at gateway p50 / max ms | > 80 ms "
        "at gateway | CPU % of a core per session: gateway / encoder / reasoning / vocoder |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, f in loads.items():
        if "error" in f:
            continue
        cm = f["cancel_ms"]
        gc, gg = f["gaps_at_callers"], f["gaps_at_gateway"]
        cpu = f["cpu_pct_of_a_core_per_session"]
        rows.append(
            f"| {n} | "
            + " / ".join(_f(cm.get(s, {}).get("p99")) for s in ("encoder", "reasoning", "vocoder"))
            + f" | {_f(gc['worst_interval_ms']['p50'])} / {_f(gc['worst_interval_ms']['max'])}"
            f" | {gc['intervals_over_80ms']} of {gc['intervals']}"
            f" | {_f(gg['worst_interval_ms']['p50'])} / {_f(gg['worst_interval_ms']['max'])}"
            f" | {gg['intervals_over_80ms']} of {gg['intervals']} | "
            + " / ".join(_f(cpu.get(p)) for p in ("gateway", "encoder", "reasoning", "vocoder"))
            + " |"
        )
    rows += [
        "",
        "| callers | pipeline overhead p50 by hop, ms: "
        + " / ".join(h for h, _, _ in HOPS)
        + " (the VAD hop's beyond its silence window) |",
        "|---:|---:|",
    ]
    for n, f in loads.items():
        by_hop = f.get("overhead_by_hop_ms")
        if by_hop:
            rows.append(f"| {n} | " + " / ".join(_f(by_hop[h]["p50"]) for h, _, _ in HOPS) + " |")
    rows += ["", "| memory over the run | first MiB | last MiB | max MiB | slope MiB/min |"]
    rows.append("|---|---:|---:|---:|---:|")
    for k, g in results["memory_over_run"].items():
        if g:
            rows.append(
                f"| {k} | {g['first_mib']} | {g['last_mib']} | {g['max_mib']} "
                f"| {g['slope_mib_per_min']} |"
            )
    rows += ["", f"saturates at: {results.get('saturates_at') or 'not within these loads'}"]
    return "\n".join(rows)


def plot(results: dict[str, Any], path: Path) -> None:
    """Turn and barge-in latency against concurrency; CPU per session beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = {int(n): f for n, f in results["loads"].items() if "turn_ms" in f}
    xs = sorted(loads)
    fig, (ax, ax_cpu) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label, style in (
        ("p50", "turn p50", "o-"),
        ("p95", "turn p95", "s-"),
        ("p99", "turn p99", "^-"),
    ):
        ax.plot(xs, [loads[x]["turn_ms"][key] for x in xs], style, label=label)
    ax.plot(xs, [loads[x]["barge_in_at_client_ms"]["p95"] for x in xs], "x--", label="barge-in p95")
    ax.plot(
        xs,
        [loads[x]["hops_ms"]["encoder"]["p50"] for x in xs],
        ".:",
        label="encoder hop p50",
    )
    if (sat := results.get("saturates_at")) is not None:
        ax.axvline(sat, color="grey", lw=0.8, ls="--", label=f"saturates at {sat}")
    ax.set_yscale("log")
    ax.set_xlabel("concurrent callers")
    ax.set_ylabel("ms")
    ax.set_title("latency against concurrency")
    ax.legend(fontsize=8)
    for proc in ("gateway", "encoder", "reasoning", "vocoder"):
        ax_cpu.plot(
            xs, [loads[x]["cpu_pct_of_a_core_per_session"][proc] for x in xs], "o-", label=proc
        )
    ax_cpu.set_xlabel("concurrent callers")
    ax_cpu.set_ylabel("% of a core per session")
    ax_cpu.set_title("CPU per session")
    ax_cpu.legend(fontsize=8)
    fig.suptitle(f"{results['machine']['summary']}, {results['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine() -> dict[str, Any]:
    out = describe_machine()
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    out |= {"cpu_model": model, "memory_gib": round(mem / (1 << 30), 1)}
    out["summary"] = (
        f"{model or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{out['memory_gib']} GiB, Linux {platform.release()}, Python {platform.python_version()}"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--loads", type=ints, default=[1, 2, 4, 8, 10])
    parser.add_argument("--max-calls", type=int, default=8, help="gateway.max_calls")
    parser.add_argument("--turns", type=int, default=3, help="turns per caller")
    parser.add_argument("--per-process", type=int, default=4, help="callers per process")
    parser.add_argument("--config", type=Path, default=CONFIG, help="YAML file (%(default)s)")
    add_set_argument(parser, "reasoning.engine_args.enforce_eager=true,false")
    parser.add_argument("--out", type=Path, default=Path("out/load-report"))
    args = parser.parse_args(argv)
    from gateway.config import load_config
    from stages.supervisor import Supervisor

    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "benchmark": "load_report",
        "date": datetime.date.today().isoformat(),
        "command": "python -m loadtest.report " + " ".join(argv or sys.argv[1:]),
        "machine": machine(),
        "config": str(args.config),
        "max_calls": args.max_calls,
    }
    log(f"machine: {results['machine']['summary']}")
    clips = spoken_questions()
    results["caller_speech_s"] = [round(len(c) / 48000, 2) for c in clips]
    variants = [setting_overrides(v) for v in itertools.product(*args.set)]
    runs = []
    for settings in variants:
        config = load_config(
            args.config,
            {
                "gateway.port": 0,
                "gateway.max_calls": args.max_calls,
                "max_sessions": max(16, args.max_calls + 4),
                **settings,
            },
        )
        if settings:
            log(f"variant: {settings}")
        run: dict[str, Any] = {"settings": settings, "shm_bytes_before": shm_bytes()}
        with Supervisor(config) as supervisor:
            supervisor.start(progress=log)
            run |= asyncio.run(measure(config, supervisor, clips, args))
        run["shm_bytes_after"] = shm_bytes()
        runs.append(run)
    if len(runs) == 1:
        results |= runs[0]
    else:
        results["variants"] = runs
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    text = "\n\n".join(
        (f"variant {run['settings']}:\n" if run["settings"] else "") + table({**results, **run})
        for run in runs
    )
    (args.out / "table.md").write_text(text + "\n")
    try:
        plot({**results, **runs[-1]}, args.out / "latency.png")
    except Exception as exc:  # the figures are in the JSON and the table regardless
        log(f"plot failed: {type(exc).__name__}: {exc}")
    print(f"machine: {results['machine']['summary']}")
    print(text, flush=True)
    log(f"wrote {args.out}/results.json, table.md, latency.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
