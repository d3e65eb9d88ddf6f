"""Function calling as a caller meets it: how long after they stop speaking the function call
is whole, and how long after the client hands back the function's output the agent speaks.

    python -m loadtest.tools_bench [--config configs/offline.yaml] [--sessions 1,4]
                                   [--turns 6] [--choice required] [--out DIR]

`omni-gateway start` serves the configuration (as a user runs it, on 127.0.0.1) with one
function tool, get_weather. For each number of sessions in turn, in the same run, every session
speaks weather questions (espeak-ng, paced in real time over the WebSocket Realtime API as
24 kHz PCM, then silence until the server VAD ends the turn); the session's tool_choice
(required: every model makes a valid call, through vLLM's structured outputs) makes the reply
a call. The client answers the call with a function_call_output and a response.create
(tool_choice auto), and the spoken reply follows.

Measured, per session count, p50/p95 over every turn:
- end of the caller's speech (its last voiced sample sent) to
  response.function_call_arguments.done at the client; beside it, from the server's
  input_audio_buffer.speech_stopped (the VAD window's end) to the same;
- function output sent to the first response.output_audio.delta of the reply that reads it.
Prints JSON and a table; writes results.json and table.md under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import yaml

from loadtest.bench import describe_machine, log, publish
from loadtest.bench import ms_summary as ms
from loadtest.service import ROOT, Service
from loadtest.voices import VOICED_SAMPLE, spoken

QUESTIONS = (
    "What is the weather like in Paris today?",
    "How warm is it in Rome right now?",
    "Is it raining in London at the moment?",
    "What is the weather in Tokyo?",
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather now in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
OUTPUT = "Sunny and 22 degrees Celsius."
RATE = 24_000
CHUNK = RATE // 50  # 20 ms
TRAILING_SILENCE_S = 1.2  # past the VAD's silence window
DEBUG = bool(os.environ.get("TOOLS_BENCH_DEBUG"))  # every event received, to stderr


class Turns:
    """One session's turns and their times (seconds)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.to_call: list[float] = []  # end of speech -> arguments done
        self.window_to_call: list[float] = []  # speech_stopped -> arguments done
        self.output_to_audio: list[float] = []  # function output sent -> first audio
        self.failed: list[str] = []

    async def run(
        self,
        http: aiohttp.ClientSession,
        url: str,
        clips: list[np.ndarray],
        turns: int,
        choice: str,
    ) -> None:
        async with http.ws_connect(url, max_msg_size=0) as ws:
            self.ws = ws
            await self._next("session.created")
            session = {"type": "realtime", "tools": [WEATHER], "tool_choice": choice}
            await ws.send_str(json.dumps({"type": "session.update", "session": session}))
            await self._next("session.updated")
            for turn in range(turns):
                try:
                    await self._turn(clips[(turn + self.index) % len(clips)])
                except (TimeoutError, AssertionError) as exc:
                    self.failed.append(f"turn {turn}: {exc!r}")

    async def _turn(self, clip: np.ndarray) -> None:
        ws = self.ws
        voiced = np.flatnonzero(np.abs(clip) > VOICED_SAMPLE)
        last_voiced = int(voiced[-1]) if len(voiced) else len(clip) - 1
        audio = np.concatenate([clip, np.zeros(int(TRAILING_SILENCE_S * RATE), np.int16)])
        started = time.monotonic()
        end_of_speech = started + last_voiced / RATE
        listen = asyncio.create_task(self._until_call())
        for i in range(0, len(audio), CHUNK):
            await asyncio.sleep(max(0.0, started + i / RATE - time.monotonic()))
            chunk = audio[i : i + CHUNK].astype("<i2").tobytes()
            payload = base64.b64encode(chunk).decode()
            await ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": payload}))
            if listen.done():
                break
        call, stopped_at, called_at = await listen
        self.to_call.append(called_at - end_of_speech)
        self.window_to_call.append(called_at - stopped_at)
        done = await self._next("response.done")
        assert done["response"]["status"] == "completed", done["response"]["status"]
        output = {"type": "function_call_output", "call_id": call["call_id"], "output": OUTPUT}
        sent = time.monotonic()
        await ws.send_str(json.dumps({"type": "conversation.item.create", "item": output}))
        await ws.send_str(
            json.dumps({"type": "response.create", "response": {"tool_choice": "auto"}})
        )
        await self._next("response.output_audio.delta")
        self.output_to_audio.append(time.monotonic() - sent)
        done = await self._next("response.done")
        assert done["response"]["status"] == "completed", done["response"]["status"]

    async def _until_call(self) -> tuple[dict[str, Any], float, float]:
        await self._next("input_audio_buffer.speech_stopped")
        stopped_at = time.monotonic()
        call = await self._next("response.function_call_arguments.done")
        return call, stopped_at, time.monotonic()

    async def _next(self, wanted: str, timeout: float = 120) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                msg = await self.ws.receive()
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    raise ConnectionError(f"session {self.index}: the connection ended ({msg})")
                event = json.loads(msg.data)
                if DEBUG:
                    seen = f"session {self.index}: {event['type']} {event.get('error', '')}"
                    print(seen, file=sys.stderr, flush=True)
                if event["type"] == "error":
                    self.failed.append(
                        f"error {event['error']['code']}: {event['error']['message']}"
                    )
                if event["type"] == wanted:
                    return event


async def phase(
    base: str, sessions: int, clips: list[np.ndarray], turns: int, choice: str
) -> list[Turns]:
    url = base.replace("http", "ws") + "/v1/realtime?model=tools-bench"
    talkers = [Turns(i) for i in range(sessions)]
    async with aiohttp.ClientSession() as http:
        await asyncio.gather(*(t.run(http, url, clips, turns, choice) for t in talkers))
    return talkers


def joined(talkers: list[Turns], name: str) -> list[Any]:
    """One list of every session's `name`."""
    return [value for t in talkers for value in getattr(t, name)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "offline.yaml")
    parser.add_argument("--sessions", default="1,4", help="session counts, in turn")
    parser.add_argument("--turns", type=int, default=6, help="turns per session")
    parser.add_argument("--choice", default="required", help="the session's tool_choice")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    counts = [int(n) for n in args.sessions.split(",")]
    clips = [spoken(q, RATE) for q in QUESTIONS]
    data = yaml.safe_load(args.config.read_text())
    data.setdefault("gateway", {})["auth"] = {"enabled": False}
    data["gateway"]["max_calls"] = max(counts) + 2
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "tools-bench.yaml"
        config.write_text(yaml.safe_dump(data))
        with Service(config) as service:
            base, _ = service.started()
            log(f"serving {args.config.name} at {base}")
            results: dict[str, Any] = {}
            for n in counts:
                log(f"{n} session(s), {args.turns} turns each")
                talkers = asyncio.run(phase(base, n, clips, args.turns, args.choice))
                results[str(n)] = {
                    "end_of_speech_to_arguments_done_ms": ms(joined(talkers, "to_call")),
                    "speech_stopped_to_arguments_done_ms": ms(joined(talkers, "window_to_call")),
                    "function_output_to_first_audio_ms": ms(joined(talkers, "output_to_audio")),
                    "failed": joined(talkers, "failed"),
                }
    report = {
        "benchmark": "loadtest.tools_bench",
        "date": datetime.date.today().isoformat(),
        "config": args.config.name,
        "tool_choice": args.choice,
        "turns_per_session": args.turns,
        "machine": describe_machine(),
        "results": results,
    }
    publish(report, table_md(report), args.out)


def table_md(report: dict[str, Any]) -> str:
    rows = [
        "| sessions | end of speech → arguments done p50 / p95 ms | VAD window end → "
        "arguments done p50 / p95 ms | function output → first audio p50 / p95 ms | turns | "
        "failed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for n, r in report["results"].items():
        a, w, o = (
            r["end_of_speech_to_arguments_done_ms"],
            r["speech_stopped_to_arguments_done_ms"],
            r["function_output_to_first_audio_ms"],
        )
        rows.append(
            f"| {n} | {a['p50']} / {a['p95']} | {w['p50']} / {w['p95']} | "
            f"{o['p50']} / {o['p95']} | {a['n']} | {len(r['failed'])} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
