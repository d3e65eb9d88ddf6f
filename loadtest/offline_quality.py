"""How well the offline profile hears and answers, through the gateway's real audio path.

    python -m loadtest.offline_quality [--config configs/offline.yaml] [--out DIR]
        [--encoders ctranslate2=bundled:whisper-tiny.en,pocketsphinx,...]

Every encoder in `--encoders` runs in this one run, each with the rest of the configuration as
it is: the stages and the gateway start on 127.0.0.1, and one WebRTC caller (gateway.client:
a real aiortc peer, real Opus) speaks each of the utterances, made by the project's own voices
(the Piper voice and two espeak-ng voices, in this process), with the VAD's replies off; the
transcript the client gets is scored against the sentence (word error rate, numbers spelled
out on both sides). Then, with the first encoder, the caller asks the spoken factual
questions with replies on, and each reply the caller heard is transcribed (Whisper base, in
this process) and counted right when it holds the expected word. Prints a table and writes
results.json under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.bench import describe_machine, log

ROOT = Path(__file__).parents[1]
SENTENCES = (
    "What is the capital of France?",
    "How many days are there in a week?",
    "The meeting starts at nine thirty tomorrow morning.",
    "Please book a table for four people at seven o'clock.",
    "My name is Sarah Connor and I live in Los Angeles.",
    "It is twenty three degrees and sunny in Madrid today.",
    "Can you remind me to call my mother on Sunday?",
    "The train to Berlin leaves from platform six.",
    "I would like to order two coffees and a croissant.",
    "What is the opposite of hot?",
    "Turn off the lights in the kitchen please.",
    "Who wrote the play Romeo and Juliet?",
    "My phone number is five five five, one two three four.",
    "How far is the moon from the earth?",
    "Set a timer for fifteen minutes.",
    "Which planet do we live on?",
    "The quick brown fox jumps over the lazy dog.",
    "Is it going to rain in London this afternoon?",
    "Tell me a short story about a brave little mouse.",
    "Thank you very much, that was very helpful.",
)
# (question, a word the right answer holds)
QUESTIONS = (
    ("What is the capital of France?", "paris"),
    ("How many days are there in a week?", "seven"),
    ("What is the opposite of hot?", "cold"),
    ("How many legs does a spider have?", "eight"),
    ("What color is the sky on a clear day?", "blue"),
    ("What is the capital of Japan?", "tokyo"),
    ("How many hours are there in a day?", "twenty four"),
    ("What is frozen water called?", "ice"),
    ("Which animal is known as the king of the jungle?", "lion"),
    ("What do bees make?", "honey"),
    ("How many months are there in a year?", "twelve"),
    ("What is the largest ocean on earth?", "pacific"),
    ("What is the capital of Italy?", "rome"),
    ("What gas do plants take in from the air?", "carbon dioxide"),
    ("How many sides does a triangle have?", "three"),
    ("What is the opposite of up?", "down"),
    ("Which season comes after winter?", "spring"),
    ("What is the capital of Germany?", "berlin"),
    ("How many minutes are there in an hour?", "sixty"),
    ("What do cows drink?", "water"),
)
VOICES = ("piper", "espeak:en-us", "espeak:en-us+f3")
DEFAULT_ENCODERS = (
    "ctranslate2=bundled:whisper-tiny.en",
    "ctranslate2=bundled:whisper-base",
    "pocketsphinx",
)


# -- words and their error rate ------------------------------------------------------------

_ONES = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
)
_TENS = (
    "_",
    "_",
    "twenty",
    "thirty",
    "forty",
    "fifty",
    "sixty",
    "seventy",
    "eighty",
    "ninety",
)


def spelled(n: int) -> str:
    """A number in words, as a caller says it ("23" -> "twenty three")."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        rest = "" if n % 100 == 0 else " " + spelled(n % 100)
        return _ONES[n // 100] + " hundred" + rest
    rest = "" if n % 1000 == 0 else " " + spelled(n % 1000)
    return spelled(n // 1000) + " thousand" + rest


def words(text: str) -> list[str]:
    """Lower case, numbers spelled out, no punctuation: the form both sides of a word error
    rate are compared in. A time (9.30) is said as two numbers; a phone number (555-1234, or
    seven digits and more) digit by digit."""
    text = text.lower().replace("dr.", "doctor")
    digits = lambda m: " ".join(_ONES[int(d)] for d in m.group(0) if d.isdigit())  # noqa: E731
    text = re.sub(r"\d+(-\d+)+|\d{7,}", digits, text)
    text = re.sub(r"(\d+)[.:](\d+)", r"\1 \2", text)
    text = re.sub(r"\d+", lambda m: f" {spelled(int(m.group(0)))} ", text)
    return re.sub(r"[^a-z' ]", " ", text).split()


def errors(reference: str, heard: str) -> tuple[int, int]:
    """(word edits, reference words): the Levenshtein distance over words."""
    ref, hyp = words(reference), words(heard)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        previous, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (r != h))
    return row[-1], len(ref)


# -- the utterances --------------------------------------------------------------------------


def speak(texts: list[str], voice: str, *, varied: bool = True) -> list[np.ndarray]:
    """Each text spoken by `voice` ("piper", or "espeak:NAME"), 48 kHz mono PCM16, with
    0.3 s of silence before and 0.8 s after (the VAD's window ends the turn). Piper says a
    text a little differently each time unless `varied` is false (a test's fixed input)."""
    from stages.audio import resample
    from stages.backends import bundled

    if voice == "piper":
        from stages.backends.tts_piper import load_piper

        noise = {} if varied else {"noise_scale": 0.0, "noise_w": 0.0}
        tts: Any = load_piper(bundled.resolve("bundled:piper-en_US-joe-medium"), **noise)
    else:
        from stages.backends.tts_espeak import load_espeak

        tts = load_espeak(voice=voice.partition(":")[2], rate_wpm=160)
    out = []
    for text in texts:
        pcm = resample(np.concatenate(list(tts.synthesize(text))), tts.sample_rate, 48000)
        out.append(np.concatenate([np.zeros(14400, np.int16), pcm, np.zeros(38400, np.int16)]))
    return out


# -- one encoder through the gateway -------------------------------------------------------------


def encoder_settings(text: str) -> dict[str, Any]:
    """`ctranslate2=bundled:whisper-tiny.en` or `pocketsphinx`: the encoder keys to set. Another
    backend than Whisper's takes its own default options, not the configuration's."""
    backend, _, model = text.partition("=")
    settings: dict[str, Any] = {"encoder.backend": backend}
    if model:
        settings["encoder.model"] = model
    if backend not in ("ctranslate2", "whisper"):
        settings["encoder.options"] = {}
    return settings


async def transcripts(base: str, clips: list[np.ndarray]) -> list[str]:
    """What the gateway's client is told it heard, one clip a turn, no replies."""
    from gateway.client import RealtimeCall

    call = await RealtimeCall.connect(base)
    try:
        call.send(
            {
                "type": "session.update",
                "session": {
                    "type": "realtime",
                    "audio": {
                        "input": {
                            "turn_detection": {"type": "server_vad", "create_response": False}
                        }
                    },
                },
            }
        )
        await call.next_event("session.updated", timeout=10)
        heard = []
        for clip in clips:
            call.microphone.play(clip)
            event = await call.next_event(
                "conversation.item.input_audio_transcription.completed", timeout=60
            )
            heard.append(event["transcript"])
        return heard
    finally:
        await call.close()


async def answers(base: str, clips: list[np.ndarray], judge: Any) -> list[dict[str, Any]]:
    """Each question asked with replies on, in a call of its own (a conversation of its own:
    the model is not led by the answers before): what was heard, said, and heard back."""
    from gateway.client import RealtimeCall
    from stages.audio import resample

    out = []
    for clip in clips:
        call = await RealtimeCall.connect(base)
        try:
            spoken_at = time.monotonic()
            call.microphone.play(clip)
            heard = await call.next_event(
                "conversation.item.input_audio_transcription.completed", timeout=60
            )
            done = await call.next_event("response.done", timeout=120)
            await call.next_event("output_audio_buffer.stopped", timeout=60)
            reply = resample(call.speaker.pcm(), 48000, 16000)
            said = done["response"]["output"][0]["content"][0].get("transcript", "")
            out.append(
                {
                    "heard": heard["transcript"],
                    "said": said,
                    "heard_back": judge.transcribe(reply[-judge.window_samples :]),
                    "seconds": round(time.monotonic() - spoken_at, 1),
                }
            )
        finally:
            await call.close()
    return out


async def run_encoder(
    config_path: Path,
    settings: dict[str, Any],
    utterances: dict[str, list[np.ndarray]],
    questions: list[np.ndarray] | None,
    judge: Any,
) -> dict[str, Any]:
    from gateway.config import load_config
    from loadtest.tap import tapped_gateway
    from stages.supervisor import Supervisor

    config = load_config(config_path, {"gateway.port": 0, **settings})
    result: dict[str, Any] = {"settings": settings, "voices": {}}
    with Supervisor(config) as supervisor:
        supervisor.start(progress=log)
        async with tapped_gateway(config, supervisor) as (base, _, _):
            for voice, clips in (utterances or {}).items():
                heard = await transcripts(base, clips)
                said = SENTENCES[: len(clips)]
                counted = [errors(s, h) for s, h in zip(said, heard, strict=True)]
                edits, total = sum(e for e, _ in counted), sum(n for _, n in counted)
                result["voices"][voice] = {
                    "wer": round(edits / total, 4),
                    "misheard": [
                        {"said": s, "heard": h}
                        for s, h, (e, _) in zip(said, heard, counted, strict=True)
                        if e
                    ],
                }
                log(f"{settings}: {voice}: WER {edits / total:.3f}")
            if questions is not None:
                replies = await answers(base, questions, judge)
                for (question, expected), reply in zip(QUESTIONS, replies, strict=False):
                    reply["question"], reply["expected"] = question, expected
                    reply["right"] = expected in " ".join(words(reply["heard_back"]))
                result["answers"] = replies
                right = sum(r["right"] for r in replies)
                log(f"{settings}: {right} of {len(replies)} answers right")
    result["wer"] = round(float(np.mean([v["wer"] for v in result["voices"].values()])), 4)
    return result


def table(results: dict[str, Any]) -> str:
    voices = list(results["encoders"][0]["voices"])
    lines: list[str] = []
    if voices:
        lines += [
            "| encoder | " + " | ".join(f"WER, {v}" for v in voices) + " | mean WER |",
            "|---|" + "---:|" * (len(voices) + 1),
        ]
    for run in results["encoders"] if voices else []:
        cells = [f"{run['voices'][v]['wer']:.3f}" for v in voices]
        name = " ".join(f"{v}" for v in run["settings"].values() if v)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {run['wer']:.3f} |")
    first = results["encoders"][0]
    if "answers" in first:
        replies = first["answers"]
        right = sum(r["right"] for r in replies)
        lines += ["", f"answers right: {right} of {len(replies)}", ""]
        lines += ["| question | heard | reply (heard back) | right |", "|---|---|---|---|"]
        for r in replies:
            right = "yes" if r["right"] else "no"
            lines.append(f"| {r['question']} | {r['heard']} | {r['heard_back']} | {right} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "offline.yaml")
    parser.add_argument(
        "--encoders",
        default=",".join(DEFAULT_ENCODERS),
        help="encoders compared, comma-separated: BACKEND[=MODEL] (the first answers questions)",
    )
    parser.add_argument("--no-answers", action="store_true", help="skip the spoken questions")
    parser.add_argument("--no-wer", action="store_true", help="skip the word error rates")
    parser.add_argument(
        "--limit", type=int, default=None, help="only the first N sentences and questions"
    )
    parser.add_argument("--out", type=Path, default=Path("out/offline-quality"))
    args = parser.parse_args(argv)
    from stages.backends import bundled
    from stages.backends.asr_ctranslate2 import load_ctranslate2_whisper

    args.out.mkdir(parents=True, exist_ok=True)
    log("making the utterances")
    sentences, asked = SENTENCES[: args.limit], QUESTIONS[: args.limit]
    utterances = {} if args.no_wer else {voice: speak(list(sentences), voice) for voice in VOICES}
    questions = speak([q for q, _ in asked], "piper")
    judge = load_ctranslate2_whisper(bundled.resolve("bundled:whisper-base"), cpu_threads=1)
    results: dict[str, Any] = {
        "benchmark": "offline_quality",
        "date": datetime.date.today().isoformat(),
        "command": "python -m loadtest.offline_quality " + " ".join(argv or sys.argv[1:]),
        "machine": describe_machine(),
        "config": str(args.config),
        "utterances": {v: len(c) for v, c in utterances.items()},
        "encoders": [],
    }
    for k, text in enumerate(args.encoders.split(",")):
        asked = None if (k or args.no_answers) else questions
        results["encoders"].append(
            asyncio.run(run_encoder(args.config, encoder_settings(text), utterances, asked, judge))
        )
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    text = table(results)
    (args.out / "table.md").write_text(text + "\n")
    print(
        json.dumps(
            {
                "machine": results["machine"],
                "encoders": [
                    {"settings": r["settings"], "wer": r["wer"]} for r in results["encoders"]
                ],
            }
        )
    )
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
