"""Soak: sessions that talk for a long time, their history growing far past the model's
context, against `omni-gateway start` run as a user runs it.

    python -m loadtest.soak [--config configs/tiny.yaml] [--sessions 10] [--minutes 30]
                            [--out DIR]

Each session, over the WebSocket Realtime API, adds a user message of about 90 tokens and
asks for a spoken reply, then the next, for `--minutes`: with the tiny model's 1,024-token
context its conversation outgrows the context in a dozen turns and keeps growing. Counted:
turns, failed turns (a response.done not completed, or an `error` event), and, each minute,
every process's RSS (the gateway and supervisor, each stage, vLLM's engine processes) and the
service's shared memory in /dev/shm. Printed as JSON and a table; with `--out`,
results.json and table.md there too. The figures the issue asks for: 0 failed turns, and RSS
and /dev/shm flat from the first minute (after warm-up) to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.bench import describe_machine, log
from loadtest.idle_cpu import stage_pids
from loadtest.service import ROOT, Service

QUESTION = (
    "Turn {turn} of session {session}: tell me once more about the weather in the mountains, "
    "the rivers in the valleys below them, the villages along the rivers, and what the people "
    "there grow in their fields in spring and in autumn, in a few words please."
)


def rss_by_process(root_pid: int, names: dict[int, str]) -> dict[str, float]:
    """MiB resident of each process of the service, summed by name."""
    import psutil

    out: dict[str, float] = {}
    with contextlib.suppress(psutil.NoSuchProcess):
        root = psutil.Process(root_pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                name = "gateway + supervisor" if proc.pid == root_pid else names.get(proc.pid)
                if name is None:
                    cmdline = " ".join(proc.cmdline())
                    name = "resource tracker" if "resource_tracker" in cmdline else proc.name()
                out[name] = round(out.get(name, 0.0) + proc.memory_info().rss / 2**20, 1)
    return out


def shm_usage(owner_pid: int) -> dict[str, float]:
    """The service's segments in /dev/shm (those its supervisor made): how many, and MiB
    resident (a ring's pages count once they are first written)."""
    from shm import list_segments
    from shm.segments import owner_of

    used, count = 0, 0
    for name in list_segments():
        with contextlib.suppress(FileNotFoundError):
            if owner_of(name)[1] == owner_pid:
                count += 1
                used += Path("/dev/shm", name.lstrip("/")).stat().st_blocks * 512
    return {"segments": count, "mib": round(used / 2**20, 1)}


class Talker:
    """One session's turns, and what went wrong in them."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.turns = 0
        self.failed: list[str] = []

    async def run(self, http: aiohttp.ClientSession, url: str, until: float) -> None:
        async with http.ws_connect(url, max_msg_size=0) as ws:
            await self._next(ws, "session.created")
            while time.monotonic() < until:
                item = {
                    "type": "message",
                    "role": "user",
                    "content": [
                        {
                            "type": "input_text",
                            "text": QUESTION.format(turn=self.turns, session=self.index),
                        }
                    ],
                }
                await ws.send_str(json.dumps({"type": "conversation.item.create", "item": item}))
                await ws.send_str(json.dumps({"type": "response.create"}))
                done = await self._next(ws, "response.done")
                self.turns += 1
                if done["response"]["status"] != "completed":
                    self.failed.append(f"turn {self.turns}: {done['response']['status']}")

    async def _next(self, ws: aiohttp.ClientWebSocketResponse, wanted: str) -> dict[str, Any]:
        async with asyncio.timeout(120):
            while True:
                msg = await ws.receive()
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    raise ConnectionError(f"session {self.index}: the connection ended ({msg})")
                event = json.loads(msg.data)
                if event["type"] == "error":
                    self.failed.append(f"turn {self.turns + 1}: error {event['error']}")
                elif event["type"] == wanted:
                    return event


async def soak(base: str, sessions: int, seconds: float, sample) -> list[Talker]:
    talkers = [Talker(i) for i in range(sessions)]
    until = time.monotonic() + seconds
    url = base.replace("http", "ws") + "/v1/realtime?model=soak"
    async with aiohttp.ClientSession() as http:
        runs = asyncio.gather(*(t.run(http, url, until) for t in talkers), return_exceptions=True)
        sampler = asyncio.create_task(sample(talkers))
        results = await runs
        if sampler.done():  # it failed: the figures asked for are not there
            sampler.result()
        sampler.cancel()
    for talker, result in zip(talkers, results, strict=True):
        if isinstance(result, BaseException):
            talker.failed.append(f"session ended: {type(result).__name__}: {result}")
    return talkers


def table(result: dict[str, Any]) -> str:
    first, last = result["samples"][0], result["samples"][-1]
    rows = [
        "| process | RSS at minute 1 MiB | RSS at the end MiB | change MiB |",
        "|---|---:|---:|---:|",
    ]
    for name, start in first["rss_mib"].items():
        end = last["rss_mib"].get(name, 0.0)
        rows.append(f"| {name} | {start} | {end} | {end - start:+.1f} |")
    rows.append(
        f"| /dev/shm ({first['shm']['segments']} → {last['shm']['segments']} segments) "
        f"| {first['shm']['mib']} | {last['shm']['mib']} "
        f"| {last['shm']['mib'] - first['shm']['mib']:+.1f} |"
    )
    rows.append("")
    rows.append(
        f"{result['sessions']} sessions for {result['minutes']} min: {result['turns']} turns, "
        f"{result['failed_turns']} failed; longest conversation {result['longest_turns']} turns "
        f"(~{result['longest_tokens']} tokens against a context of {result['context_tokens']})"
    )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny.yaml")
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from gateway.config import load_config

    context = load_config(args.config).reasoning.engine_args.get("max_model_len")
    samples: list[dict[str, Any]] = []
    with Service(args.config) as service:
        base, _ = service.started()
        names = stage_pids(service.seen)
        log(f"serving at {base}; {args.sessions} sessions for {args.minutes} min")

        async def sample(talkers: list[Talker]) -> None:
            started = time.monotonic()
            while True:
                await asyncio.sleep(60)  # a reading a minute, as a dashboard would scrape
                reading = {
                    "minute": round((time.monotonic() - started) / 60, 1),
                    "turns": sum(t.turns for t in talkers),
                    "failed": sum(len(t.failed) for t in talkers),
                    "rss_mib": rss_by_process(service.proc.pid, names),
                    "shm": shm_usage(service.proc.pid),
                }
                samples.append(reading)
                log(
                    f"minute {reading['minute']}: {reading['turns']} turns, "
                    f"{reading['failed']} failed, RSS {sum(reading['rss_mib'].values()):.0f} "
                    f"MiB, /dev/shm {reading['shm']['mib']} MiB"
                )

        talkers = asyncio.run(soak(base, args.sessions, args.minutes * 60, sample))
        service.stop()
    longest = max(t.turns for t in talkers)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": describe_machine(),
        "config": str(args.config.relative_to(ROOT) if args.config.is_absolute() else args.config),
        "command": f"python -m loadtest.soak --sessions {args.sessions} --minutes {args.minutes}",
        "sessions": args.sessions,
        "minutes": args.minutes,
        "turns": sum(t.turns for t in talkers),
        "failed_turns": sum(len(t.failed) for t in talkers),
        "failures": [f for t in talkers for f in t.failed][:20],
        "longest_turns": longest,
        # ~95 tokens a question, and the reply: an estimate of the history's length
        "longest_tokens": longest * 140,
        "context_tokens": context,
        "samples": samples,
    }
    print(json.dumps(result, indent=2))
    print(table(result))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=2))
        (args.out / "table.md").write_text(table(result) + "\n")


if __name__ == "__main__":
    main()
