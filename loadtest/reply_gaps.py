"""Silences inside the agent's replies, as the caller hears them, and where each long one
came from.

    python -m loadtest.reply_gaps [--config configs/offline.yaml] [--part test]
        [--questions 8] [--busy-cores 1.0] [--set KEY=V1,V2 ...] [--out DIR]

One WebRTC caller (gateway.client: a real aiortc peer, real Opus) asks each question, spoken
by espeak-ng, in a call of its own, against the stages and the gateway of `--config` on
127.0.0.1, and listens to the whole reply. The session asks for a few sentences, so that a
reply has several phrases. Every variant of `--set` runs in this one run, in turn. The
questions are split once into a tuning half and a test half (`--part`): settings such as
`vocoder.early_phrase_ms` are chosen on the first, and the second is reported.
`--busy-cores` takes that much of the machine's CPU meanwhile (processes spinning for a share
of each 10 ms): on a 2-core machine the caller's own client (a browser, pipecat with its VAD)
runs beside the gateway, and the pipeline's pace against the voice is tested there.

What it reports, per variant:
- silences heard: the runs of silent 20 ms frames inside each reply (between its first and its
  last voiced frame at the caller), p50/p99/max, and how many are over `--gap-ms`;
- the voice's own pauses: the same replies' phrases synthesized by the same voice in this
  process, one after another with nothing waiting (the longest silence inside each), so that a
  pause the voice makes is told apart from one the pipeline makes;
- where a phrase came late, from the stage records the gateway received (a tap on its
  readers): for each phrase after the first, when its text was complete (`ready_ns`), when
  the vocoder began it, and when its first audio reached the gateway, against when the audio
  before it would have finished playing. A phrase whose audio came after that is a stall, put
  down to the words (its text was complete after the audio before it had played out) or to
  the voice (the text was there in time, and making it took longer than was left).
Prints JSON and a table; writes results.json and table.md under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.bench import describe_machine, log, publish, summary
from loadtest.settings import add_set_argument, setting_overrides

ROOT = Path(__file__).parents[1]
# open questions that a small model answers in several sentences: the tuning half, then the
# test half
QUESTIONS = {
    "tuning": (
        "Why is the sky blue?",
        "Describe a day at the beach.",
        "How do bees make honey?",
        "Tell me about the history of Paris.",
        "What should I pack for a week of hiking?",
        "How does a train work?",
        "What do cats like to do all day?",
        "Tell me about the moon.",
    ),
    "test": (
        "How do I make a cup of tea?",
        "What happens in a thunderstorm?",
        "Why do leaves change color in autumn?",
        "What is it like to live on a farm?",
        "How do birds know where to fly in winter?",
        "Tell me about the ocean.",
        "How is bread made?",
        "What makes a good friend?",
    ),
}
INSTRUCTIONS = "You are a helpful assistant. Answer in three or four sentences."
# `--long-instructions`: a persona and a knowledge base before the question, as a deployed
# agent's instructions are (aiewf-eval's: about 950 tokens cut to fit the offline model), so
# that each decode step attends over a long context, as it does there
KNOWLEDGE = (
    "The Riverside Community Center opens at seven in the morning and closes at ten at night "
    "on weekdays, and opens at nine and closes at six on weekends.",
    "The swimming pool has six lanes; lane swimming is from seven to nine every morning and "
    "families swim from four to six in the afternoon.",
    "Yoga classes run on Monday, Wednesday and Friday at noon in Studio B, and cost eight "
    "dollars a class or sixty dollars for ten classes.",
    "The library on the second floor lends books, films and board games for three weeks, and "
    "a card is free for anyone who lives in the county.",
    "Parking is free for the first two hours in the north lot; the south lot is for staff and "
    "for delivery vans between six and eight in the morning.",
    "Children under twelve must be with an adult in the gym, the pool and the climbing wall, "
    "and children under five swim free.",
    "The cafe serves breakfast until eleven, soup and sandwiches until three, and coffee, tea "
    "and cakes until the center closes.",
    "Rooms can be booked for parties and meetings at least a week ahead at the front desk or "
    "by phone, for twenty dollars an hour.",
    "Lost property is kept at the front desk for thirty days and then given to charity.",
    "The climbing wall is open to members over fourteen who have passed the safety course, "
    "which runs every Saturday morning at ten.",
)
LONG_INSTRUCTIONS = (
    "You are Sam, the friendly voice assistant of the Riverside Community Center. You answer "
    "callers' questions warmly and clearly, in three or four full sentences, as you would on "
    "the phone. If you do not know something, say so and offer to put the caller through to "
    "the front desk. Never make up prices or times.\n\nWhat you know about the center:\n- "
    + "\n- ".join(KNOWLEDGE * 3)
)
MAX_OUTPUT_TOKENS = 120
SILENT_RMS = 30.0  # as loadtest.conversation: Opus silence decodes to a few LSBs
FRAME_MS = 20


def spin(duty: float, stop: Any) -> None:
    """Keep a core busy for `duty` of every 10 ms until `stop` is set."""
    while not stop.is_set():
        until = time.perf_counter() + 0.01 * duty
        while time.perf_counter() < until:
            pass
        time.sleep(0.01 * (1 - duty))


@contextlib.contextmanager
def busy(cores: float) -> Iterator[None]:
    """`cores` cores' worth of CPU taken by spinning processes, for the block."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    duties = [1.0] * int(cores) + ([cores - int(cores)] if cores % 1 else [])
    procs = [ctx.Process(target=spin, args=(d, stop), daemon=True) for d in duties]
    for p in procs:
        p.start()
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


def silences_ms(levels: list[float]) -> list[int]:
    """The silent runs between the first and the last voiced frame, in ms."""
    voiced = np.flatnonzero(np.asarray(levels) > SILENT_RMS)
    if len(voiced) < 2:
        return []
    runs, n = [], 0
    for silent in np.asarray(levels[voiced[0] : voiced[-1] + 1]) <= SILENT_RMS:
        if silent:
            n += 1
        elif n:
            runs.append(n * FRAME_MS)
            n = 0
    return runs


def pcm_silences_ms(pcm: np.ndarray, rate: int) -> list[int]:
    """silences_ms of audio at `rate`, cut into 20 ms frames."""
    frame = rate * FRAME_MS // 1000
    frames = pcm[: len(pcm) // frame * frame].astype(np.float64).reshape(-1, frame)
    return silences_ms(list(np.sqrt((frames**2).mean(axis=1))))


def phrase_timeline(seen: list[Any], heard_at: float) -> list[dict]:
    """Each phrase of a reply: when its text was complete, when the vocoder began it, when its
    first audio reached the gateway, and how late that was against the playback of the audio
    before it (which began when the caller first heard the reply, `heard_at`)."""
    from stages.messages import Kind

    phrases: list[dict[str, Any]] = []
    for s in seen:
        if s.kind is Kind.PHRASE:
            phrases.append(
                {
                    "text": s.msg.text,
                    "rate": s.msg.sample_rate,
                    "ready_ns": s.msg.ready_ns,
                    "spoken_ns": s.t_ns,
                    "audio_ns": None,
                    "samples": 0,
                }
            )
        elif s.kind is Kind.AUDIO_OUT and phrases:
            p = phrases[-1]
            p["audio_ns"] = p["audio_ns"] or s.recv_ns
            p["samples"] += s.nbytes // 2
    out = []
    playing_until = heard_at * 1e9
    for k, p in enumerate(phrases):
        if p["audio_ns"] is None:
            continue
        row = {"text": p["text"], "seconds": round(p["samples"] / p["rate"], 2)}
        if k:
            due = playing_until
            row["late_ms"] = round(max(0.0, p["audio_ns"] - due) / 1e6)
            row["words_ms"] = round((p["ready_ns"] - due) / 1e6)  # > 0: complete after due
            row["voice_ms"] = round((p["audio_ns"] - max(p["ready_ns"], p["spoken_ns"])) / 1e6)
            row["queued_ms"] = round((p["spoken_ns"] - p["ready_ns"]) / 1e6)
            playing_until = max(due, p["audio_ns"])
        playing_until += p["samples"] / p["rate"] * 1e9
        out.append(row)
    return out


async def ask(
    base: str, tap: Any, question: str, clip: np.ndarray, instructions: str
) -> dict[str, Any]:
    """One question in a call of its own: the reply's silences and its phrases' timeline."""
    from gateway.client import RealtimeCall

    call = await RealtimeCall.connect(base)
    try:
        await call.next_event("session.created")
        session = {
            "type": "realtime",
            "instructions": instructions,
            "max_output_tokens": MAX_OUTPUT_TOKENS,
        }
        call.send({"type": "session.update", "session": session})
        await call.next_event("session.updated")
        mark = tap.mark()
        call.microphone.play(clip)
        done = await call.next_event("response.done", timeout=120)
        await call.next_event("output_audio_buffer.stopped", timeout=120)
        levels = call.speaker.levels
        voiced = [i for i, lv in enumerate(levels) if lv > SILENT_RMS]
        heard_at = call.speaker.arrivals[voiced[0]] if voiced else time.monotonic()
        seen = [s for s in tap.since(mark) if s.call_id == call.call_id]
        output = done["response"]["output"]
        said = output[0]["content"][0].get("transcript", "") if output else ""
        return {
            "question": question,
            "said": said,
            "status": done["response"]["status"],
            "silences_ms": silences_ms(levels),
            "phrases": phrase_timeline(seen, heard_at),
        }
    finally:
        await call.close()


def own_pauses(config: Any, replies: list[dict[str, Any]]) -> list[int]:
    """The longest silence inside each reply as the voice itself makes it: its phrases
    synthesized one after another in this process, nothing waiting between them."""
    from stages.vocoder import load_voice

    voice = load_voice(config.vocoder)
    longest = []
    for reply in replies:
        texts = [p["text"] for p in reply["phrases"]]
        if not texts:
            continue
        pcm = np.concatenate(
            [np.concatenate(list(voice.synthesize(t, stop=lambda: False))) for t in texts]
        )
        longest.append(max(pcm_silences_ms(pcm, voice.sample_rate), default=0))
    return longest


async def run_variant(
    config: Any, clips: list[np.ndarray], questions: list[str], instructions: str, busy_cores: float
) -> list[dict]:
    from loadtest.tap import tapped_gateway
    from stages.supervisor import Supervisor

    with Supervisor(config) as supervisor:
        supervisor.start(progress=log)
        async with (
            tapped_gateway(config, supervisor) as (base, _, tap),
            contextlib.AsyncExitStack() as stack,
        ):
            stack.enter_context(busy(busy_cores))
            replies = []
            for question, clip in zip(questions, clips, strict=True):
                reply = await ask(base, tap, question, clip, instructions)
                long = [s for s in reply["silences_ms"] if s > 200]
                log(f"{question!r}: silences over 200 ms {long}")
                replies.append(reply)
            return replies


def figures(replies: list[dict[str, Any]], own: list[int], gap_ms: int) -> dict[str, Any]:
    heard = [s for r in replies for s in r["silences_ms"]]
    late = [p for r in replies for p in r["phrases"] if p.get("late_ms")]
    stalls = [p for p in late if p["late_ms"] > 0]
    for_words = [p for p in stalls if p["words_ms"] > 0]
    return {
        "replies": len(replies),
        "completed": sum(r["status"] == "completed" for r in replies),
        "silences_heard_ms": summary(heard, 50, 99),
        "silences_over_gap": sum(s > gap_ms for s in heard),
        "replies_with_a_silence_over_gap": sum(
            any(s > gap_ms for s in r["silences_ms"]) for r in replies
        ),
        "voice_own_longest_pause_ms": summary(own, 50, 99),
        "phrases": sum(len(r["phrases"]) for r in replies),
        "phrases_late": len(stalls),
        "late_ms": summary([p["late_ms"] for p in stalls], 50, 99),
        "late_for_words": len(for_words),
        "late_for_the_voice": len(stalls) - len(for_words),
        "voice_ms_of_late_phrases": summary([p["voice_ms"] for p in stalls], 50),
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        f"Silences inside replies ({results['machine']['cpus']} CPUs, {results['date']}); "
        f"gap = a silence over {results['gap_ms']} ms; the {results['part']} half of the "
        f"questions; {results['busy_cores']} cores kept busy meanwhile",
        "",
        "| variant | replies | silence p50/p99/max ms | gaps | voice's own longest "
        "p50/max ms | phrases late | late p50/max ms | for the words / the voice |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in results["variants"].items():
        f = v["figures"]
        s, own, late = f["silences_heard_ms"], f["voice_own_longest_pause_ms"], f["late_ms"]
        lines.append(
            f"| {name} | {f['completed']}/{f['replies']} | {s['p50']}/{s['p99']}/{s['max']} | "
            f"{f['silences_over_gap']} in {f['replies_with_a_silence_over_gap']} replies | "
            f"{own['p50']}/{own['max']} | {f['phrases_late']}/{f['phrases']} | "
            f"{late['p50']}/{late['max']} | {f['late_for_words']} / {f['late_for_the_voice']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from gateway.config import load_config
    from loadtest.voices import spoken

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "offline.yaml")
    parser.add_argument("--part", choices=tuple(QUESTIONS), default="test")
    parser.add_argument("--questions", type=int, default=8, help="of the part, at most 8")
    parser.add_argument("--gap-ms", type=int, default=400, help="a silence over this is a gap")
    parser.add_argument(
        "--busy-cores", type=float, default=0.0, help="CPU taken meanwhile, in cores"
    )
    parser.add_argument(
        "--long-instructions", action="store_true", help="a persona and a knowledge base"
    )
    parser.add_argument("--out", type=Path)
    add_set_argument(parser, "vocoder.max_phrase_words=20,8")
    args = parser.parse_args(argv)
    part = QUESTIONS[args.part]
    if not 1 <= args.questions <= len(part):
        parser.error(f"--questions must be 1 to {len(part)}")
    questions = list(part[: args.questions])
    instructions = LONG_INSTRUCTIONS if args.long_instructions else INSTRUCTIONS
    clips = [spoken(q) for q in questions]
    results: dict[str, Any] = {
        "machine": describe_machine(),
        "date": datetime.date.today().isoformat(),
        "config": str(args.config.relative_to(ROOT))
        if args.config.resolve().is_relative_to(ROOT)
        else str(args.config),
        "gap_ms": args.gap_ms,
        "part": args.part,
        "busy_cores": args.busy_cores,
        "instructions": instructions,
        "variants": {},
    }
    for chosen in itertools.product(*args.set):
        name = ",".join(f"{k}={v}" for k, v in chosen) or "as configured"
        config = load_config(args.config, {"gateway.port": 0, **setting_overrides(chosen)})
        log(f"variant {name}")
        replies = asyncio.run(run_variant(config, clips, questions, instructions, args.busy_cores))
        own = own_pauses(config, replies)
        results["variants"][name] = {
            "figures": figures(replies, own, args.gap_ms),
            "replies": replies,
        }
    publish(results, table(results), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
