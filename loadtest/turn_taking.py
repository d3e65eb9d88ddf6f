"""Turn-taking benchmark: when the agent answers, and what stops it, under each turn detection
and interruption policy, side by side in one run.

    python -m loadtest.turn_taking [--config configs/offline.yaml] [--callers 1[,8,...]]
        [--limit N] [--variants immediate:webrtc,provisional:webrtc,provisional:silero]
        [--set KEY=V1[,V2] ...] [--turn-detections server_vad,semantic_vad] [--out DIR]
    python -m loadtest.turn_taking --layout one --models-root /tmp/gpu-models --callers 8,32 ...

`--layout` runs one of loadtest.gpu_layouts' layouts (gpu-one.yaml: random weights of real
shapes, built under --models-root as the GPU run builds them) instead of a config file; --set
changes it as there (e.g. the real Whisper tiny.en on the host's CPU, whose words the
end-of-turn words model can judge), and a key given several values makes each a variant of
each policy, named POLICY:CLASSIFIER+KEY=VALUE, on a service started afresh.

A labelled set is made here with the project's voices (the Piper voice, two espeak-ng voices):
finished questions; the same questions with a pause of 300 or 700 ms cut into them at a quiet
point between words; and sounds made over the agent while it speaks: coughs, noise bursts,
backchannels ("Mm hmm.", "Yeah.") and real interruptions. For each interruption policy
(immediate, provisional) the stages and the gateway start on 127.0.0.1, and callers (real
aiortc peers, real Opus, 8 to a process of their own) play the set under server_vad and
under semantic_vad (or one of them, --turn-detections), each caller in an order of its own
from a start of its own within 2 s (`--in-step`: all in the same order at once, so that their
turns end together). The variants are POLICY:CLASSIFIER,
the VAD's classifier webrtcvad or Silero; replies are made long (200 tokens) so that the
sounds fall inside them. All times are the caller's: end of speech is when the clip's last
voiced sample left the caller, first audio when the agent's first voiced frame reached it. The
callers receive as loadtest.conversation's do (gateway.aiortc_tuning: a one-frame jitter
buffer, the gateway's Opus coder), and each asks one question first on the fresh service, not
counted.

Reported per variant: end of speech to first agent audio p50/p95 for the questions, and to
the turn being called over (input_audio_buffer.speech_stopped reaching the caller), the part of
it the turn detection decides; premature
turn ends (the turn ended inside the pause); sounds over the agent that stopped it for good
(false barge-ins: the reply was cancelled) or only paused it; interruptions missed (the reply
was not cancelled) and the barge-in latency at the client (speech onset to the agent's audio
stopping); the gateway's event-loop lag p99 with the models on, and semantic_vad's decisions at
the pauses (ended at once, left to the window, held, overtaken) with the silence each came
after, what each model said, and how long the sound model and the words took. Prints JSON
and a table; writes results.json and table.md under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import datetime
import itertools
import json
import math
import multiprocessing as mp
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.bench import describe_machine, log, summary
from loadtest.caller_load import CALLERS_PER_PROCESS
from loadtest.settings import add_set_argument, setting_overrides

ROOT = Path(__file__).parents[1]
VOICES = ("piper", "espeak:en-us", "espeak:en-us+f3")
QUESTIONS = (
    "Can you tell me the weather in Paris today?",
    "How many legs does a spider have?",
    "What time does the train to Berlin leave?",
    "Which season comes after winter?",
)
BACKCHANNELS = ("Mm hmm.", "Yeah.")
INTERRUPTIONS = ("Wait, stop. What time is it?", "No, tell me about Berlin instead.")
PAUSES_MS = (300, 700)
RATE = 48_000
VOICED = 300  # |sample| above which a clip is speech
SILENT_RMS = 30.0  # what Opus silence decodes to, per received frame
SILENT_RUN = 10  # received frames of silence (200 ms) that say the agent stopped
MEDIA_STALL_S = 10.0  # a microphone not read for this long: the call's media is down
VARIANTS = ("immediate:webrtc", "provisional:webrtc", "provisional:silero")  # policy:classifier
TURN_DETECTIONS = ("server_vad", "semantic_vad")
START_SPREAD_S = 2.0  # callers in their own order start within this of each other


@dataclass
class Clip:
    kind: str  # question, paused_300, paused_700, cough, noise, backchannel, interruption
    voice: str
    text: str
    pcm: np.ndarray  # 48 kHz PCM16
    speech_start_s: float  # offsets of the first and last voiced samples in the clip
    speech_end_s: float
    pause_s: float = 0.0  # where a paused question's pause begins

    def label(self) -> dict[str, Any]:
        out = asdict(self)
        del out["pcm"]
        return out


def _voiced_span(pcm: np.ndarray) -> tuple[float, float]:
    voiced = np.nonzero(np.abs(pcm) > VOICED)[0]
    return voiced[0] / RATE, voiced[-1] / RATE


def _with_pause(pcm: np.ndarray, pause_ms: int) -> tuple[np.ndarray, float]:
    """The clip with `pause_ms` of silence cut in at its quietest 20 ms between 40 and 70 %
    of its speech (a gap between words), and where the pause begins."""
    start, end = (int(t * RATE) for t in _voiced_span(pcm))
    frame = RATE // 50
    lo, hi = start + int(0.4 * (end - start)), start + int(0.7 * (end - start))
    energy = [np.mean(pcm[i : i + frame].astype(np.float64) ** 2) for i in range(lo, hi, frame)]
    at = lo + int(np.argmin(energy)) * frame + frame // 2
    gap = np.zeros(RATE * pause_ms // 1000, np.int16)
    return np.concatenate([pcm[:at], gap, pcm[at:]]), at / RATE


def labelled_set(limit: int | None) -> list[Clip]:
    from loadtest.offline_quality import speak
    from loadtest.sounds import cough, noise_burst
    from stages.audio import resample

    clips: list[Clip] = []
    questions = QUESTIONS[:limit]
    for voice in VOICES:
        spoken = speak([*questions, *BACKCHANNELS, *INTERRUPTIONS], voice)
        for text, pcm in zip(questions, spoken, strict=False):
            clips.append(Clip("question", voice, text, pcm, *_voiced_span(pcm)))
            for pause_ms in PAUSES_MS:
                paused, at = _with_pause(pcm, pause_ms)
                kind = f"paused_{pause_ms}"
                clips.append(Clip(kind, voice, text, paused, *_voiced_span(paused), at))
        for text, pcm in zip(
            [*BACKCHANNELS, *INTERRUPTIONS], spoken[len(questions) :], strict=True
        ):
            kind = "backchannel" if text in BACKCHANNELS else "interruption"
            clips.append(Clip(kind, voice, text, pcm, *_voiced_span(pcm)))
    for seed in range(len(VOICES)):
        for kind, sound in (("cough", cough(seed)), ("noise", noise_burst(250, -20.0, seed))):
            pcm = np.concatenate([np.zeros(RATE // 5, np.int16), resample(sound, 16000, RATE)])
            clips.append(Clip(kind, f"seed {seed}", kind, pcm, *_voiced_span(pcm)))
    return clips


# -- the caller's side (a process of its own) ---------------------------------------------


def _voiced_frames(call: Any, since: float) -> list[float]:
    """Arrivals of the voiced frames received from `since` on. The frame log is in arrival
    order, so only its tail is read: a caller polls this every 20 ms over thousands of frames,
    and 32 callers in one process must keep their media on time."""
    arrivals, levels = call.speaker.arrivals, call.speaker.levels
    first = bisect.bisect_left(arrivals, since)
    tail = zip(arrivals[first:], levels[first:], strict=True)
    return [t for t, level in tail if level > SILENT_RMS]


def _stopped_at(call: Any, since: float) -> float | None:
    """The arrival of the first received frame after `since` that begins SILENT_RUN frames of
    silence: when the agent's audio stopped at the caller."""
    arrivals, levels = call.speaker.arrivals, call.speaker.levels
    for i in range(bisect.bisect_left(arrivals, since), len(arrivals)):
        run = levels[i : i + SILENT_RUN]
        if len(run) == SILENT_RUN and all(level <= SILENT_RMS for level in run):
            return arrivals[i]
    return None


class MediaDown(TimeoutError):
    """The caller's microphone is no longer read: the call's media has stopped."""


async def _clip_start(call: Any, n_clips: int) -> float:
    """When the clip played after `n_clips` others began to go out."""
    deadline = time.monotonic() + call.microphone.queued_s + MEDIA_STALL_S
    while len(call.microphone.clip_started) == n_clips:
        if time.monotonic() > deadline:
            raise MediaDown(f"the clip did not go out within {MEDIA_STALL_S} s")
        await asyncio.sleep(0.005)  # polling the microphone's clip log
    return call.microphone.clip_started[n_clips]


async def _quiet(call: Any) -> None:
    """Cancel whatever the agent says and wait until nothing more comes (the error a cancel
    gets when nothing is in progress is expected)."""
    deadline = time.monotonic() + call.microphone.queued_s + MEDIA_STALL_S
    while call.microphone.busy:  # the clip played to its end first
        if time.monotonic() > deadline:
            raise MediaDown(f"the microphone's audio did not go out within {MEDIA_STALL_S} s")
        await asyncio.sleep(0.02)
    for _ in range(5):
        call.send({"type": "response.cancel"})
        deadline = time.monotonic() + 1.5
        again = False
        while not again and (left := deadline - time.monotonic()) > 0:
            try:
                event = await call.next_event("response.created", "error", timeout=left)
            except TimeoutError:
                break
            again = event["type"] == "response.created"
        if not again:
            return


async def _question(call: Any, clip: Clip) -> dict[str, Any]:
    n_clips = len(call.microphone.clip_started)
    seen = len(call.history)
    call.microphone.play(clip.pcm)
    end = await _clip_start(call, n_clips) + clip.speech_end_s
    deadline = end + 15
    while not _voiced_frames(call, end) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)  # polling the receiver's frame log
    first = _voiced_frames(call, end)
    stopped = [
        t for t, e in call.history[seen:] if e["type"] == "input_audio_buffer.speech_stopped"
    ]
    await _quiet(call)
    return {
        "premature": any(t < end for t in stopped),
        "first_audio_ms": round((first[0] - end) * 1000, 1) if first else None,
        # when the turn was called over (the event's arrival): first audio is this plus the
        # reply's own time after it
        "turn_end_ms": round((stopped[-1] - end) * 1000, 1) if stopped else None,
    }


async def _reply_started(call: Any) -> str:
    """Ask the agent to speak; the id of its reply. On a loaded machine the answer to the
    caller's last turn can start after `_quiet` gave up waiting for it: the server refuses the
    ask then, and that answer is cancelled and the ask made again."""
    for _ in range(3):
        call.send({"type": "response.create"})
        try:
            created = await call.next_event("response.created", timeout=30)
        except RuntimeError as exc:  # an error event
            if "conversation_already_has_active_response" not in str(exc):
                raise
            await _quiet(call)
            continue
        return str(created["response"]["id"])
    raise RuntimeError("a reply of the caller's last turn kept the agent busy")


async def _over_the_agent(call: Any, clip: Clip) -> dict[str, Any]:
    response_id = await _reply_started(call)
    deadline = time.monotonic() + 30
    while len(_voiced_frames(call, time.monotonic() - 0.1)) < 3:
        if time.monotonic() > deadline:
            raise TimeoutError("the agent's audio never came")
        await asyncio.sleep(0.02)  # polling the receiver's frame log
    await asyncio.sleep(0.4)  # into the reply, as a listener reacts
    n_clips = len(call.microphone.clip_started)
    call.microphone.play(clip.pcm)
    started = await _clip_start(call, n_clips)
    onset, end = started + clip.speech_start_s, started + clip.speech_end_s
    cancelled = False
    while time.monotonic() < end + 4.0:  # time for the transcript to decide, and the stop
        cancelled = any(
            e["type"] == "response.done"
            and e["response"]["id"] == response_id
            and e["response"]["status"] == "cancelled"
            for _, e in call.history
        )
        if cancelled and time.monotonic() > end + 1.0 and _stopped_at(call, onset):
            break
        await asyncio.sleep(0.05)  # polling the event log
    stopped = _stopped_at(call, onset)
    await _quiet(call)
    return {
        "cancelled": cancelled,
        "paused": stopped is not None and stopped < onset + 1.0,
        "stop_ms": round((stopped - onset) * 1000, 1) if stopped is not None else None,
    }


async def _caller(
    base: str, clips: list[Clip], turn_detection: str, wait_s: float = 0.0
) -> list[dict[str, Any]]:
    from gateway.client import RealtimeCall

    call = await RealtimeCall.connect(base)
    out = []
    try:
        await call.next_event("session.created")
        td = {"type": turn_detection}
        update = {"audio": {"input": {"turn_detection": td}}}
        call.send({"type": "session.update", "session": update})
        await call.next_event("session.updated", timeout=10)
        await asyncio.sleep(wait_s)  # where this caller starts (caller_order)
        down: str | None = None
        for clip in clips:
            trial = _question if clip.kind.startswith(("question", "paused")) else _over_the_agent
            try:
                if down is not None:
                    raise MediaDown(down)
                result = await trial(call, clip)
            except (MediaDown, ConnectionError) as exc:  # the rest of this caller's clips are
                down = down or f"{exc} (connection {call.pc.connectionState})"  # not tried
                result = {"error": down}
            except (TimeoutError, RuntimeError) as exc:  # RuntimeError: an error event
                result = {"error": str(exc) or "timed out"}
                try:
                    await _quiet(call)
                except (MediaDown, ConnectionError) as stalled:
                    down = f"{stalled} (connection {call.pc.connectionState})"
            out.append({"kind": clip.kind, "voice": clip.voice, "text": clip.text, **result})
    finally:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10):  # a call whose media is down may not close cleanly
                await call.close()
    return out


def caller_order(clips: list[Clip], caller: int, in_step: bool) -> tuple[list[Clip], float]:
    """The clips caller number `caller` plays, in order, and how long it waits before the
    first. In step, every caller plays the set as it is, at once: their turns end together,
    the worst case for the stages. Otherwise each plays it in an order of its own and starts
    at a point of its own within START_SPREAD_S, as callers who do not know of each other
    would; both are the same from one run to the next (seeded by the caller's number)."""
    if in_step:
        return list(clips), 0.0
    rng = random.Random(caller)
    order = list(clips)
    rng.shuffle(order)
    return order, rng.uniform(0.0, START_SPREAD_S)


def _callers_process(
    base: str,
    first: int,
    n: int,
    clips: list[Clip],
    turn_detection: str,
    opus: str,
    in_step: bool,
    conn,
) -> None:
    import traceback

    from gateway import aiortc_tuning
    from gateway.ice import restrict_host_addresses

    async def run() -> list[list[dict[str, Any]]]:
        orders = [caller_order(clips, first + i, in_step) for i in range(n)]
        callers = (_caller(base, order, turn_detection, wait_s) for order, wait_s in orders)
        return list(await asyncio.gather(*callers))

    try:
        # the receive side as loadtest.conversation's callers have it (a jitter buffer of one
        # frame instead of aiortc's four, about 80 ms sooner) and the gateway's Opus coder
        aiortc_tuning.apply(1, opus=opus)
        restrict_host_addresses(["127.0.0.1"])
        conn.send(asyncio.run(run()))
    except Exception:
        conn.send({"error": traceback.format_exc()})


async def _run_callers(
    base: str,
    n: int,
    clips: list[Clip],
    turn_detection: str,
    opus: str = "opuslib",
    per_process: int = CALLERS_PER_PROCESS,
    in_step: bool = False,
) -> list[list[dict[str, Any]]]:
    """Each caller's trials, the callers spread over processes of `per_process` (one event
    loop carrying 32 WebRTC peers and their audio would add its own lag to what is
    measured); a process that fails or sends nothing in time gives each of its callers one
    trial saying so."""
    ctx = mp.get_context("spawn")
    procs = []
    for i in range(math.ceil(n / per_process)):
        k = min(per_process, n - i * per_process)
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_callers_process,
            args=(base, i * per_process, k, clips, turn_detection, opus, in_step, child),
        )
        proc.start()
        child.close()
        procs.append((proc, parent, k))
    budget = 120 + START_SPREAD_S + 25 * len(clips)
    deadline = time.monotonic() + budget  # one for all: the processes run at once
    trials: list[list[dict[str, Any]]] = []
    try:
        for _, parent, k in procs:
            left = max(0.0, deadline - time.monotonic())
            report = parent.recv() if await asyncio.to_thread(parent.poll, left) else None
            if isinstance(report, list):
                trials.extend(report)
                continue
            why = report["error"] if report else f"the callers sent no report within {budget} s"
            trials.extend([[{"kind": "callers_process", "error": why}] for _ in range(k)])
    finally:
        for proc, parent, _ in procs:
            await asyncio.to_thread(proc.join, 30)
            if proc.is_alive():
                proc.kill()
            parent.close()
    return trials


# -- the service's side --------------------------------------------------------------------


def _lag_p99_ms(gateway: Any) -> float | None:
    """The 99th percentile of the gateway's event-loop lag, from its histogram's buckets."""
    hist = gateway.metrics.loop_lag
    samples = [s for m in hist.collect() for s in m.samples if s.name.endswith("_bucket")]
    total = max((s.value for s in samples), default=0)
    if not total:
        return None
    for s in sorted(samples, key=lambda s: float(s.labels["le"])):
        if s.value >= 0.99 * total:
            return float(s.labels["le"]) * 1000
    return None


def _semantic_decisions(gateway: Any) -> dict[str, Any]:
    """semantic_vad's decisions at pauses and how the words' judgement came, counted by the
    first gateway process (the calls it carried)."""
    out: dict[str, Any] = {}
    for metric in gateway.metrics.end_of_turn_decisions.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                out[s.labels["decision"]] = int(s.value)
    for metric in gateway.metrics.end_of_turn_words.collect():
        sums = {s.labels["outcome"]: s.value for s in metric.samples if s.name.endswith("_sum")}
        for s in metric.samples:
            if s.name.endswith("_count") and s.value:
                outcome = s.labels["outcome"]
                out[f"words_{outcome}"] = int(s.value)
                out[f"words_{outcome}_mean_ms"] = round(1000 * sums[outcome] / s.value, 1)
    # the sound model's time a prediction (its queue included), and the caller's silence when
    # each kind of decision was made
    for name, histogram, label in (
        ("sound_model", gateway.metrics.end_of_turn, None),
        ("decided_after", gateway.metrics.end_of_turn_decided_after, "decision"),
    ):
        for metric in histogram.collect():
            sums = {s.labels.get(label): s.value for s in metric.samples if s.name.endswith("_sum")}
            for s in metric.samples:
                if s.name.endswith("_count") and s.value:
                    key = name if label is None else f"{name}_{s.labels[label]}"
                    out[f"{key}_mean_ms"] = round(1000 * sums[s.labels.get(label)] / s.value, 1)
    # what each model said, by decision: the count in each probability bucket
    for metric in gateway.metrics.end_of_turn_probability.collect():
        for s in metric.samples:
            if s.name.endswith("_bucket") and s.value:
                key = f"p_{s.labels['model']}_{s.labels['decision']}"
                out.setdefault(key, {})[s.labels["le"]] = int(s.value)
    return out


def variant_config(variant: str, args: Any, chosen: tuple[tuple[str, Any], ...] = ()) -> Any:
    """The service's configuration for POLICY:CLASSIFIER and the `--set` values `chosen`: the
    config file's, or the GPU layout's with its built models, replies made long enough for
    sounds to fall inside."""
    from gateway.config import load_config

    policy, _, classifier = variant.partition(":")
    settings = {
        "gateway.port": 0,
        "gateway.turns.interruptions.policy": policy,
        "gateway.turns.vad.classifier": classifier or "webrtc",
        "reasoning.sampling.max_tokens": 200,
        "reasoning.sampling.ignore_eos": True,
        **setting_overrides(chosen),
    }
    if args.layout is None:
        return load_config(args.config, settings)
    from loadtest.gpu_layouts import Variant, layout_config

    config, _ = layout_config(
        args.layout,
        args.models,
        args.gpu_count,
        args.device,
        Variant(settings=tuple(settings.items())),
    )
    return config


async def run_variant(
    variant: str,
    clips: list[Clip],
    args: Any,
    measured: Callable[[str, dict], None],
    chosen: tuple[tuple[str, Any], ...] = (),
    name: str | None = None,
) -> None:
    """Each of `args.turn_detections` at each load of `args.callers`, handed to `measured` as
    it is done (so that a run cut short keeps what it measured); `name`: the variant's in the
    log, POLICY:CLASSIFIER with the `--set` values `chosen` it differs by."""
    from loadtest.tap import tapped_gateway
    from stages.supervisor import Supervisor

    config = variant_config(variant, args, chosen)
    shown = name or variant
    with Supervisor(config, gateways=config.gateway.processes) as supervisor:
        supervisor.start(progress=log)
        async with tapped_gateway(config, supervisor) as (base, gateway, _):
            for callers in args.callers:
                # each caller's first turn on a fresh service is slow (1.3-1.7 s on the H200,
                # whatever the turn detection): one question each first, not counted
                log(f"{shown}: warm-up, {callers} caller(s), one question each")
                opus, per_process = config.experiments.opus, args.callers_per_process
                warm_up, td0 = clips[:1], TURN_DETECTIONS[0]
                await _run_callers(base, callers, warm_up, td0, opus, per_process, in_step=True)
                for td in args.turn_detections:
                    log(f"{shown} / {td}: {callers} caller(s), {len(clips)} clips each")
                    metrics = gateway.metrics  # the first gateway process's
                    for metric in (
                        metrics.loop_lag,
                        metrics.end_of_turn_decisions,
                        metrics.end_of_turn_words,
                        metrics.end_of_turn,
                        metrics.end_of_turn_decided_after,
                        metrics.end_of_turn_probability,
                    ):
                        metric.clear()
                    reports = await _run_callers(
                        base, callers, clips, td, opus, per_process, args.in_step
                    )
                    measured(
                        f"{td} {callers}",
                        {
                            "trials": reports,
                            "loop_lag_p99_ms": _lag_p99_ms(gateway),
                            "semantic_decisions": _semantic_decisions(gateway),
                        },
                    )


def figures(trials: list[dict[str, Any]]) -> dict[str, Any]:
    def of(*kinds: str) -> list[dict[str, Any]]:
        return [t for t in trials if t["kind"] in kinds and "error" not in t]

    questions = of("question", "paused_300", "paused_700")
    sounds = of("cough", "noise", "backchannel")
    real = of("interruption")
    answered = [t for t in questions if not t["premature"] and t["first_audio_ms"]]
    first = [t["first_audio_ms"] for t in answered]
    out: dict[str, Any] = {
        "first_audio_ms": summary(first, 50, 95),
        "turn_end_ms": summary(
            [t["turn_end_ms"] for t in answered if t.get("turn_end_ms")], 50, 95
        ),
        "unanswered": sum(t["first_audio_ms"] is None for t in questions),
        "errors": sum("error" in t for t in trials),
    }
    for kind in ("question", "paused_300", "paused_700"):
        group = of(kind)
        out[f"premature_{kind}"] = f"{sum(t['premature'] for t in group)}/{len(group)}"
    for kind in ("cough", "noise", "backchannel"):
        group = of(kind)
        out[f"false_barge_in_{kind}"] = f"{sum(t['cancelled'] for t in group)}/{len(group)}"
        out[f"paused_{kind}"] = f"{sum(t['paused'] for t in group)}/{len(group)}"
    out["false_barge_ins"] = f"{sum(t['cancelled'] for t in sounds)}/{len(sounds)}"
    out["missed_barge_ins"] = f"{sum(not t['cancelled'] for t in real)}/{len(real)}"
    out["barge_in_ms"] = summary([t["stop_ms"] for t in real if t["stop_ms"] is not None], 50, 95)
    return out


def table(results: dict[str, Any]) -> str:
    lines = [
        f"machine: {results['machine'].get('cpus')} CPUs, GPUs {results['machine'].get('gpus')}; "
        f"config {results['config']}; callers {results['callers']}",
        "",
        "| policy:classifier | turn detection, callers | first audio p50 / p95 ms "
        "| turn called p50 / p95 ms "
        "| premature 300 / 700 ms pause | false barge-ins (cough, noise, backchannel) "
        "| paused by them | missed barge-ins "
        "| barge-in p50 / p95 ms | loop lag p99 ms |",
        "|---|---|---:|---:|---|---|---|---|---:|---:|",
    ]
    for policy, by_td in results["policies"].items():
        for td, r in by_td.items():
            f = r["figures"]
            if "error" in f:
                lines.append(f"| {policy} | {td} | the callers failed: see results.json |")
                continue
            fa, bi, te = f["first_audio_ms"], f["barge_in_ms"], f.get("turn_end_ms", {})
            paused = ", ".join(f[f"paused_{k}"] for k in ("cough", "noise", "backchannel"))
            false = ", ".join(f[f"false_barge_in_{k}"] for k in ("cough", "noise", "backchannel"))
            lines.append(
                f"| {policy} | {td} | {fa.get('p50')} / {fa.get('p95')} "
                f"| {te.get('p50')} / {te.get('p95')} "
                f"| {f['premature_paused_300']} / {f['premature_paused_700']} | {false} "
                f"| {paused} | {f['missed_barge_ins']} | {bi.get('p50')} / {bi.get('p95')} "
                f"| {r['loop_lag_p99_ms']} |"
            )
    return "\n".join(lines)


def _shown(path: Path) -> str:
    """A config's path as the project names it (relative to the checkout where it is in it)."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "offline.yaml")
    parser.add_argument(
        "--layout",
        default=None,
        help="a loadtest.gpu_layouts layout (one, talker, ...) instead of --config, its models "
        "under --models-root",
    )
    parser.add_argument("--models-root", type=Path, default=Path(".cache/gpu-models"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="--layout's")
    parser.add_argument(
        "--callers",
        type=lambda text: [int(n) for n in text.split(",") if n],
        default=[1],
        help="calls at once, each the whole set; several loads as 1,8,32",
    )
    parser.add_argument(
        "--callers-per-process",
        type=int,
        default=CALLERS_PER_PROCESS,
        help="WebRTC callers a load generator process carries",
    )
    parser.add_argument("--limit", type=int, default=None, help="only the first N questions")
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="POLICY:CLASSIFIER each (immediate or provisional; webrtc or silero)",
    )
    parser.add_argument("--out", type=Path, default=Path("out/turn-taking"))
    parser.add_argument(
        "--turn-detections",
        type=lambda text: [td for td in text.split(",") if td],
        default=list(TURN_DETECTIONS),
        help="which to run at each load and variant, of server_vad,semantic_vad",
    )
    parser.add_argument(
        "--in-step",
        action="store_true",
        help="every caller plays the set in the same order at once, so that their turns end "
        "together (the stages' worst case); by default each plays it in an order of its own, "
        f"starting within {START_SPREAD_S:g} s of the others",
    )
    add_set_argument(parser, "gateway.turns.prepare_reply_ms=120,80")
    args = parser.parse_args(argv)
    if not args.turn_detections or set(args.turn_detections) - set(TURN_DETECTIONS):
        parser.error(f"--turn-detections {args.turn_detections}: of {', '.join(TURN_DETECTIONS)}")
    if args.callers_per_process < 1:
        parser.error(f"--callers-per-process {args.callers_per_process}: at least 1")
    if not args.callers or min(args.callers) < 1:
        parser.error(f"--callers {args.callers}: at least one load of at least 1 caller")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.layout is not None:
        from loadtest.gpu_layouts import LAYOUT_CONFIGS, build_models
        from stages.placement import count_gpus

        if args.layout not in LAYOUT_CONFIGS:
            parser.error(f"--layout {args.layout!r}: one of {', '.join(LAYOUT_CONFIGS)}")
        args.gpu_count = count_gpus() if args.device == "cuda" else 0
        preset = "real" if args.device == "cuda" else "tiny"
        log(f"building the {preset} models of layout {args.layout} under {args.models_root}")
        args.models = build_models(args.models_root, args.device, preset)
    log("making the labelled set")
    clips = labelled_set(args.limit)
    results: dict[str, Any] = {
        "benchmark": "turn_taking",
        "date": datetime.date.today().isoformat(),
        "command": "python -m loadtest.turn_taking " + " ".join(argv or sys.argv[1:]),
        "machine": describe_machine(),
        "config": _shown(args.config) if args.layout is None else f"layout {args.layout}",
        "callers": args.callers,
        "clips": [c.label() for c in clips],
        "policies": {},
    }
    # every combination of the --set values is a variant of each policy, named by the keys
    # that take more than one value (no spaces: stage_log reads the name back)
    varied = {key for dimension in args.set if len(dimension) > 1 for key, _ in dimension}
    combinations = list(itertools.product(*args.set))
    for variant, chosen in itertools.product(args.variants.split(","), combinations):
        name = variant + "".join(f"+{k}={v}" for k, v in chosen if k in varied)
        by_td = results["policies"].setdefault(name, {})

        def measured(
            key: str, r: dict[str, Any], by_td: dict[str, Any] = by_td, name: str = name
        ) -> None:
            flat = [t for caller in r["trials"] for t in caller]
            r["figures"] = figures(flat) if flat else {"error": "no trial"}
            by_td[key] = r
            (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
            log(f"{name} / {key} callers: {json.dumps(r['figures'])}")

        asyncio.run(run_variant(variant, clips, args, measured, chosen, name))
    text = table(results)
    (args.out / "table.md").write_text(text + "\n")
    summary_json = {
        p: {td: r["figures"] for td, r in by_td.items()} for p, by_td in results["policies"].items()
    }
    print(json.dumps({"machine": results["machine"], "figures": summary_json}))
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
