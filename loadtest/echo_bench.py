"""A caller on a speakerphone: the agent's own echo, with the gateway's echo canceller off and
on, in one run.

    python -m loadtest.echo_bench [--config configs/offline.yaml] [--delays 60,150,250]
        [--levels 6,20] [--replies 3] [--barge-ins 3]
        [--load-config configs/tiny.yaml] [--load-calls 20] [--load-seconds 30] [--out DIR]

Phone calls (loadtest.phone: Twilio's Media Streams messages, μ-law 8 kHz, in real time) on a
simulated speakerphone (loadtest.speakerphone: the agent's audio the phone played comes back
into its microphone `--delays` ms late, `--levels` dB down, through a 60 ms room, under
-60 dBFS of noise), against the stages and gateway of `--config` on 127.0.0.1, the gateway in
this process so that its sessions' transcripts can be read. The canceller is the phone's
(`gateway.media.echo_cancel.phone`), off and then on; each variant also runs once with no
echo at all, the reference. In each condition one call:
- asks `--replies` questions and hears each reply through. A reply the agent stopped or
  paused on its own echo is one during which the gateway held the agent's audio for a voice
  over it (`omni_agent_holds`), its VAD heard speech, or a `clear` came;
- then `--barge-ins` times talks over a reply a second into it, while the agent's voice
  plays: missed if no `clear` came within 5 s; the time from the interruption's onset (its
  first voiced frame sent) to the agent silent at the phone (its last voiced frame played),
  left out where the agent was not heard on both sides of the onset (its reply ended, or
  paused between phrases, there: counted apart); the interruption's transcript
  against its text (word error rate; the reference is the same speech with no echo);
- with the canceller on, what it judged of the call's echo path by the end
  (gateway.echo.EchoPath) and the share of frames that took the output without AEC3.
The questions and interruptions are split once (`--part`): the canceller's thresholds were set
on calls of the tuning part; the test part is reported.

Then the cost: `--load-calls` phone calls on speakerphones at once against `omni-gateway start`
with `--load-config` (the gateway in a process of its own, one process), each asking a
question and listening for `--load-seconds`, the canceller off and then on: the gateway
process's CPU per call, and its event loop's lag p99 (`omni_event_loop_lag_seconds`, to its
histogram's bucket). Prints JSON and a table; writes results.json and table.md under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import math
import multiprocessing as mp
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from loadtest.bench import describe_machine, log, publish, summary
from loadtest.offline_quality import errors
from loadtest.phone import PhoneCall
from loadtest.speakerphone import EchoSettings, Speakerphone
from loadtest.tap import phone_session, tapped_gateway, user_transcripts

ROOT = Path(__file__).parents[1]
# Split once: the canceller's thresholds (gateway.echo.ResidualEcho) and its far end's
# placement were set on calls of the tuning part; the test part is what is reported
QUESTIONS = {
    "tuning": (
        "How do I make a cup of tea?",
        "What happens in a thunderstorm?",
        "Why do leaves change color in autumn?",
        "Tell me about the ocean.",
    ),
    "test": (
        "How is bread made?",
        "What do bees do all day?",
        "Why is the sea salty?",
        "Tell me about the mountains.",
    ),
}
INTERRUPTIONS = {
    "tuning": (
        "Wait, I need to book a table for four people tonight.",
        "Hold on, what time does the last bus leave the station?",
        "Sorry, can you tell me the price of a return ticket?",
        "Stop there, I would like to speak to the manager please.",
    ),
    "test": (
        "Excuse me, where is the nearest train station from here?",
        "One moment, I want to change my delivery address.",
        "Wait, how much does a large pizza cost?",
        "Actually, please cancel my order for tomorrow morning.",
    ),
}
INSTRUCTIONS = "You are a helpful assistant. Answer in three or four sentences."
BARGE_IN_AFTER_S = 1.0  # into the agent's reply
MISSED_AFTER_S = 5.0  # no clear this long after the interruption's onset: missed
QUIET_S = 0.4  # no voiced frame played for this long: the agent is silent
AUDIBLE_S = 0.06  # a voiced frame played this recently: the agent is speaking
ROOM_MS, NOISE_DBFS = 60.0, -60.0


def counters(gateway: Any) -> dict[str, float]:
    """The gateway's counts of what a voice over the agent did."""
    registry = gateway.metrics.registry
    samples = {
        "holds": ("omni_agent_holds_total", {}),
        "speech_started": ("omni_vad_events_total", {"event": "speech_started"}),
    }
    return {
        k: registry.get_sample_value(name, labels) or 0.0 for k, (name, labels) in samples.items()
    }


async def until(predicate: Any, timeout: float, step: float = 0.02) -> bool:
    """Whether `predicate()` came true within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(step)
    return bool(predicate())


def done_marks(phone: PhoneCall) -> int:
    return sum(1 for m in phone.marks_echoed if m.startswith("done."))


async def hear_reply(phone: PhoneCall, timeout: float = 120) -> None:
    """Until the reply played to its end (its last mark) or was cleared, and the line is
    quiet."""
    marks, clears = done_marks(phone), len(phone.clears)
    await until(lambda: done_marks(phone) > marks or len(phone.clears) > clears, timeout)
    await phone.until_silent(QUIET_S, timeout)


def audible(phone: PhoneCall) -> bool:
    """Whether the agent's voice is what the phone plays now."""
    return bool(phone.voiced_at) and time.monotonic() - phone.voiced_at[-1] < AUDIBLE_S


def silent_after(phone: PhoneCall, onset: float) -> float | None:
    """When the agent fell silent at the phone after `onset`: its last voiced frame played
    before a quiet spell of QUIET_S (None: it never did)."""
    voiced = [t for t in phone.voiced_at if t >= onset]
    last = onset
    for t in voiced:
        if t - last > QUIET_S:
            break
        last = t
    return last if time.monotonic() - last > QUIET_S else None


async def condition(
    url: str, gateway: Any, echo: EchoSettings | None, part: str, replies: int, barge_ins: int
) -> dict[str, Any]:
    """One call on a speakerphone (none: no echo): its replies, then its barge-ins."""
    from loadtest.voices import spoken

    phone_echo = None if echo is None else Speakerphone(8000, echo)
    stopped, barge = [], []
    async with PhoneCall.dial(url, speakerphone=phone_echo) as phone:
        for question in QUESTIONS[part][:replies]:
            phone.say(spoken(question, 8000))
            await phone.until_said(len(phone.said) + 1)
            await phone.until_agent_speaks(after=phone.said[-1][1], timeout=120)
            before, clears = counters(gateway), len(phone.clears)
            await hear_reply(phone)
            after = counters(gateway)
            seen = {k: after[k] - before[k] for k in after}
            seen["clears"] = len(phone.clears) - clears
            stopped.append(seen)
            log(f"  reply to {question!r}: {seen}")
        pairs = zip(QUESTIONS[part], INTERRUPTIONS[part][:barge_ins], strict=False)
        for question, words in pairs:
            phone.say(spoken(question, 8000))
            await phone.until_said(len(phone.said) + 1)
            spoke = await phone.until_agent_speaks(after=phone.said[-1][1], timeout=120)
            await until(
                lambda s=spoke: time.monotonic() - s >= BARGE_IN_AFTER_S and audible(phone), 5
            )
            clears = len(phone.clears)
            session = phone_session(gateway)
            heard_before = len(user_transcripts(session))
            n = phone.say(spoken(words, 8000))
            await phone.until_said(n)
            onset = phone.onsets[-1]
            cleared = await until(
                lambda c=clears: len(phone.clears) > c,
                MISSED_AFTER_S - (time.monotonic() - onset),
            )
            await until(lambda o=onset: silent_after(phone, o) is not None, 10)
            silent = silent_after(phone, onset)
            # the agent heard on both sides of the onset: a reply that ended, or paused
            # between two phrases, at the onset had nothing there to interrupt
            playing = any(onset - AUDIBLE_S <= t <= onset for t in phone.voiced_at) and any(
                onset < t <= onset + AUDIBLE_S for t in phone.voiced_at
            )
            await hear_reply(phone)  # the answer to it, or the rest of the reply it missed
            # the caller's turns since the question's: the interruption's words
            said = " ".join(t for t in user_transcripts(session)[heard_before:] if t)
            edits, total = errors(words, said)
            barge.append(
                {
                    "missed": not cleared,
                    "agent_playing": playing,
                    "onset_to_silent_ms": (
                        None if silent is None or not playing else (silent - onset) * 1000
                    ),
                    "heard": said,
                    "edits": edits,
                    "words": total,
                }
            )
            log(f"  barge-in {words!r}: {barge[-1]}")
        path = echo_path(phone_session(gateway))
    return {"replies": stopped, "barge_ins": barge, "echo_path": path}


def echo_path(session: Any) -> dict[str, Any] | None:
    """What the call's canceller judged of its echo path (gateway.echo.EchoPath) by its end,
    the share of its frames that took the output without AEC3, where the echo sat against the
    far end over the call (ms -> judgements; a far end placed late shows as a short delay),
    and how the phone player's lag moved the far end (None: no canceller)."""
    canceller = getattr(session, "echo", None)
    if canceller is None or not canceller.processing.echo:
        return None
    path, player = canceller.echo_path, session.transport.player
    return {
        "present": path.present,
        "rise_db": None if path.rise_db is None else round(path.rise_db, 1),
        "frames_without_aec3": round(canceller.clean_frames / max(canceller.frames, 1), 3),
        "echo_delay_ms": {str(10 * k): n for k, n in sorted(path.delays.items())},
        "player_lag_moves": player.moves,
        "player_lag_most_ms": round(player.most * 1000),
    }


def condition_figures(run: dict[str, Any]) -> dict[str, Any]:
    replies, every = run["replies"], run["barge_ins"]
    self_cut = [r for r in replies if r["holds"] or r["speech_started"] or r["clears"]]
    # one that began with the agent already silent had nothing to interrupt: counted apart
    barge = [b for b in every if b["agent_playing"]]
    silent = [b["onset_to_silent_ms"] for b in barge if b["onset_to_silent_ms"] is not None]
    words = sum(b["words"] for b in every)
    return {
        "replies": len(replies),
        "self_interrupted": len(self_cut),
        "barge_ins": len(barge),
        "barge_ins_missed": sum(b["missed"] for b in barge),
        "barge_ins_over_silence": len(every) - len(barge),
        "onset_to_silent_ms": summary(silent, 50, 95),
        "wer": round(sum(b["edits"] for b in every) / words, 4) if words else None,
        "echo_path": run.get("echo_path"),
    }


async def quality(
    config: Any, supervisor: Any, cancel: bool, conditions: list[EchoSettings | None], args: Any
) -> dict[str, Any]:
    out = {}
    async with tapped_gateway(config, supervisor) as (base, gateway, _):
        url = base.replace("http", "ws") + "/v1/telephony/twilio"
        for echo in conditions:
            name = (
                "no echo" if echo is None else f"{echo.delay_ms:g} ms, -{echo.attenuation_db:g} dB"
            )
            log(f"canceller {'on' if cancel else 'off'}: {name}")
            run = await condition(url, gateway, echo, args.part, args.replies, args.barge_ins)
            out[name] = {"figures": condition_figures(run), **run}
    return out


# -- the cost at load ------------------------------------------------------------------------


def loop_lag(base: str) -> dict[float, float]:
    """The gateway's loop-lag histogram: cumulative counts by bucket bound (s)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "omni_event_loop_lag_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    out[float(sample.labels["le"])] = sample.value
    return out


def p99_bound_ms(before: dict[float, float], after: dict[float, float]) -> float | None:
    """The smallest bucket bound under which 99% of the wake-ups between two readings were
    (None: over the largest finite bound, a second, or no wake-up at all)."""
    counts = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    total = counts.get(float("inf"), 0.0)
    if not total:
        return None
    for le, n in counts.items():
        if n >= 0.99 * total:
            return le * 1000 if math.isfinite(le) else None
    return None


def cost(args: Any, cancel: bool, echo: EchoSettings) -> dict[str, Any]:
    import psutil

    from loadtest.service import Service
    from loadtest.telephony_bench import run_phones
    from loadtest.voices import spoken

    data = yaml.safe_load(args.load_config.read_text())
    gw = data.setdefault("gateway", {})
    gw["auth"] = {"enabled": False}
    gw["processes"] = 1
    gw["max_calls"] = args.load_calls + 2
    gw.setdefault("media", {})["echo_cancel"] = {"phone": cancel}
    data["max_sessions"] = max(data.get("max_sessions", 0), args.load_calls + 2)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "echo-load.yaml"
        path.write_text(yaml.safe_dump(data))
        with Service(path) as service:
            base, pids = service.started()
            url = base.replace("http", "ws") + "/v1/telephony/twilio"
            log(f"{args.load_calls} phone calls, canceller {'on' if cancel else 'off'}")
            gateway = psutil.Process(pids["gateway"])
            lag_before, cpu_before = loop_lag(base), gateway.cpu_times()
            started = time.monotonic()
            with mp.get_context("spawn").Pool(1) as pool:
                question = spoken(QUESTIONS[args.part][0], 8000)
                result = pool.apply(
                    run_phones, (url, args.load_calls, question, args.load_seconds, echo)
                )
            seconds = time.monotonic() - started
            cpu_after, lag_after = gateway.cpu_times(), loop_lag(base)
    cpu = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)
    return {
        "calls": args.load_calls,
        "replied": sum(result["replied"]),
        "seconds": round(seconds, 1),
        "core_share_per_call": round(cpu / seconds / args.load_calls, 4),
        "loop_lag_p99_ms_at_most": p99_bound_ms(lag_before, lag_after),
    }


# -- the report ------------------------------------------------------------------------------


def path_cell(path: dict[str, Any] | None) -> str:
    if path is None:
        return "- | - | -"
    judged = "there" if path["present"] else "none"
    delays = [int(ms) for ms in path.get("echo_delay_ms", {})]
    spread = f"{min(delays)}-{max(delays)}" if delays else "-"
    return (
        f"{judged} ({path['rise_db']}), {path['frames_without_aec3']:.0%} | {spread} | "
        f"{path.get('player_lag_moves', 0)} ({path.get('player_lag_most_ms', 0)})"
    )


def table(report: dict[str, Any]) -> str:
    rows = [
        "| canceller | echo | self-interrupted replies | barge-ins missed (over silence, apart) "
        "| onset → agent silent p50 / p95 ms | WER of the words over the agent "
        "| echo path at the end (rise dB), frames without AEC3 | echo's delay behind the far "
        "end, ms | player lag moves (most ms) |",
        "|---|---|---:|---:|---:|---:|---|---|---|",
    ]
    for variant, conditions in report["quality"].items():
        for name, run in conditions.items():
            f = run["figures"]
            silent = f["onset_to_silent_ms"]
            rows.append(
                f"| {variant} | {name} | {f['self_interrupted']}/{f['replies']} | "
                f"{f['barge_ins_missed']}/{f['barge_ins']} ({f['barge_ins_over_silence']}) | "
                f"{silent['p50']} / {silent['p95']} | "
                f"{f['wer']} | {path_cell(f.get('echo_path'))} |"
            )
    if report.get("cost"):
        rows += [
            "",
            "| canceller | calls | replied | gateway CPU per call (share of a core) | "
            "loop lag p99 at most ms |",
            "|---|---:|---:|---:|---:|",
        ]
        for variant, c in report["cost"].items():
            rows.append(
                f"| {variant} | {c['calls']} | {c['replied']} | {c['core_share_per_call']} | "
                f"{c['loop_lag_p99_ms_at_most'] or 'over 1000'} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from gateway.config import load_config
    from stages.supervisor import Supervisor

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "offline.yaml")
    parser.add_argument("--delays", default="60,150,250", help="echo delays, ms")
    parser.add_argument("--levels", default="6,20", help="echo attenuations, dB")
    parser.add_argument("--part", choices=tuple(QUESTIONS), default="test")
    parser.add_argument("--replies", type=int, default=3, help="at most 4")
    parser.add_argument("--barge-ins", type=int, default=3, help="at most 4")
    parser.add_argument("--load-config", type=Path, default=ROOT / "configs" / "tiny.yaml")
    parser.add_argument("--load-calls", type=int, default=20, help="0: no cost phase")
    parser.add_argument("--load-seconds", type=float, default=30)
    parser.add_argument("--variants", default="off,on", help="the canceller off, on, or both")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",")]
    if not variants or not set(variants) <= {"off", "on"}:
        parser.error(f"--variants: off, on or both, not {args.variants!r}")
    if not 1 <= args.replies <= 4 or not 1 <= args.barge_ins <= 4:
        parser.error("--replies and --barge-ins: 1 to 4")
    echoes: list[EchoSettings | None] = [None]
    for delay in (float(d) for d in args.delays.split(",")):
        for level in (float(a) for a in args.levels.split(",")):
            echoes.append(EchoSettings(delay, level, ROOM_MS, noise_dbfs=NOISE_DBFS))
    report: dict[str, Any] = {
        "benchmark": "loadtest.echo_bench",
        "date": datetime.date.today().isoformat(),
        "machine": describe_machine(),
        "config": args.config.name,
        "load_config": args.load_config.name,
        "part": args.part,
        "quality": {},
        "cost": {},
    }
    profile = {"default": {"instructions": INSTRUCTIONS}}
    base_overrides = {"gateway.port": 0, "gateway.auth": {"enabled": False}}
    config = load_config(args.config, {**base_overrides, "gateway.telephony.profiles": profile})
    with Supervisor(config) as supervisor:
        supervisor.start(progress=log)
        for cancel in (v == "on" for v in variants):
            variant = load_config(
                args.config,
                {
                    **base_overrides,
                    "gateway.telephony.profiles": profile,
                    "gateway.media.echo_cancel.phone": cancel,
                },
            )
            report["quality"]["on" if cancel else "off"] = asyncio.run(
                quality(variant, supervisor, cancel, echoes, args)
            )
    if args.load_calls:
        loudest = EchoSettings(150, 6, ROOM_MS, noise_dbfs=NOISE_DBFS)
        for cancel in (v == "on" for v in variants):
            report["cost"]["on" if cancel else "off"] = cost(args, cancel, loudest)
    publish(report, table(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
