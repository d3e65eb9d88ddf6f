"""The GPU run: the whole pipeline with real-size (random-weight) models, measured as callers
feel it, for each GPU layout side by side in one run: the one script a lent GPU machine runs,
variants, loads and the JSON they make, end to end.

    python -m loadtest.gpu_run [--layouts one,tp2,talker] [--loads 1,8,32]
        [--transports webrtc,websocket] [--out DIR]

For each layout (loadtest.gpu_layouts; `one`: every stage on GPU 0, configs/gpu-one.yaml;
`tp2`: vLLM tensor-parallel over GPUs 0-1 with Whisper and SpeechT5 on GPU 2,
configs/gpu-tp2.yaml, or on GPU 1 where only two are present; `talker`: `one` with the talker
voice, a second vLLM engine speaking SNAC codes, configs/gpu-talker.yaml; `speech-in`: `one`
with a speech-in model (Qwen2.5-Omni-7B's thinker) prefilled while the caller speaks,
configs/gpu-speech-in.yaml, `speech-in-at-end` the same prefilled when the turn ends,
`speech-in-ultravox` with Ultravox v0.5's shapes) it starts the stages
and the gateway on 127.0.0.1, then:
- loads of 1, 8 and 32 concurrent WebRTC callers (loadtest.caller_load: real aiortc peers in
  processes of their own, real Opus) that speak, wait for the agent, and talk over it: turn
  latency p50/p95 with its breakdown per hop, barge-in latency at the client, and cancel
  latency (CANCEL to the last stage's ack, the reasoning stage's after vLLM freed the KV);
- the reasoning stage's inter-token latency with N replies decoding at once, with the vocoder
  stopped (SIGSTOP: no GPU work but vLLM's) and with it synthesizing every reply.
Hops come from the CLOCK_MONOTONIC stamps of the ring records, read where the gateway receives
them (loadtest.tap), joined with the callers' own clock readings (one host, one clock;
loadtest.latency). The models have RANDOM WEIGHTS (loadtest.gpu_models): the figures are
timings, not quality. Prints a table and writes JSON (results.json) under --out.

Variants of a layout (`--vocoders`, `--gpu-sharing`, `--prepare-reply`, `--vocoder-dtype`,
`--mps-threads`, `--gateway-processes`, `--transports`, and any config key with
`--set KEY=V1,V2`) run side by side, every combination. `--transports websocket` has the same
callers hold the same conversations over the WebSocket Realtime API (loadtest.ws_callers: PCM16
24 kHz appends paced at 20 ms, first audio the first `response.output_audio.delta` after the end
of speech) instead of WebRTC. With more than
one gateway process, each traces the records it receives (gateway.trace) and the loads are
read from every trace; the inter-token runs use the first process.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.bench import describe_machine, log, nvidia_smi, summary
from loadtest.caller_load import TRANSPORTS, run_callers
from loadtest.gpu_layouts import (
    LAYOUT_CONFIGS,
    PLACEHOLDER_MODELS,
    VOCODER_DTYPES,
    ThreadShares,
    Variant,
    Vocoders,
    build_models,
    gpu_sharing_modes,
    layout_config,
)
from loadtest.latency import HOPS, inter_token_ms, load_figures
from loadtest.settings import add_set_argument
from loadtest.tap import Seen, Tap, Traces, calls_gone, tapped_gateway
from loadtest.voices import QUESTION, QUESTIONS, caller_speech

# Stage processes are spawned and re-import this module as __mp_main__: keep torch, vLLM and
# CUDA out of the imports above (and out of those of the modules they name), so that nothing
# initialises CUDA before a stage's CUDA_VISIBLE_DEVICES is set.


# -- running a layout --------------------------------------------------------------------


async def measure_itl(
    gateway: Any, tap: Tap, vocoder_pids: list[int], streams: int, rounds: int
) -> dict[str, Any]:
    """Inter-token latency with `streams` replies decoding at once, vocoder stopped vs busy."""
    link = gateway.link
    out: dict[str, Any] = {}
    for mode in ("vocoder_idle", "vocoder_synthesizing"):
        sessions = [link.open_session() for _ in range(streams)]
        ids: set[str] = set()
        ttft: list[float] = []
        mark = tap.mark()
        if mode == "vocoder_idle":
            for pid in vocoder_pids:
                os.kill(pid, signal.SIGSTOP)
        try:
            for r in range(rounds):
                waits, sent = [], {}
                for s in sessions:
                    rid = f"itl-{mode}-{streams}-{r}-{s}"
                    ids.add(rid)
                    waits.append(tap.expect_done(rid))
                    sent[rid] = time.monotonic_ns()
                    link.create_response(s, rid, text=QUESTION)
                try:
                    await asyncio.wait_for(asyncio.gather(*waits), 60)
                except TimeoutError:
                    done = {
                        x.msg.response_id for x in tap.since(mark) if x.kind.name == "RESPONSE_DONE"
                    }
                    missing = sorted(set(sent) - done)
                    raise TimeoutError(
                        f"{len(missing)} replies not done in 60 s: {missing[:4]}"
                    ) from None
                firsts = _first_deltas(tap.since(mark), set(sent))
                ttft += [(firsts[i] - sent[i]) / 1e6 for i in sent if i in firsts]
        finally:
            # closing makes the vocoder's backlog stale. (Not CANCEL then close: the reasoning
            # stage's cancel task, run after a quick reopen of the same session id, stopped the
            # new session's reply.)
            for s in sessions:
                link.close_session(s)
            if mode == "vocoder_idle":
                for pid in vocoder_pids:
                    os.kill(pid, signal.SIGCONT)
        out[mode] = {
            "inter_token_ms": summary(inter_token_ms(tap.since(mark), ids), 50, 99),
            "ttft_ms": summary(ttft, 50, 99),
        }
    return out


def _first_deltas(seen: list[Seen], ids: set[str]) -> dict[str, int]:
    from stages.messages import Kind

    first: dict[str, int] = {}
    for s in seen:
        if s.kind is Kind.TEXT_DELTA and s.msg.response_id in ids:
            first.setdefault(s.msg.response_id, s.t_ns)
    return first


async def measure_layout(
    config: Any,
    supervisor: Any,
    speech: np.ndarray,
    args: argparse.Namespace,
    transport: str = "webrtc",
) -> dict[str, Any]:
    async with tapped_gateway(config, supervisor) as (base, gateway, tap):
        # with several gateway processes the loads' records come from all of their traces
        trace_dir = config.gateway.trace_dir
        records = tap if trace_dir is None else Traces(Path(trace_dir))
        callers = Callers(base, config.experiments.opus, transport)
        return await _measure_loads(
            callers, gateway, tap, records, config, supervisor, speech, args
        )


@dataclass(frozen=True)
class Callers:
    """How a layout's callers reach its gateway: its URL, their transport (TRANSPORTS), and
    WebRTC's Opus coder (the gateway's `experiments.opus`)."""

    base: str
    opus: str
    transport: str

    async def run(self, n: int, speech: np.ndarray, turns: int) -> list[dict[str, Any]]:
        return await run_callers(self.base, n, speech, turns, self.opus, transport=self.transport)


async def _measure_loads(
    callers: Callers,
    gateway: Any,
    tap: Tap,
    records: Tap | Traces,
    config: Any,
    supervisor: Any,
    speech: np.ndarray,
    args: argparse.Namespace,
) -> dict[str, Any]:
    silence_ms = config.gateway.turns.detection.silence_duration_ms
    out: dict[str, Any] = {"loads": {}, "inter_token": {}}
    log(f"warm-up: one caller over {callers.transport}, two turns (not counted)")
    await callers.run(1, speech, 2)
    await calls_gone(gateway)
    for n in args.loads:
        turns = args.turns_single if n == 1 else args.turns
        log(f"{n} caller(s) over {callers.transport}, {turns} turns each")
        mark = records.mark()
        t0 = time.monotonic()
        try:
            reports = await callers.run(n, speech, turns)
            figures = load_figures(reports, records.since(mark), silence_ms, per_turn=args.per_turn)
        except Exception as exc:  # the other loads still run; the failure is reported
            log(f"{n} callers failed: {type(exc).__name__}: {exc}")
            figures = {"error": f"{type(exc).__name__}: {exc}"}
        figures["wall_s"] = round(time.monotonic() - t0, 1)
        if isinstance(records, Traces):
            figures["records_by_gateway_process"] = dict(records.by_process)
        out["loads"][str(n)] = figures
        log(f"{n} callers: {json.dumps({k: v for k, v in figures.items() if k != 'turns'})}")
        await calls_gone(gateway)
    vocoder_pids = [  # every replica
        supervisor.stages[i].process.pid for i in supervisor.names.instances("vocoder")
    ]
    for n in args.itl_streams:
        log(f"inter-token latency, {n} replies at once")
        try:
            out["inter_token"][str(n)] = await measure_itl(gateway, tap, vocoder_pids, n, 2)
        except Exception as exc:
            log(f"inter-token run failed: {type(exc).__name__}: {exc}")
            out["inter_token"][str(n)] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"{n} replies: {json.dumps(out['inter_token'][str(n)])}")
    return out


def _one_of(what: str, allowed: Callable[[], tuple[str, ...]]) -> Callable[[str], list[str]]:
    """An argparse type for comma-separated variants, each one of `allowed()`."""

    def parse(text: str) -> list[str]:
        values = [v for v in text.split(",") if v]
        for v in values:
            if v not in (choices := allowed()):
                raise argparse.ArgumentTypeError(f"{what} {v!r}: one of {', '.join(choices)}")
        return values

    return parse


def sessions_of_first_gateway(config: Any) -> range:
    """The session ids of the gateway process that gpu_run's own link (its inter-token runs)
    opens sessions in."""
    from stages.rings import GATEWAY, RingNames

    names = RingNames.fresh({GATEWAY: config.gateway.processes})
    return names.sessions_of(GATEWAY, config.max_sessions)


def run_layout(
    name: str, variant: Variant, models: Any, speech: np.ndarray, args: argparse.Namespace
) -> dict:
    """One layout with one variant of it."""
    from stages.supervisor import Supervisor

    traces = tempfile.TemporaryDirectory(prefix="omni-trace-")
    config, notes = layout_config(name, models, args.gpu_count, args.device, variant, traces.name)
    transport = variant.transport or "webrtc"
    out: dict[str, Any] = {"config": LAYOUT_CONFIGS[name], "transport": transport, "notes": notes}
    if transport == "websocket":
        notes.append(
            "callers over the WebSocket Realtime API: first audio is the first "
            "response.output_audio.delta after the end of speech; no barge-in at the client "
            "(the client holds the audio it was sent)"
        )
    t0 = time.monotonic()
    with traces, Supervisor(config, gateways=config.gateway.processes) as supervisor:
        supervisor.start(progress=log)
        out["start_s"] = round(time.monotonic() - t0, 1)
        out["placement"] = {
            s: {k: v for k, v in p.info.items() if k != "pid"} for s, p in supervisor.stages.items()
        }
        out["gpu_processes"] = nvidia_smi(
            "--query-compute-apps=pid,used_gpu_memory,gpu_bus_id", "--format=csv,noheader"
        )
        out["gpu_memory_mib_by_stage"] = gpu_memory_by_stage(supervisor, out["gpu_processes"])
        out |= asyncio.run(measure_layout(config, supervisor, speech, args, transport))
    return out


# -- the stages' GPU memory --------------------------------------------------------------


def gpu_memory_by_stage(supervisor: Any, processes: list[str]) -> dict[str, int]:
    """GPU memory (MiB) of each stage instance: its own process and those of its process group
    (vLLM's engine core and workers, a talker's engine core), from nvidia-smi's
    "pid, used_gpu_memory, bus" lines."""
    groups = {p.process.pid: name for name, p in supervisor.stages.items() if p.process}
    out: dict[str, int] = {}
    for line in processes:
        parts = [x.strip() for x in line.split(",")]
        try:
            pid, mib = int(parts[0]), int(parts[1].split()[0])
            stage = groups.get(os.getpgid(pid), f"pid {pid}")
        except (ValueError, IndexError, ProcessLookupError, PermissionError):
            continue
        out[stage] = out.get(stage, 0) + mib
    return out


# -- report ------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.1f}"

    lines = [
        "| layout | callers | turn p50 / p95 ms | first token p50 / p95 | beyond VAD p95 | "
        + " | ".join(f"{h} p50" for h, _, _ in HOPS)
        + " | overhead p50 / p95 | barge-in p50 / p95 | cancel p50 / p99 | ITL p50 / p99 |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(HOPS) + "---:|---:|---:|---:|",
    ]
    for name, layout in results["layouts"].items():
        for n, load in layout.get("loads", {}).items():
            if "error" in load:
                lines.append(f"| {name} | {n} | failed: {load['error']} |")
                continue
            t, b = load["turn_ms"], load["barge_in_at_client_ms"]
            c = load["cancel_ms"].get("last_ack", {})
            i = load["inter_token_ms_during_calls"]
            o = load.get("pipeline_overhead_ms", {})
            ft = load.get("first_token_ms", {})
            lines.append(
                f"| {name} | {n} | {f(t['p50'])} / {f(t['p95'])} "
                f"| {f(ft.get('p50'))} / {f(ft.get('p95'))} "
                f"| {f(load['turn_beyond_vad_window_ms']['p95'])} | "
                + " | ".join(f(load["hops_ms"][h]["p50"]) for h, _, _ in HOPS)
                + f" | {f(o.get('p50'))} / {f(o.get('p95'))}"
                + f" | {f(b['p50'])} / {f(b['p95'])} | {f(c.get('p50'))} / {f(c.get('p99'))}"
                f" | {f(i['p50'])} / {f(i['p99'])} |"
            )
    lines += ["", "| layout | replies at once | vocoder | ITL p50 / p99 ms | TTFT p50 ms |"]
    lines.append("|---|---:|---|---:|---:|")
    for name, layout in results["layouts"].items():
        for n, modes in layout.get("inter_token", {}).items():
            if "error" in modes:
                lines.append(f"| {name} | {n} | failed: {modes['error']} |")
                continue
            for mode, m in modes.items():
                i = m["inter_token_ms"]
                lines.append(
                    f"| {name} | {n} | {mode.removeprefix('vocoder_')} | "
                    f"{f(i['p50'])} / {f(i['p99'])} | {f(m['ttft_ms']['p50'])} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument(
        "--layouts",
        default=None,
        help="of one,tp2,talker,speech-in,speech-in-at-end,speech-in-ultravox (talker: "
        "gpu-one's layout with the talker voice; speech-in*: loadtest.gpu_layouts); default: "
        "one, and tp2 where the GPUs allow",
    )
    parser.add_argument("--loads", type=ints, default=[1, 8, 32])
    parser.add_argument("--turns", type=int, default=4, help="turns per caller under load")
    parser.add_argument("--turns-single", type=int, default=8, help="turns of a lone caller")
    parser.add_argument("--itl-streams", type=ints, default=[8, 32])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--vocoders",
        type=lambda s: [Vocoders.parse(v) for v in s.split(",") if v],
        default=[None],
        help="vocoder variants to run side by side, REPLICASxBATCH each (e.g. 4x1,1x8: four "
        "processes stepping one reply at a time, one process stepping up to 8 together); "
        "default: as each layout's file says",
    )
    parser.add_argument(
        "--gpu-sharing",
        type=_one_of("gpu sharing", gpu_sharing_modes),
        default=[None],
        help="GPU sharing variants to run side by side: time-slice,mps (CUDA MPS daemon run by "
        "the supervisor); default: as each layout's file says",
    )
    parser.add_argument(
        "--prepare-reply",
        type=ints,
        default=[None],
        help="gateway.turns.prepare_reply_ms variants to run side by side, e.g. 0,200 (0: off)",
    )
    parser.add_argument(
        "--vocoder-dtype",
        type=_one_of("vocoder dtype", lambda: VOCODER_DTYPES),
        default=[None],
        help="vocoder (SpeechT5) dtype variants to run side by side, e.g. float32,bfloat16",
    )
    parser.add_argument(
        "--mps-threads",
        type=lambda s: [ThreadShares.parse(v) for v in s.split(",") if v],
        default=[None],
        help="MPS SM-share variants to run side by side (experiments.mps_thread_percent), e.g. "
        "none,reasoning=60:vocoder=40",
    )
    parser.add_argument(
        "--gateway-processes",
        type=ints,
        default=[None],
        help="gateway.processes variants, e.g. 1,4 (32 callers need more than one); default: "
        "the file's",
    )
    parser.add_argument(
        "--transports",
        type=_one_of("transport", lambda: TRANSPORTS),
        default=[None],
        help="how the callers reach the gateway, variants side by side: webrtc,websocket "
        "(the WebSocket Realtime API, loadtest.ws_callers); default: webrtc",
    )
    add_set_argument(parser, "reasoning.sampling.max_tokens=400,60")
    parser.add_argument(
        "--caller-pause-ms",
        type=int,
        default=0,
        help="silence in the middle of the caller's question (e.g. 300: a reply prepared at "
        "the pause is dropped when the caller goes on); 0: none",
    )
    parser.add_argument(
        "--question",
        choices=sorted(QUESTIONS),
        default="short",
        help="what the callers ask: short (1.6 s) or long (several of a speech-in tower's "
        "2 s windows, which are prefilled while the caller speaks)",
    )
    parser.add_argument(
        "--per-turn",
        action="store_true",
        help="keep every turn's hops in results.json (`turns` of each load), not only percentiles",
    )
    parser.add_argument("--preset", default=None, help="model sizes (default: real on cuda)")
    parser.add_argument("--models-root", type=Path, default=Path(".cache/gpu-models"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "out"))
    args = parser.parse_args(argv)
    if not 0 <= args.caller_pause_ms <= 5000:
        parser.error(f"--caller-pause-ms {args.caller_pause_ms}: must be 0..5000")
    from loadtest.gpu_models import describe
    from stages.placement import count_gpus

    args.gpu_count = count_gpus() if args.device == "cuda" else 0
    layouts = (args.layouts or ("one,tp2" if args.gpu_count >= 2 else "one")).split(",")
    dims = (
        args.vocoders,
        args.gpu_sharing,
        args.prepare_reply,
        args.vocoder_dtype,
        args.mps_threads,
        args.gateway_processes,
        args.transports,
    )
    variants = [
        Variant(*chosen[: len(dims)], settings=tuple(chosen[len(dims) :]))
        for chosen in itertools.product(*dims, *args.set)
    ]
    # a bad key or value fails now, not after the models are built and other variants ran
    for name, variant in itertools.product(layouts, variants):
        try:
            config, _ = layout_config(
                name, PLACEHOLDER_MODELS, args.gpu_count, args.device, variant
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            parser.error(f"variant {variant.key(name)!r}: {exc}")
        # the inter-token runs open every reply's session on the first gateway process
        own = len(sessions_of_first_gateway(config))
        if args.itl_streams and max(args.itl_streams) > own:
            parser.error(
                f"variant {variant.key(name)!r}: --itl-streams {max(args.itl_streams)} needs "
                f"that many sessions in one gateway process, which has {own} (max_sessions "
                f"{config.max_sessions} over {config.gateway.processes} processes)"
            )
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m loadtest.gpu_run " + " ".join(argv or sys.argv[1:]),
        "machine": describe_machine(),
        "random_weights": "every model has random weights of a real shape: timings, not quality",
        "layouts": {},
    }
    log(f"machine: {results['machine']['gpus'] or 'no GPU'}; layouts {layouts}")
    t0 = time.monotonic()
    preset = args.preset or ("real" if args.device == "cuda" else "tiny")
    models = build_models(args.models_root, args.device, preset, layouts)
    results["models"] = {"build_s": round(time.monotonic() - t0, 1), **describe(models)}
    log(f"models ready in {results['models']['build_s']} s")
    speech = caller_speech(args.caller_pause_ms, QUESTIONS[args.question])
    results["caller_question"] = QUESTIONS[args.question]
    results["caller_speech_s"] = round(len(speech) / 48000, 2)
    results["caller_pause_ms"] = args.caller_pause_ms
    for name, variant in itertools.product(layouts, variants):
        key = variant.key(name)
        log(f"layout {key}: {LAYOUT_CONFIGS[name]}")
        try:
            results["layouts"][key] = run_layout(name, variant, models, speech, args)
        except Exception as exc:  # the other layouts still run; the failure is reported
            log(f"layout {key} failed: {type(exc).__name__}: {exc}")
            results["layouts"][key] = {"error": f"{type(exc).__name__}: {exc}"}
        results["stage_log"] = stages_account(args.out / "run.log", results["layouts"])
        (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(table(results), flush=True)
    (args.out / "table.md").write_text(table(results) + "\n")
    return 0


def stages_account(run_log: Path, layouts: dict[str, Any]) -> dict[str, Any]:
    """What the stages logged during each variant's loads (loadtest.stage_log), read from this
    run's own log where loadtest/gpu/device-run.sh writes it (`--out`/run.log); {} without."""
    if not run_log.is_file():
        return {}
    from loadtest import stage_log  # (the stages' modules: not imported before they spawn)

    return {key: loads for key, loads in stage_log.report(run_log).items() if key in layouts}


if __name__ == "__main__":
    sys.exit(main())
