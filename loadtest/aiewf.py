"""The timing part of the public aiewf-eval benchmark (github.com/kwindla/aiewf-eval, MIT),
run with its own harness against the gateway's `/v1/realtime` WebSocket.

aiewf-eval drives a 30-turn spoken conversation (`benchmarks/_shared/turns.py`, one 24 kHz WAV
a turn in `benchmarks/_shared/audio/`) through pipecat 1.3.0's `OpenAIRealtimeLLMService` in
its `RealtimePipeline` (`src/multi_turn_eval/pipelines/realtime.py`). It asks for a greeting
first ("Greet the user briefly.", then waits up to 8 s for it to start). The WAVs are played
in real time in 20 ms chunks, silence streaming between them (`transports/paced_input.py`); the
server's VAD ends each turn; the agent's audio is "played" in real time
(`transports/null_audio_output.py`, which also mixes a 2 kHz beep into the first reply frame
after each user stop); the next turn is queued 0.5 s after the reply has played out, and not
before the current WAV has ended (`TurnGate`, `_on_turn_end`). In pipecat 1.3.0 a reply has
played out at its `response.done` or once no audio has come for 3 s (BOT_VAD_STOP_FALLBACK_SECS;
the harness's raising of BOT_VAD_STOP_SECS to 2 s applies to another kind of frame). Both
directions are recorded on one wall clock into a stereo `conversation.wav` (user left, agent
right). Its `scripts/analyze_turn_metrics.py` measures voice-to-voice latency per turn from
that recording: Silero VAD on each channel (threshold 0.7, 2 s min silence, 0.7 s min speech),
the agent's speech segment nearest its beep, minus the end of the user's segment just before it
("WAV V2V"). Its `judging/turn_taking.py` flags turns that did not take turns cleanly (the
channels overlapping, a reply begun before the user ended, replies missing, orphaned or over
5 s late, retries); only that part of its judge runs here: the rest needs a hosted model.

This module runs that harness code unchanged, in-process, with these of ours around it: the
service class (pipecat's, at `--base-url` instead of OpenAI; it also logs the session's events,
without audio, to `events.jsonl`, and notes the gateway's `error` events), the benchmark's
instructions cut to fit the offline model's context (`--instructions`, below), Silero loaded
from the silero-vad package instead of `torch.hub` (no network here; the same ONNX model and
`get_speech_timestamps`), and nltk's punkt_tab replaced by empty parameters (see use_harness).
Besides aiewf-eval's own figures it reports the turns that ran together (`ran_together`) and
where a reply's audio ran dry mid-reply (`audio_stalls`).

Instructions: aiewf_medium_context sends about 12,900 tokens (SmolLM2's tokenizer) of
instructions; the offline profile's model holds 2,048 in all and the gateway refuses a session
whose instructions and tools leave no room for a reply (`context_length_exceeded`). `short`
(default) keeps the benchmark's system prompt up to its KNOWLEDGE BASE heading: its persona,
primary instructions and recommendation instructions, 950 tokens, verbatim; the knowledge base
(~11,000 tokens) and the tools section's prose (~1,000) are dropped, the five tools still go as
session tools (~455). `full` sends it whole, to show the refusal.

Set-up (once): a copy of aiewf-eval, its turn WAVs included (30 files, 6 MB, read from there,
not copied into this repository): a checkout, or a bare clone, whose HEAD's `src`, `scripts` and
`benchmarks` are then extracted under `--out` (commit 9526aac tested). The first run installs
pipecat 1.3.0 (tests/clients/pipecat-1.3.0.txt) and the rest the harness imports
(loadtest/aiewf-harness.txt, about 200 MB), pinned and hash-checked, into .venv/clients.

    git clone https://github.com/kwindla/aiewf-eval /path/to/aiewf-eval

Run, against a gateway started apart (`omni-gateway start --config configs/offline.yaml`).
The first reply after the gateway starts is slow (vLLM's first step): run one turn first, or
the greeting misses the harness's 8 s and is cut by turn 0.

    .venv/bin/python -m loadtest.aiewf --base-url http://127.0.0.1:8080 \
        --repo /path/to/aiewf-eval --turns 10 --out out/aiewf

It prints its JSON and a table and writes them (results.json, table.md) under `--out`, beside
the harness's own run directory (`run/`: conversation.wav, run.log, transcript.jsonl,
events.jsonl). Exit status 1 when the run did not complete or anything went wrong.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.bench import describe_machine, log, pct, publish

ROOT = Path(__file__).resolve().parents[1]
PIPECAT = ROOT / ".venv" / "clients" / "pipecat-1.3.0"
HARNESS = ROOT / ".venv" / "clients" / "pipecat-1.3.0-harness"
BENCHMARK = "aiwf_medium_context"
# The harness keys its OpenAI Realtime behaviour on the name: "gpt…realtime" gets the greeting
# it triggers with LLMRunFrame. The gateway echoes it and answers with its configured model.
MODEL = "gpt-realtime"
KNOWLEDGE_BASE_HEADING = "\n---\n### **KNOWLEDGE BASE**"
TURNS_IN_BENCHMARK = 30


def install_pinned(pins: Path, target: Path) -> None:
    """The packages `pins` names, hash-checked, into `target`, once (as scripts/setup.sh
    installs tests/clients/*.txt)."""
    stamp = target / f".omni-gateway-{hashlib.sha1(pins.read_bytes()).hexdigest()[:12]}"
    if stamp.exists():
        return
    log(f"installing {pins.name} into {target}")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--require-hashes"]
    pip += ["--only-binary=:all:", "--target", str(target), "-r", str(pins)]
    subprocess.run(pip, check=True)
    stamp.touch()


def use_harness(repo: Path) -> None:
    """Put pipecat 1.3.0, the rest of what the harness imports (installed here the first
    time), and aiewf-eval's own code on the import path, ahead of the venv's."""
    install_pinned(ROOT / "tests" / "clients" / "pipecat-1.3.0.txt", PIPECAT)
    install_pinned(ROOT / "loadtest" / "aiewf-harness.txt", HARNESS)
    missing = [
        f"{path} (a git clone of kwindla/aiewf-eval)"
        for path in (repo / "src" / "multi_turn_eval", repo / "benchmarks" / "_shared" / "audio")
        if not path.exists()
    ]
    if missing:
        raise SystemExit("missing: " + "; ".join(missing) + " (see loadtest/aiewf.py)")
    for path in (repo, repo / "src", PIPECAT, HARNESS):
        sys.path.insert(0, str(path))
    # pipecat.utils.string downloads nltk's punkt_tab at import when it is missing, and pipecat's
    # RTVI observer (on by default) splits the agent's transcript into sentences with it. No
    # network here but the package registries: nothing is downloaded, and punkt_tab with empty
    # parameters (no abbreviations or collocations learnt) stands in, enough for that observer,
    # which only words RTVI messages to a client UI and plays no part in the timing.
    import nltk

    nltk.download = lambda *args, **kwargs: False
    english = HARNESS / "nltk_data" / "tokenizers" / "punkt_tab" / "english"
    english.mkdir(parents=True, exist_ok=True)
    for name in ("collocations.tab", "sent_starters.txt", "abbrev_types.txt", "ortho_context.tab"):
        (english / name).touch()
    nltk.data.path.insert(0, str(HARNESS / "nltk_data"))


def cut_instructions(full: str, mode: str) -> str:
    """The benchmark's instructions as sent: whole, or up to its knowledge base (module doc)."""
    if mode == "full":
        return full
    head, found, _ = full.partition(KNOWLEDGE_BASE_HEADING)
    if not found:
        raise SystemExit("aiewf-eval's instructions have no KNOWLEDGE BASE heading to cut at")
    return head.strip()


def ws_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    base = re.sub(r"^http", "ws", base)
    return base if base.endswith("/v1/realtime") else f"{base}/v1/realtime"


class EventLog:
    """The session's events both ways, on the recording's clock (time.time()), into
    events.jsonl: types and what tells a reply's course, no audio (appends are counted, and an
    audio delta is logged as its length in ms)."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("w")
        self.appends = 0

    def write(self, direction: str, event: dict[str, Any]) -> None:
        kind = event.get("type", "?")
        if kind == "input_audio_buffer.append":
            self.appends += 1
            return
        row: dict[str, Any] = {"t": round(time.time(), 3), "dir": direction, "type": kind}
        if kind == "response.output_audio.delta":
            # base64 of PCM16 mono 24 kHz: 4 characters are 3 bytes, 48 bytes a ms
            row["audio_ms"] = round(len(event.get("delta") or "") * 3 / 4 / 48, 1)
        for key in ("event_id", "item_id", "response_id", "call_id", "name", "audio_start_ms"):
            if event.get(key) is not None:
                row[key] = event[key]
        if kind == "error":
            row["error"] = event.get("error")
        if kind in ("response.done", "response.created"):
            response = event.get("response") or {}
            row["status"] = response.get("status")
            row["status_details"] = response.get("status_details")
            row["id"] = response.get("id")
        if kind in ("conversation.item.added", "conversation.item.create"):
            item = event.get("item") or {}
            row["item"] = {k: item.get(k) for k in ("id", "type", "role", "name") if item.get(k)}
        if kind.endswith("transcription.completed") or kind.endswith("transcript.done"):
            row["transcript"] = event.get("transcript")
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.write(json.dumps({"input_audio_buffer.append": self.appends}) + "\n")
        self.file.close()


def gateway_service(
    url: str, errors: list[dict[str, Any]], stop: asyncio.Event, events_log: EventLog
) -> type:
    """pipecat's OpenAIRealtimeLLMService at `url`, recording what broke the session: the
    gateway's `error` events (pipecat stops reading at the first one whose code it does not
    excuse), failed replies, and events its parser refused. `stop` is set when pipecat will
    read no more of the gateway's events, so that the run ends instead of retrying turns
    nothing answers. The name keeps "OpenAIRealtime": the harness configures by it."""
    from pipecat.services.openai.realtime import events
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

    parse_server_event = events.parse_server_event

    def parse_and_log(message: str) -> Any:
        with contextlib.suppress(ValueError, AttributeError):
            events_log.write("in", json.loads(message))
        return parse_server_event(message)

    events.parse_server_event = parse_and_log  # pipecat's receive loop calls it by this name

    def note(kind: str, **fields: Any) -> None:
        errors.append({"kind": kind, "at": round(time.time(), 3), **fields})

    class GatewayOpenAIRealtimeLLMService(OpenAIRealtimeLLMService):
        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("base_url", url)
            super().__init__(**kwargs)

        async def send_client_event(self, event: Any) -> None:
            events_log.write("out", event.model_dump(exclude_none=True))
            await super().send_client_event(event)

        async def _handle_evt_error(self, evt: Any) -> None:
            error = evt.error
            note(
                "error_event",
                code=getattr(error, "code", None),
                type=getattr(error, "type", None),
                param=getattr(error, "param", None),
                event_id=getattr(error, "event_id", None),
                message=getattr(error, "message", None),
            )
            await super()._handle_evt_error(evt)

        async def _handle_evt_response_done(self, evt: Any) -> None:
            if evt.response.status == "failed":
                note("response_failed", details=evt.response.status_details)
            await super()._handle_evt_response_done(evt)

        async def _receive_task_handler(self) -> None:
            try:
                await super()._receive_task_handler()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an event pipecat's parser refused, or a closed socket
                note("receive_failed", message=str(exc)[:2000])
                stop.set()
                raise
            if not self._disconnecting:
                note("receive_stopped", message="pipecat stopped reading the gateway's events")
                stop.set()

    return GatewayOpenAIRealtimeLLMService


def setup_logging(run_dir: Path, verbose: bool) -> None:
    """As aiewf-eval's cli.setup_logging (run.log at DEBUG, which its analysis parses), with
    the console at WARNING unless `verbose`."""
    from loguru import logger

    logger.remove()
    logger.add(
        sys.stderr, level="INFO" if verbose else "WARNING", format="<level>{message}</level>"
    )
    logger.add(
        run_dir / "run.log",
        level="DEBUG",
        format="{time:YYYY-MM-DD HH:mm:ss.SSS} {level} {name}: {message}",
    )


async def run_harness(
    args: argparse.Namespace, run_dir: Path, errors: list[dict[str, Any]]
) -> dict[str, Any]:
    """aiewf-eval's `multi-turn-eval run aiwf_medium_context --service openai-realtime`, as its
    cli._run does it, on the gateway."""
    import importlib

    from multi_turn_eval.pipelines.realtime import RealtimePipeline
    from multi_turn_eval.recording.transcript_recorder import TranscriptRecorder

    config = importlib.import_module(f"benchmarks.{BENCHMARK}.config").BenchmarkConfig
    instructions = cut_instructions(config.system_instruction, args.instructions)

    class Benchmark(config):
        system_instruction = instructions

    os.environ["OPENAI_API_KEY"] = args.api_key  # the harness reads it; auth may be off
    stop = asyncio.Event()
    events_log = EventLog(run_dir / "events.jsonl")
    service = gateway_service(ws_url(args.base_url), errors, stop, events_log)
    recorder = TranscriptRecorder(run_dir, MODEL)
    pipeline = RealtimePipeline(Benchmark())
    run = asyncio.create_task(
        pipeline.run(
            recorder=recorder,
            model=MODEL,
            service_class=service,
            service_name="openai-realtime",
            turn_indices=list(range(args.turns)),
        )
    )
    stopped = asyncio.create_task(stop.wait())
    started = time.monotonic()
    outcome = "completed"
    try:
        await asyncio.wait({run, stopped}, timeout=args.timeout, return_when="FIRST_COMPLETED")
        if not run.done():
            outcome = "receive_stopped" if stop.is_set() else "timeout"
            errors.append({"kind": "run_cut", "message": f"run ended by loadtest.aiewf: {outcome}"})
            if stop.is_set():
                await asyncio.sleep(1.0)  # what pipecat already had flows through first
            if pipeline.task is not None:
                await pipeline.task.cancel()
        await asyncio.wait_for(run, 30)
    except Exception as exc:
        outcome = "failed"
        errors.append({"kind": "harness_failed", "message": f"{type(exc).__name__}: {exc}"})
    finally:
        stopped.cancel()
        recorder.close()
        events_log.close()
    transport = pipeline.output_transport
    return {
        "outcome": outcome,
        # time.time() of the recording's 0 (NullAudioOutputTransport's baseline)
        "recording_start": getattr(transport, "_recording_start_time", None) or None,
        "wall_s": round(time.monotonic() - started, 1),
        "turns_done": pipeline.turn_idx,  # the turns whose reply ended
        "instructions_chars": len(instructions),
        "failure": getattr(pipeline, "_run_failure", None),
    }


def analyse(run_dir: Path) -> dict[str, Any]:
    """aiewf-eval's own timing analysis and turn-taking checks of the run's recording."""
    import scripts.analyze_turn_metrics as atm
    from multi_turn_eval.judging import turn_taking
    from silero_vad import get_speech_timestamps, load_silero_vad

    atm.load_silero_vad = lambda: (load_silero_vad(onnx=True), get_speech_timestamps)
    segments: dict[str, list[dict[str, float]]] = {}
    run_silero_vad = atm.run_silero_vad

    def keep_segments(*args: Any, **kwargs: Any) -> tuple[list[dict], list[dict]]:
        segments["user"], segments["bot"] = run_silero_vad(*args, **kwargs)
        return segments["user"], segments["bot"]

    atm.run_silero_vad = keep_segments
    turns, alignment, summary = atm.analyze_run(run_dir)
    metrics = {
        "summary": summary,
        "segments": segments,
        "turns": [
            {
                "turn": t.turn_index,
                "server_ttfb_ms": t.server_ttfb_ms,
                "pipeline_ttfb_ms": t.pipeline_ttfb_ms,
                "wav_v2v_ms": t.wav_v2v_ms,
                "silent_pad_rms_ms": t.silent_pad_rms_ms,
                "silent_pad_silero_ms": t.silent_pad_silero_ms,
                "tag_alignment_ms": t.tag_alignment_ms,
                "has_tool_call": t.has_tool_call,
                "user_start_ms": t.user_start_ms,
                "user_end_ms": t.user_end_ms,
                "bot_tag_log_ms": t.bot_tag_log_ms,
                "bot_tag_wav_ms": t.bot_tag_wav_ms,
                "bot_silero_start_ms": t.bot_silero_start_ms,
                "bot_silero_end_ms": t.bot_silero_end_ms,
                "retry_count": t.retry_count,
                "retry_reasons": t.retry_reasons,
                "reconnection_count": t.reconnection_count,
            }
            for t in turns
        ],
    }
    # its judge runs analyze_turn_metrics.py --json through `uv run`; the same, in-process
    turn_taking.analyze_turn_metrics_json = lambda _run_dir: metrics
    taking = turn_taking.analyze_turn_taking(run_dir)
    metrics["alignment"] = {"ok": alignment.alignment_ok, "issues": alignment.issues}
    metrics["turn_taking"] = taking.to_dict()
    return metrics


def ran_together(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """Turns that ran together, read from the same Silero segments as aiewf-eval's overlap
    check: a reply still playing when the next user turn began, a reply begun before its user
    turn ended, and two user turns (speech apart by 2 s or more) before one reply. (Beside
    these the report lists the replies the gateway cancelled: cancelled_replies.)"""
    summary = metrics["summary"]
    by_bot_start = {
        t["bot_silero_start_ms"]: t["turn"]
        for t in metrics["turns"]
        if t["bot_silero_start_ms"] is not None
    }
    found: list[dict[str, Any]] = []
    for o in summary.get("overlaps", []):
        kind = (
            "reply_over_next_user_turn"
            if o["bot_start_ms"] < o["user_start_ms"]
            else "reply_before_user_turn_ended"
        )
        found.append(
            {
                "kind": kind,
                "turn": by_bot_start.get(o["bot_start_ms"]),
                "overlap_ms": round(o["overlap_ms"]),
                "at_ms": round(o["overlap_start_ms"]),
            }
        )
    user, bot = metrics["segments"]["user"], metrics["segments"]["bot"]
    greeting = (summary.get("greeting") or {}).get("start_ms")
    previous_end = None
    for seg in bot:
        if seg["start_ms"] != greeting:
            before = [
                u
                for u in user
                if u["end_ms"] <= seg["start_ms"]
                and (previous_end is None or u["end_ms"] > previous_end)
            ]
            if len(before) >= 2:
                found.append(
                    {
                        "kind": "two_user_turns_one_reply",
                        "turn": by_bot_start.get(seg["start_ms"]),
                        "user_turns": len(before),
                        "at_ms": round(seg["start_ms"]),
                    }
                )
        previous_end = seg["end_ms"]
    return found


# ERROR lines that say nothing of the run: the harness imports its Nova Sonic pipeline too, whose
# AWS extra (unused here) is not installed
NOT_OF_THE_RUN = (" ERROR pipecat.services.aws.nova_sonic.llm: ",)


def audio_stalls(path: Path, shortest_s: float = 1.0) -> list[dict[str, Any]]:
    """Where a reply's audio, played in real time from its first delta as the harness plays it,
    ran dry for `shortest_s` or more before its next delta (or its response.done) came.
    pipecat 1.3.0's output transport takes a reply's audio as ended at its TTSStoppedFrame
    (response.done) or once nothing was queued for BOT_VAD_STOP_FALLBACK_SECS (3 s): a gap that
    long is `taken_as_end`, where the harness queued the next user turn over the rest of the
    reply."""
    from pipecat.transports import base_output

    if not path.exists():
        return []
    plays: dict[str, float] = {}  # a reply's audio played out, from its first delta on
    stalls = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        kind = row.get("type")
        if kind == "response.output_audio.delta":
            response, until = row.get("response_id"), "audio delta"
        elif kind == "response.done":
            response, until = row.get("id"), f"response.done {row.get('status')}"
        else:
            continue
        t = row["t"]
        if response in plays and t - plays[response] >= shortest_s:
            dry = t - plays[response]
            stalls.append(
                {
                    "response_id": response,
                    "at": t,
                    "dry_ms": round(dry * 1000),
                    "until": until,
                    "taken_as_end": dry >= base_output.BOT_VAD_STOP_FALLBACK_SECS,
                }
            )
        if kind == "response.output_audio.delta":
            plays[response] = max(plays.get(response, t), t) + row["audio_ms"] / 1000
    return stalls


def cancelled_replies(path: Path) -> list[dict[str, Any]]:
    """Replies the gateway ended `cancelled` (`turn_detected`: the next user turn began over a
    reply still being made or played), from events.jsonl."""
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row.get("type") == "response.done" and row.get("status") == "cancelled":
            found.append(
                {
                    "kind": "reply_cancelled",
                    "response_id": row.get("id"),
                    "reason": (row.get("status_details") or {}).get("reason"),
                    "at": row["t"],
                }
            )
    return found


def log_errors(run_log: Path, limit: int = 20) -> tuple[int, list[str]]:
    """The harness's ERROR lines (its run.log): how many, and the first distinct ones."""
    if not run_log.exists():
        return 0, []
    count, seen = 0, []
    for line in run_log.read_text(errors="replace").splitlines():
        if " ERROR " in line[:40] and not any(part in line for part in NOT_OF_THE_RUN):
            count += 1
            text = line.split(": ", 1)[-1][:400]
            if text not in seen and len(seen) < limit:
                seen.append(text)
    return count, seen


def transcript(run_dir: Path) -> dict[int, dict[str, Any]]:
    path = run_dir / "transcript.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {row["turn"]: row for row in rows}


def repo_commit(repo: Path) -> str | None:
    """The commit of aiewf-eval that ran: its checkout's HEAD, or what prepare_repo noted."""
    noted = repo / "AIEWF_COMMIT"
    if noted.exists():
        return noted.read_text().strip()
    if not (repo / ".git").exists():
        return None  # (not a folder's enclosing repository's)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True
        )
        return done.stdout.strip() or None
    return None


def prepare_repo(repo: Path, out: Path) -> Path:
    """`repo` itself when it is a checkout; when it is a bare git repository (as the `fetch`
    of a mirror leaves it), the files the harness reads, from its HEAD, under out/aiewf-eval."""
    if (repo / "src" / "multi_turn_eval").is_dir() or not (repo / "objects").is_dir():
        return repo
    tree = (out / "aiewf-eval").resolve()
    if not (tree / "AIEWF_COMMIT").exists():
        tree.mkdir(parents=True, exist_ok=True)
        git = ["git", f"--git-dir={repo}"]
        commit = subprocess.run(
            [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        archive = subprocess.run(
            [*git, "archive", commit, "src", "scripts", "benchmarks"],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        (tree / "AIEWF_COMMIT").write_text(commit + "\n")
    return tree


def build_report(
    args: argparse.Namespace,
    run: dict[str, Any],
    metrics: dict[str, Any] | None,
    errors: list[dict[str, Any]],
    run_dir: Path,
) -> dict[str, Any]:
    rows = transcript(run_dir)
    per_turn = []
    for t in (metrics or {}).get("turns", []):
        row = rows.get(t["turn"], {})
        issues = metrics["turn_taking"]["per_turn"].get(t["turn"], {}).get("issues", [])
        per_turn.append(
            {
                "turn": t["turn"],
                "user": row.get("user_text"),
                "agent": (row.get("assistant_text") or "")[:200],
                "tool_calls": [c.get("name") for c in row.get("tool_calls", [])],
                "v2v_ms": _ms(t["wav_v2v_ms"]),
                "pipeline_ttfb_ms": _ms(t["pipeline_ttfb_ms"]),
                "silent_pad_ms": _ms(t["silent_pad_silero_ms"]),
                "server_ttfb_ms": t["server_ttfb_ms"],
                "bot_tag_ms": t["bot_tag_log_ms"],
                "retries": t["retry_reasons"],
                "turn_taking_issues": issues,
            }
        )
    stalls = audio_stalls(run_dir / "events.jsonl")
    cancelled = cancelled_replies(run_dir / "events.jsonl")
    start = run.get("recording_start")
    for found in stalls + cancelled:  # on the recording's clock, and the turn whose reply it was
        found["at_ms"] = round((found.pop("at") - start) * 1000) if start else None
        tagged = [
            t["turn"]
            for t in per_turn
            if found["at_ms"] is not None
            and t["bot_tag_ms"] is not None
            and t["bot_tag_ms"] <= found["at_ms"]
        ]
        found["turn"] = tagged[-1] if tagged else None
    count, lines = log_errors(run_dir / "run.log")
    taking = (metrics or {}).get("turn_taking", {})
    return {
        "benchmark": "aiewf-eval aiwf_medium_context, timing only (no judge)",
        "aiewf_eval_commit": repo_commit(args.repo),
        "base_url": args.base_url,
        "model_sent": MODEL,
        "instructions": args.instructions,
        "turns_asked": args.turns,
        "run": run,
        # as aiewf-eval reports it: every turn its analysis gave a V2V; and those of the turns
        # its turn-taking checks passed (a failed turn's V2V may be measured to another reply)
        "v2v_ms": v2v_summary(per_turn),
        "v2v_ms_turn_taking_ok": v2v_summary([t for t in per_turn if not t["turn_taking_issues"]]),
        "turns": per_turn,
        "ran_together": (ran_together(metrics) if metrics else []) + cancelled,
        "audio_stalls": stalls,
        "turn_taking": {
            "ok": taking.get("turn_taking_ok"),
            "failed_turns": taking.get("failed_turns"),
            "global_issues": taking.get("global_issues"),
            "unmatched_bot_segments": len(taking.get("unmatched_bot_segments") or []),
            "unprompted_bot_segments": len(taking.get("unprompted_bot_segments") or []),
            # its orphan check counts the greeting, which no turn claims, as one
            "unmatched_starts_ms": [
                round(seg["start_ms"]) for seg in taking.get("unmatched_bot_segments") or []
            ],
            "greeting_start_ms": _ms(
                ((metrics or {}).get("summary", {}).get("greeting") or {}).get("start_ms")
            ),
            "analysis_error": taking.get("error"),
        },
        "alignment": (metrics or {}).get("alignment"),
        "errors": {"session": errors, "run_log_error_lines": count, "run_log_first": lines},
        "run_dir": str(run_dir),
        "machine": describe_machine(),
    }


def v2v_summary(turns: list[dict[str, Any]]) -> dict[str, Any]:
    v2v = [t["v2v_ms"] for t in turns if t["v2v_ms"] is not None]
    non_tool = [t["v2v_ms"] for t in turns if t["v2v_ms"] is not None and not t["tool_calls"]]
    return {
        "n": len(v2v),
        "median": pct(v2v, 50),
        "p90": pct(v2v, 90),
        "mean": round(float(np.mean(v2v)), 1) if v2v else None,
        "max": max(v2v) if v2v else None,
        "non_tool_median": pct(non_tool, 50),
    }


def _ms(value: float | None) -> int | None:
    return None if value is None else round(value)


def table(report: dict[str, Any]) -> str:
    run = report["run"]
    out = [
        f"aiewf-eval timing vs {report['base_url']} ({report['instructions']} instructions, "
        f"{run['outcome']}, {run['turns_done']} of {report['turns_asked']} turns done)",
        "",
        "| turn | V2V ms | pipe TTFB ms | pad ms | tools | turn-taking issues | user |",
        "| ---: | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for t in report["turns"]:
        out.append(
            f"| {t['turn']} | {_cell(t['v2v_ms'])} | {_cell(t['pipeline_ttfb_ms'])} | "
            f"{_cell(t['silent_pad_ms'])} | {','.join(t['tool_calls']) or '-'} | "
            f"{'; '.join(t['turn_taking_issues'] + t['retries']) or '-'} | "
            f"{(t['user'] or '')[:48]} |"
        )
    taking = report["turn_taking"]
    errors = report["errors"]
    out += [
        "",
        "V2V, every turn measured: " + _v2v_line(report["v2v_ms"]),
        "V2V, turn-taking ok:      " + _v2v_line(report["v2v_ms_turn_taking_ok"]),
        f"ran together: {len(report['ran_together'])} "
        + (", ".join(f"{r['kind']}@turn{r['turn']}" for r in report["ran_together"]) or "none"),
        f"reply audio ran dry 1 s+: {len(report['audio_stalls'])} "
        + ", ".join(
            f"turn{s['turn']} {s['dry_ms']} ms"
            + (" (taken as its end)" if s["taken_as_end"] else "")
            for s in report["audio_stalls"]
        ),
        f"turn-taking (aiewf-eval's checks): failed turns {taking['failed_turns']}; "
        f"global: {taking['global_issues'] or 'none'}",
        f"errors: {len(errors['session'])} in the session, "
        f"{errors['run_log_error_lines']} ERROR lines in run.log",
    ]
    out += [
        f"  - {e['kind']}: {e.get('code') or ''} {e.get('message') or ''}"[:300]
        for e in errors["session"]
    ]
    out += [f"  - run.log: {line}"[:300] for line in errors["run_log_first"][:5]]
    machine = report["machine"]
    out.append(
        f"machine: {machine['cpus']} CPUs, GPUs {machine['gpus'] or 'none'}, "
        f"Python {machine['python']}, {machine['versions']}"
    )
    return "\n".join(out)


def _v2v_line(v: dict[str, Any]) -> str:
    return (
        f"n={v['n']} median={_cell(v['median'])} ms p90={_cell(v['p90'])} ms "
        f"mean={_cell(v['mean'])} ms max={_cell(v['max'])} ms "
        f"(non-tool median {_cell(v['non_tool_median'])} ms)"
    )


def _cell(value: Any) -> str:
    return "-" if value is None else f"{value:.0f}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the gateway, e.g. http://127.0.0.1:8080")
    parser.add_argument(
        "--repo",
        type=Path,
        default=Path(os.environ.get("AIEWF_REPO", "")) if os.environ.get("AIEWF_REPO") else None,
        help="github.com/kwindla/aiewf-eval: a checkout, or a bare clone (or $AIEWF_REPO)",
    )
    parser.add_argument(
        "--turns", type=int, default=10, help=f"the first N of its {TURNS_IN_BENCHMARK} turns"
    )
    parser.add_argument("--instructions", choices=("short", "full"), default="short")
    parser.add_argument("--out", type=Path, default=None, help="default out/aiewf/<time>")
    parser.add_argument("--api-key", default=os.environ.get("OMNI_API_KEY", "sk-local"))
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds for the run (60 + 60 a turn)"
    )
    parser.add_argument("--verbose", action="store_true", help="the harness's INFO log too")
    parser.add_argument(
        "--analyse-only",
        action="store_true",
        help="measure the run already under --out again, without running one",
    )
    args = parser.parse_args(argv)
    if args.repo is None:
        parser.error("--repo: a checkout of github.com/kwindla/aiewf-eval is needed")
    if not 1 <= args.turns <= TURNS_IN_BENCHMARK:
        parser.error(f"--turns: 1 to {TURNS_IN_BENCHMARK}")
    args.repo = args.repo.resolve()
    args.timeout = args.timeout or 60.0 + 60.0 * args.turns
    if args.analyse_only and args.out is None:
        parser.error("--analyse-only: --out names the run to measure")
    out = args.out or Path("out/aiewf") / time.strftime("%Y%m%dT%H%M%S")
    run_dir = (out / "run").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)

    args.repo = prepare_repo(args.repo, out)
    use_harness(args.repo)
    if args.analyse_only:
        saved = json.loads((run_dir / "run.json").read_text())
        run, errors = saved["run"], saved["errors"]
    else:
        setup_logging(run_dir, args.verbose)
        errors = []
        log(f"aiewf-eval: {args.turns} turns against {ws_url(args.base_url)} into {run_dir}")
        run = asyncio.run(run_harness(args, run_dir, errors))
        (run_dir / "run.json").write_text(json.dumps({"run": run, "errors": errors}, indent=2))
        log(f"run {run['outcome']} in {run['wall_s']} s; analysing {run_dir / 'conversation.wav'}")
    metrics = None
    if (run_dir / "conversation.wav").exists():
        try:
            metrics = analyse(run_dir)
        except Exception as exc:  # a recording with nothing to measure in it
            errors.append({"kind": "analysis_failed", "message": f"{type(exc).__name__}: {exc}"})
    else:
        errors.append({"kind": "no_recording", "message": "the harness wrote no conversation.wav"})
    report = build_report(args, run, metrics, errors, run_dir)
    publish(report, table(report), out)
    return 0 if run["outcome"] == "completed" and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
