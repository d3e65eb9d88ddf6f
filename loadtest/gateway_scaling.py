"""Gateway processes against concurrency: sessions per core, and where each count saturates.

For each count of gateway processes (`--processes 1,2`) it starts `omni-gateway start` on the
config with `gateway.processes` set, as a user runs it, and puts each load of conversing
WebRTC callers (`--loads`, from processes of their own) on it. Per load: turn latency (the
caller's end of speech to the first agent audio it hears) p50/p95, barge-in at the caller p95,
turns answered, the audio gaps the callers heard and those the gateway saw (its frame-interval
metrics, both ways), and the CPU of the gateway processes (the first one also runs the
supervisor's threads; the stages are not counted). A count carries a load when what the gateway
sets holds: every turn answered, no gap over 60 ms either way, barge-in p95 within DESIGN.md's
150 ms. (The turn latency is the stages' and is reported, not judged.) The report gives the
largest load each count carries and the sessions per gateway core there. Prints JSON and a
table, and states the machine.

    python -m loadtest.gateway_scaling --processes 1,2 --loads 4,8,12 --turns 3

`--barge-in-hold both` runs each count with gateway.turns.interruptions.hold_on_voice off, then
on, to measure the barge-in it saves (the agent silenced at the caller's first voiced frame
instead of at the VAD's onset decision). `--set KEY=V1,V2` (repeatable) runs each count with any
other config key at each value, e.g. `--set gateway.media.udp_reads_per_wake=1,32`.

On a GPU machine, `--layout one` runs loadtest.gpu_layouts' layout instead of a config file, on
the random-weight models of real shapes it builds (or finds) in `--models-root`.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import copy
import datetime
import itertools
import json
import multiprocessing as mp
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import ConfigError, parse_config, set_dotted
from loadtest.bench import log, summary
from loadtest.caller_load import run_callers
from loadtest.report import Processes, gap_figures, machine, spoken_questions
from loadtest.service import Service
from loadtest.settings import add_set_argument
from loadtest.voices import caller_speech

CONFIG = Path(__file__).parents[1] / "configs" / "tiny.yaml"
GAP_MS = 60.0
BARGE_IN_MS = 150.0  # DESIGN.md: the caller's speech onset to the agent's audio stopping
GAP_INTERVAL_S = 0.08  # a 20 ms frame stream's interval over this is a gap over 60 ms
STALL_S = 0.05  # the gateway loop waking later than this is reported as a stall
GC_PAUSE_S = 0.02  # a garbage collection longer than this is reported


def config_for(
    data: dict[str, Any],
    processes: int,
    max_calls: int,
    out: Path,
    hold: bool = True,
    settings: tuple[tuple[str, Any], ...] = (),
) -> Path:
    """A config file: `data` with `processes` gateway processes taking `max_calls` calls,
    gateway.turns.interruptions.hold_on_voice set to `hold`, and any other keys as `settings`
    say (validated)."""
    data = copy.deepcopy(data)
    gateway = data.setdefault("gateway", {})
    gateway |= {"processes": processes, "max_calls": max_calls}
    set_dotted(data, "gateway.turns.interruptions.hold_on_voice", hold)
    data["max_sessions"] = max(data.get("max_sessions", 64), max_calls + 2 * processes)
    for key, value in settings:
        set_dotted(data, key, value)
    parse_config(data, "--set")
    name = "-".join([str(processes), *([] if hold else ["no-hold"])])
    name += "".join(f"-{k}={v}" for k, v in settings)
    path = out / f"config-{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def load_figures(
    reports: list[dict[str, Any]], cpu_s: dict[str, float], wall_s: float, silence_ms: int
) -> dict[str, Any]:
    turns = [t for r in reports for t in r["turns"]]
    answered = [t for t in turns if t.get("first_audio") is not None]
    admitted = [r for r in reports if r.get("call_id")]
    gaps = gap_figures([r.get("arrivals", []) for r in admitted])
    gateway_cpu = sum(cpu_s.values())
    turn_ms = [(t["first_audio"] - t["end_of_speech"]) * 1000 for t in answered]
    return {
        "callers": len(reports),
        "admitted": len(admitted),
        "turns_asked": len(turns),
        "turns_answered": len(answered),
        "errors": [r["error"] for r in reports if r.get("error")],
        "turn_ms": summary(turn_ms, 50, 95),
        "turn_beyond_vad_window_ms": summary([x - silence_ms for x in turn_ms], 50, 95),
        "barge_in_ms": summary(
            [
                (t["agent_stopped"] - t["onset"]) * 1000
                for t in turns
                if t.get("agent_stopped") is not None
            ],
            50,
            95,
        ),
        "gaps_at_callers": gaps,
        "gateway_cpu_cores": round(gateway_cpu / wall_s, 3),
        "gateway_cpu_cores_by_process": {k: round(v / wall_s, 3) for k, v in cpu_s.items()},
        "gateway_cpu_pct_of_a_core_per_session": round(
            100 * gateway_cpu / wall_s / max(1, len(admitted)), 2
        ),
        "wall_s": round(wall_s, 1),
    }


def carries(figures: dict[str, Any]) -> bool:
    """Every turn answered, no gap over 60 ms heard by a caller or seen by the gateway either
    way, barge-in p95 within BARGE_IN_MS."""
    worst = figures["gaps_at_callers"]["worst_interval_ms"]["max"]
    at_gateway = figures.get("gaps_at_gateway", {}).values()
    barge_in = figures["barge_in_ms"]["p95"]
    return (
        all(d["over_80ms"] == 0 for d in at_gateway)
        and figures["turns_answered"] == figures["turns_asked"] > 0
        and worst is not None
        and worst - 20 <= GAP_MS  # the interval less the frame itself
        and (barge_in is None or barge_in <= BARGE_IN_MS)
    )


async def gateway_counts(base: str) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """The gateway's frame-interval counts and its stall counts so far, from /metrics (summed
    over the gateway processes)."""
    async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as resp:
        text = await resp.text()
    return parse_frame_intervals(text), parse_stalls(text)


def parse_frame_intervals(text: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "omni_audio_frame_interval_seconds":
            continue
        for sample in family.samples:
            counts = out.setdefault(sample.labels.get("direction", "?"), {})
            if sample.name.endswith("_count"):
                counts["intervals"] = sample.value
            elif sample.name.endswith("_bucket") and float(sample.labels["le"]) == GAP_INTERVAL_S:
                counts["within_80ms"] = sample.value
    return out


def parse_stalls(text: str) -> dict[str, float]:
    """Event-loop wake-ups more than 50 ms late, and garbage collections: how many, how many
    full (generation 2), how many over 20 ms, and their seconds in all."""
    out = dict.fromkeys(
        ("loop_wakes", "loop_within_50ms", "gcs", "full_gcs", "gcs_within_20ms", "gc_s"), 0.0
    )
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            le = sample.labels.get("le")
            if family.name == "omni_event_loop_lag_seconds":
                if sample.name.endswith("_count"):
                    out["loop_wakes"] += sample.value
                elif le is not None and float(le) == STALL_S:
                    out["loop_within_50ms"] += sample.value
            elif family.name == "omni_gc_pause_seconds":
                if sample.name.endswith("_count"):
                    out["gcs"] += sample.value
                    if sample.labels.get("generation") == "2":
                        out["full_gcs"] += sample.value
                elif sample.name.endswith("_sum"):
                    out["gc_s"] += sample.value
                elif le is not None and float(le) == GC_PAUSE_S:
                    out["gcs_within_20ms"] += sample.value
    return out


def stalls_at_gateway(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What held the gateway's loop between `before` and `after`."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return {
        "loop_late_over_50ms": int(d["loop_wakes"] - d["loop_within_50ms"]),
        "gcs": int(d["gcs"]),
        "full_gcs": int(d["full_gcs"]),
        "gcs_over_20ms": int(d["gcs"] - d["gcs_within_20ms"]),
        "gc_ms": round(1000 * d["gc_s"], 1),
    }


def gaps_at_gateway(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Intervals over 80 ms between `before` and `after`, by direction."""
    out = {}
    for direction, counts in after.items():
        was = before.get(direction, {})
        total = counts.get("intervals", 0) - was.get("intervals", 0)
        within = counts.get("within_80ms", 0) - was.get("within_80ms", 0)
        out[direction] = {"intervals": int(total), "over_80ms": int(total - within)}
    return out


async def measure(
    service: Service, opus: str, silence_ms: int, clips: list[Any], args: Any
) -> dict[str, Any]:
    base, pids = await asyncio.to_thread(service.started, 900)
    procs = Processes(pids, alone=frozenset(pids))
    log(f"serving at {base} with {len(pids)} gateway process(es)")
    log("warm-up: one caller, two turns (not counted)")
    await run_callers(base, 1, clips, 2, opus, args.per_process)
    loads: dict[str, Any] = {}
    for n in args.loads:
        log(f"{n} caller(s), {args.turns} turns each")
        (frames0, stalls0), cpu0, t0 = await gateway_counts(base), procs.cpu_s(), time.monotonic()
        reports = await run_callers(base, n, clips, args.turns, opus, args.per_process)
        cpu1, wall = procs.cpu_s(), time.monotonic() - t0
        figures = load_figures(reports, {k: cpu1[k] - cpu0[k] for k in cpu0}, wall, silence_ms)
        frames1, stalls1 = await gateway_counts(base)
        figures["gaps_at_gateway"] = gaps_at_gateway(frames0, frames1)
        figures["stalls_at_gateway"] = stalls_at_gateway(stalls0, stalls1)
        loads[str(n)] = figures
        log(
            f"{n} callers: turn {figures['turn_ms']}, answered "
            f"{figures['turns_answered']}/{figures['turns_asked']}, worst gap "
            f"{figures['gaps_at_callers']['worst_interval_ms']}, at the gateway "
            f"{figures['gaps_at_gateway']}, {figures['stalls_at_gateway']}, gateway CPU "
            f"{figures['gateway_cpu_cores']} cores"
        )
    return {"loads": loads, **capacity(loads)}


def capacity(loads: dict[str, Any]) -> dict[str, Any]:
    """The largest load carried below the first one that is not, and the sessions per gateway
    core there."""
    best = None
    for n in sorted(loads, key=int):
        if not carries(loads[n]):
            break
        best = int(n)
    cores = loads[str(best)]["gateway_cpu_cores"] if best else None
    return {
        "largest_load_carried": best,
        "gateway_cpu_cores_there": cores,
        "sessions_per_gateway_core": round(best / cores, 1) if best and cores else None,
    }


def at_gateway(figures: dict[str, Any]) -> str:
    """'gaps in / gaps out' of the frames the gateway received and sent."""
    gaps = figures.get("gaps_at_gateway", {})
    return " / ".join(str(gaps.get(d, {}).get("over_80ms", "-")) for d in ("in", "out"))


def stalls(figures: dict[str, Any]) -> str:
    """'loop wake-ups > 50 ms late / full GCs / GCs > 20 ms' at the gateway."""
    st = figures.get("stalls_at_gateway")
    if not st:
        return "-"
    return f"{st['loop_late_over_50ms']} / {st['full_gcs']} / {st['gcs_over_20ms']}"


def table(results: dict[str, Any]) -> str:
    rows = [
        "| processes | callers | turns | turn p50/p95 ms | beyond the VAD window p95 | "
        "barge-in p95 ms | worst frame interval heard ms (p95/max) | gaps at the gateway in/out | "
        "loop late > 50 ms / full GCs / GCs > 20 ms | "
        "gateway CPU (cores) | CPU % of a core per session |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.0f}"

    for count, run in results["runs"].items():
        for n, fig in run.get("loads", {}).items():
            gap = fig["gaps_at_callers"]["worst_interval_ms"]
            rows.append(
                f"| {count} | {n} | {fig['turns_answered']}/{fig['turns_asked']} | "
                f"{f(fig['turn_ms']['p50'])}/{f(fig['turn_ms']['p95'])} | "
                f"{f(fig['turn_beyond_vad_window_ms']['p95'])} | "
                f"{f(fig['barge_in_ms']['p95'])} | {f(gap['p95'])}/{f(gap['max'])} | "
                f"{at_gateway(fig)} | {stalls(fig)} | "
                f"{fig['gateway_cpu_cores']:.2f} | "
                f"{fig['gateway_cpu_pct_of_a_core_per_session']:.1f} |"
            )
    rows.append("")
    for count, run in results["runs"].items():
        rows.append(
            f"{count} process(es): carried {run.get('largest_load_carried')} callers "
            f"({run.get('sessions_per_gateway_core')} sessions per gateway core)"
            + (f"; error: {run['error']}" if "error" in run else "")
        )
    return "\n".join(rows)


def base_config(args: argparse.Namespace) -> tuple[Any, Any]:
    """The configuration every count runs on, and what to say of it in the results."""
    from gateway.config import load_config

    if not args.layout:
        return load_config(args.config), str(args.config)
    from loadtest.gpu_layouts import layout_config
    from loadtest.gpu_models import describe, ensure_models
    from stages.placement import count_gpus

    # built in a process of its own, so the CUDA memory the build used is given back
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        preset = "real" if args.device == "cuda" else "tiny"
        models = pool.submit(ensure_models, args.models_root, args.device, preset).result()
    gpus = count_gpus() if args.device == "cuda" else 0
    config, notes = layout_config(args.layout, models, gpus, args.device)
    described = {
        "layout": args.layout,
        "notes": notes,
        "models": describe(models),
        "random_weights": "every model has random weights of a real shape: timings, not quality",
    }
    return config, described


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--layout", help="a loadtest.gpu_layouts layout (one, tp2) instead")
    parser.add_argument("--models-root", type=Path, default=Path(".cache/gpu-models"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="--layout's")
    parser.add_argument("--processes", type=ints, default=[1, 2])
    parser.add_argument("--loads", type=ints, default=[4, 8, 12])
    parser.add_argument("--turns", type=int, default=3, help="turns per caller")
    parser.add_argument(
        "--barge-in-hold",
        choices=("on", "off", "both"),
        default="on",
        help="gateway.turns.interruptions.hold_on_voice; both: each process count with it off, "
        "then on",
    )
    add_set_argument(parser, "gateway.media.udp_reads_per_wake=1,32")
    parser.add_argument("--per-process", type=int, default=4, help="callers per process")
    parser.add_argument("--out", type=Path, default=Path("out/gateway-scaling"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    config, described = base_config(args)
    opus = config.experiments.opus
    silence_ms = config.gateway.turns.detection.silence_duration_ms
    results: dict[str, Any] = {
        "benchmark": "gateway_scaling",
        "date": datetime.date.today().isoformat(),
        "command": "python -m loadtest.gateway_scaling " + " ".join(argv or sys.argv[1:]),
        "machine": machine(),
        "config": described,
        "runs": {},
    }
    log(f"machine: {results['machine']['summary']}")
    # the GPU machine has espeak-ng's library (its wheel) but not its program
    clips = spoken_questions() if shutil.which("espeak-ng") else [caller_speech()]
    max_calls = 2 * max(args.loads)  # room for calls of the last load still closing
    holds = {"on": [True], "off": [False], "both": [False, True]}[args.barge_in_hold]
    runs = []  # (label, config file); every variant's config is checked before any runs
    for count, hold, *settings in itertools.product(args.processes, holds, *args.set):
        data = config.model_dump(mode="json")
        try:
            path = config_for(data, count, max_calls, args.out, hold, tuple(settings))
        except ConfigError as exc:
            parser.error(str(exc))
        label = str(count) if holds == [True] else f"{count}, hold {'on' if hold else 'off'}"
        runs.append((", ".join([label, *(f"{k}={v}" for k, v in settings)]), path))
    for label, path in runs:
        with Service(path, echo=True) as service:
            try:
                results["runs"][label] = asyncio.run(
                    measure(service, opus, silence_ms, clips, args)
                )
            except Exception as exc:  # the other runs still go; the failure is reported
                log(f"{label} failed: {type(exc).__name__}: {exc}")
                results["runs"][label] = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                if service.proc.poll() is None:
                    service.stop()
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    text = table(results)
    (args.out / "table.md").write_text(text + "\n")
    print(json.dumps(results, default=str))
    print(f"machine: {results['machine']['summary']}")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
