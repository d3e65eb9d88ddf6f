"""Phone calls as the phone sees them, and what one costs the gateway beside a WebRTC call.

    python -m loadtest.telephony_bench [--config configs/offline.yaml] [--turns 8]
                                       [--policies immediate,provisional]
                                       [--calls 4] [--seconds 30] [--out DIR]

`omni-gateway start` serves the configuration on 127.0.0.1. A phone call (loadtest.phone:
Twilio's Media Streams messages, μ-law 8 kHz, paced in real time) asks questions in turn; a
second into each answer the caller talks over the agent. Measured at the phone:
- end of the caller's speech (its last voiced frame sent) to the reply's first `media`,
  p50/p95;
- barge-in: the caller's speech onset (the interruption's first voiced frame sent) to the
  `clear` that drops the agent's audio, p50/p95.
Each interruption policy runs in turn, the service started again for it. Then, once, the
gateway's CPU per call: `--calls` phone calls, then as many WebRTC calls
(gateway.client, real Opus), each speaking one question and listening for `--seconds`, the
callers in a process of their own; the gateway process's CPU time over each phase, as a share
of one core per call. Prints JSON and a table; writes results.json and table.md under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from loadtest.bench import describe_machine, log, publish
from loadtest.bench import ms_summary as ms
from loadtest.callers import run_callers
from loadtest.phone import PhoneCall
from loadtest.service import ROOT, Service
from loadtest.speakerphone import EchoSettings, Speakerphone
from loadtest.voices import spoken

QUESTIONS = (
    "What is the capital of France?",
    "How many days are in a week?",
    "What color is the sky?",
    "How many legs does a dog have?",
)
# one phrase: a pause inside it would end a turn there, and the rest would interrupt the reply
INTERRUPTION = "Wait stop tell me something else"
BARGE_IN_AFTER_S = 1.0  # into the agent's answer


async def phone_turns(url: str, turns: int) -> dict[str, list[float]]:
    """One call's questions and interruptions: the phone's times."""
    questions = [spoken(q, 8000) for q in QUESTIONS]
    interruption = spoken(INTERRUPTION, 8000)
    to_media: list[float] = []
    to_clear: list[float] = []
    to_silent: list[float] = []
    missed: list[int] = []
    async with PhoneCall.dial(url) as phone:
        await asyncio.sleep(0.5)
        for turn in range(turns):
            _, end = await phone.until_said(phone.say(questions[turn % len(questions)]))
            async with asyncio.timeout(60):
                while not [t for t in phone.media_at if t > end]:
                    await asyncio.sleep(0.005)
            to_media.append(min(t for t in phone.media_at if t > end) - end)
            await phone.until_agent_speaks(after=end)
            await asyncio.sleep(BARGE_IN_AFTER_S)
            clears, onsets = len(phone.clears), len(phone.onsets)
            interrupting = phone.say(interruption)
            try:
                async with asyncio.timeout(5):
                    while len(phone.clears) == clears or len(phone.onsets) == onsets:
                        await asyncio.sleep(0.005)
                onset, cleared = phone.onsets[onsets], phone.clears[clears]
                to_clear.append(cleared - onset)
                played = [t for t in phone.voiced_at if onset <= t <= cleared + 0.2]
                to_silent.append((max(played) if played else onset) - onset)
            except TimeoutError:
                missed.append(turn)
            # the answer to the interruption, heard to its end
            _, interrupted = await phone.until_said(interrupting)
            with contextlib.suppress(TimeoutError):
                await phone.until_agent_speaks(after=interrupted, timeout=20)
            await phone.until_silent(quiet_s=1.5)
        await phone.hang_up()
    return {"to_media": to_media, "to_clear": to_clear, "to_silent": to_silent, "missed": missed}


def run_phones(
    url: str, n: int, speech8k: np.ndarray, listen_s: float, echo: EchoSettings | None = None
) -> dict[str, Any]:
    """In a process of its own: n phone calls speak once, wait for the agent, listen; with
    `echo`, each on a speakerphone (loadtest.speakerphone)."""

    async def one() -> bool:
        speakerphone = None if echo is None else Speakerphone(8000, echo)
        async with PhoneCall.dial(url, speakerphone=speakerphone) as phone:
            phone.say(speech8k)
            try:
                await phone.until_agent_speaks(timeout=120)
            except TimeoutError:
                return False
            await asyncio.sleep(listen_s)
            await phone.hang_up()
        return True

    async def every() -> list[bool]:
        return await asyncio.gather(*(one() for _ in range(n)))

    return {"replied": asyncio.run(every())}


def gateway_cpu(pid: int, run: Any, *args: Any) -> tuple[float, float, Any]:
    """(CPU seconds the gateway process used, wall seconds, the result) over run(*args) in a
    spawned process."""
    import psutil

    gateway = psutil.Process(pid)
    before, started = gateway.cpu_times(), time.monotonic()
    with mp.get_context("spawn").Pool(1) as pool:
        result = pool.apply(run, args)
    after = gateway.cpu_times()
    cpu = (after.user - before.user) + (after.system - before.system)
    return cpu, time.monotonic() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "offline.yaml")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--calls", type=int, default=4, help="calls of each kind for the CPU")
    parser.add_argument("--seconds", type=float, default=30, help="each call listens so long")
    parser.add_argument(
        "--policies",
        default="immediate,provisional",
        help="gateway.turns.interruptions.policy, each",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    data = yaml.safe_load(args.config.read_text())
    gw = data.setdefault("gateway", {})
    gw["auth"] = {"enabled": False}
    gw["max_calls"] = max(gw.get("max_calls", 8), args.calls + 2)
    phone: dict[str, Any] = {}
    cpu: dict[str, Any] = {}
    for policy in args.policies.split(","):
        gw.setdefault("turns", {}).setdefault("interruptions", {})["policy"] = policy
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "telephony-bench.yaml"
            config.write_text(yaml.safe_dump(data))
            with Service(config) as service:
                base, pids = service.started()
                url = base.replace("http", "ws") + "/v1/telephony/twilio"
                log(f"{policy}: serving {args.config.name} at {base}: {args.turns} phone turns")
                turns = asyncio.run(phone_turns(url, args.turns))
                phone[policy] = {
                    "end_of_speech_to_first_media_ms": ms(turns["to_media"]),
                    "speech_onset_to_clear_ms": ms(turns["to_clear"]),
                    "speech_onset_to_agent_silent_ms": ms(turns["to_silent"]),
                    "barge_ins_missed": len(turns["missed"]),
                }
                if cpu:
                    continue
                log(f"{args.calls} phone calls, then {args.calls} WebRTC calls, for the CPU")
                question = spoken(QUESTIONS[0], 8000)
                phone_cpu, phone_s, phones = gateway_cpu(
                    pids["gateway"], run_phones, url, args.calls, question, args.seconds
                )
                webrtc_cpu, webrtc_s, webrtc = gateway_cpu(
                    pids["gateway"],
                    run_callers,
                    base,
                    args.calls,
                    spoken(QUESTIONS[0], 48000),
                    args.seconds,
                )
                cpu = {
                    "calls": args.calls,
                    "seconds": args.seconds,
                    "phone_core_share": round(phone_cpu / phone_s / args.calls, 4),
                    "webrtc_core_share": round(webrtc_cpu / webrtc_s / args.calls, 4),
                    "phone_replied": sum(phones["replied"]),
                    "webrtc_replied": sum(webrtc["replied"]),
                }
    report = {
        "benchmark": "loadtest.telephony_bench",
        "date": datetime.date.today().isoformat(),
        "config": args.config.name,
        "machine": describe_machine(),
        "phone": phone,
        "gateway_cpu_per_call": cpu,
    }
    publish(report, table_md(report), args.out)


def table_md(report: dict[str, Any]) -> str:
    rows = [
        "| interruption policy | end of speech → first media p50 / p95 ms | speech onset → "
        "clear p50 / p95 ms | speech onset → agent silent at the phone p50 / p95 ms | "
        "barge-ins missed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for policy, p in report["phone"].items():
        media, clear = p["end_of_speech_to_first_media_ms"], p["speech_onset_to_clear_ms"]
        silent = p["speech_onset_to_agent_silent_ms"]
        rows.append(
            f"| {policy} | {media['p50']} / {media['p95']} ({media['n']} turns) | "
            f"{clear['p50']} / {clear['p95']} | {silent['p50']} / {silent['p95']} | "
            f"{p['barge_ins_missed']} |"
        )
    cpu = report["gateway_cpu_per_call"]
    rows += [
        "",
        "| gateway CPU per call (share of a core) | phone | WebRTC |",
        "| --- | --- | --- |",
        f"| {cpu['calls']} calls, {cpu['seconds']:g} s each | {cpu['phone_core_share']} | "
        f"{cpu['webrtc_core_share']} |",
    ]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
