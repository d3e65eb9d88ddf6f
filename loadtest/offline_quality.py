"""How well the offline profile hears and answers, through the gateway's real audio path, on
spoken questions it was never tuned on.

    python -m loadtest.offline_quality [--config configs/offline.yaml] [--part test]
        [--encoders ctranslate2=bundled:whisper-tiny.en,...] [--limit N] [--out DIR]

The questions (loadtest.spoken_questions) are split once into a tuning part and a test part:
prompts, examples and decoding are chosen on the first, and the second is reported (`--part`,
test by default). Every encoder in `--encoders` runs in this one run, each with the rest of the
configuration as it is: the stages and the gateway start on 127.0.0.1 and:
- each question is spoken in every one of `CONDITIONS` (six voices: Piper's and five of
  espeak-ng's, British, American, Scottish, female and male; two of them slower and faster,
  one under noise at 20 dB SNR, one over the phone: 8 kHz μ-law through the gateway's G.711
  path), by a caller with the VAD's replies off (WebRTC: a real aiortc peer, real Opus; the
  phone: Twilio's Media Streams messages), and the transcript is scored against the question
  (word error rate, numbers spelled out on both sides), per condition;
- then, with the first encoder, the caller asks each question once with replies on, in a
  call of its own, the voices taken in turn; each reply the caller heard is transcribed
  (Whisper base, in this process) and counted right when it holds one of the answer's words;
  the reply's own text is judged the same way beside it (`right_said`), since the ear errs
  too (Piper's "Oslo" heard back as "also").
Prints a table (per-condition WER, the answers right, each reply) and writes results.json
under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from loadtest.bench import describe_machine, log
from loadtest.spoken_questions import PARTS, Question

ROOT = Path(__file__).parents[1]
VOICES = (
    "piper",
    "espeak:en-us",
    "espeak:en-us+f3",
    "espeak:en-gb-x-rp",
    "espeak:en-gb-scotland",
    "espeak:en-us+m3",
)


@dataclass(frozen=True)
class Condition:
    """How a question is said: a voice, at a speed, under noise (dB SNR), or over the phone."""

    voice: str
    speed: float = 1.0
    snr_db: float | None = None
    phone: bool = False

    @property
    def name(self) -> str:
        out = self.voice
        if self.speed != 1.0:
            out += f" x{self.speed:g}"
        if self.snr_db is not None:
            out += f" noise {self.snr_db:g} dB"
        if self.phone:
            out += " phone"
        return out


CONDITIONS = (
    *(Condition(voice) for voice in VOICES),
    Condition("piper", speed=0.85),
    Condition("espeak:en-us+f3", speed=1.2),
    Condition("piper", snr_db=20.0),
    Condition("espeak:en-gb-x-rp", phone=True),
)
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


def speak(
    texts: list[str], voice: str, *, varied: bool = True, speed: float = 1.0
) -> list[np.ndarray]:
    """Each text spoken by `voice` ("piper", or "espeak:NAME"), 48 kHz mono PCM16, with
    0.3 s of silence before and 0.8 s after (the VAD's window ends the turn), `speed` times
    the voice's pace. Piper says a text a little differently each time unless `varied` is
    false (a test's fixed input)."""
    from stages.audio import resample
    from stages.backends import bundled

    if voice == "piper":
        from stages.backends.tts_piper import load_piper

        noise = {} if varied else {"noise_scale": 0.0, "noise_w": 0.0}
        tts: Any = load_piper(
            bundled.resolve("bundled:piper-en_US-joe-medium"), length_scale=1 / speed, **noise
        )
    else:
        from stages.backends.tts_espeak import load_espeak

        tts = load_espeak(voice=voice.partition(":")[2], rate_wpm=round(160 * speed))
    out = []
    for text in texts:
        pcm = resample(np.concatenate(list(tts.synthesize(text))), tts.sample_rate, 48000)
        out.append(np.concatenate([np.zeros(14400, np.int16), pcm, np.zeros(38400, np.int16)]))
    return out


def with_noise(clip: np.ndarray, snr_db: float, seed: int) -> np.ndarray:
    """`clip` under white noise `snr_db` below its speech (its voiced samples' power)."""
    speech = clip[np.abs(clip) > 300].astype(np.float64)
    power = float(np.mean(speech**2)) if len(speech) else 0.0
    rng = np.random.default_rng(seed)
    noise = rng.normal(0.0, np.sqrt(power / 10 ** (snr_db / 10)), len(clip))
    return np.clip(clip + noise, -32768, 32767).astype(np.int16)


def utterances(condition: Condition, texts: list[str]) -> list[np.ndarray]:
    """The texts said as `condition` says them: 48 kHz PCM16, or 8 kHz for the phone."""
    from stages.audio import resample

    clips = speak(texts, condition.voice, speed=condition.speed)
    if condition.snr_db is not None:
        clips = [with_noise(c, condition.snr_db, seed) for seed, c in enumerate(clips)]
    if condition.phone:
        clips = [resample(c, 48000, 8000) for c in clips]
    return clips


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


async def phone_transcripts(base: str, gateway: Any, clips8k: list[np.ndarray]) -> list[str]:
    """What the gateway heard over the phone (8 kHz μ-law, its G.711 path), one clip a turn;
    the phone's profile answers nothing (the run's `gateway.telephony.profiles`)."""
    from loadtest.phone import PhoneCall
    from loadtest.tap import phone_session, user_transcripts

    url = base.replace("http", "ws") + "/v1/telephony/twilio"
    async with PhoneCall.dial(url) as phone:
        session = await _until_value(lambda: phone_session(gateway), 10)
        heard: list[str] = []
        for clip in clips8k:
            before = len(user_transcripts(session))
            await phone.until_said(phone.say(clip))
            done = await _until_value(
                lambda b=before: (user_transcripts(session)[b:] or [None])[0], 60
            )
            heard.append(done or "")
        return heard


async def _until_value(read: Any, timeout: float) -> Any:
    """`read()` once it is not None, polled every 20 ms (None after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while (value := read()) is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return value


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


def right(reply_heard: str, answer: tuple[str, ...]) -> bool:
    """Whether a reply, as the caller heard it, holds one of the answer's words."""
    heard = f" {' '.join(words(reply_heard))} "
    return any(f" {' '.join(words(word))} " in heard for word in answer)


async def run_encoder(
    config_path: Path,
    settings: dict[str, Any],
    questions: list[Question],
    said: dict[str, list[np.ndarray]],
    asked: list[np.ndarray] | None,
    judge: Any,
) -> dict[str, Any]:
    """One encoder: the questions as each condition says them heard (`said`, by condition),
    and, if `asked`, each question asked once with replies on."""
    from gateway.config import load_config
    from loadtest.tap import tapped_gateway
    from stages.supervisor import Supervisor

    listen_only = {"audio": {"input": {"turn_detection": {"create_response": False}}}}
    config = load_config(
        config_path,
        {"gateway.port": 0, "gateway.telephony.profiles": {"default": listen_only}, **settings},
    )
    texts = [q for q, _ in questions]
    result: dict[str, Any] = {"settings": settings, "conditions": {}}
    with Supervisor(config) as supervisor:
        supervisor.start(progress=log)
        async with tapped_gateway(config, supervisor) as (base, gateway, _):
            for condition in CONDITIONS:
                clips = said.get(condition.name)
                if clips is None:
                    continue
                if condition.phone:
                    heard = await phone_transcripts(base, gateway, clips)
                else:
                    heard = await transcripts(base, clips)
                counted = [errors(t, h) for t, h in zip(texts, heard, strict=True)]
                edits, total = sum(e for e, _ in counted), sum(n for _, n in counted)
                result["conditions"][condition.name] = {
                    "wer": round(edits / total, 4),
                    "misheard": [
                        {"said": t, "heard": h}
                        for t, h, (e, _) in zip(texts, heard, counted, strict=True)
                        if e
                    ],
                }
                log(f"{settings}: {condition.name}: WER {edits / total:.3f}")
            if asked is not None:
                replies = await answers(base, asked, judge)
                for k, ((question, answer), reply) in enumerate(
                    zip(questions, replies, strict=True)
                ):
                    reply["question"], reply["expected"] = question, list(answer)
                    reply["voice"] = VOICES[k % len(VOICES)]
                    reply["right"] = right(reply["heard_back"], answer)
                    reply["right_said"] = right(reply["said"], answer)
                result["answers"] = replies
                n_right = sum(r["right"] for r in replies)
                n_said = sum(r["right_said"] for r in replies)
                log(
                    f"{settings}: {n_right} of {len(replies)} answers right as heard back, "
                    f"{n_said} as said"
                )
    wers = [c["wer"] for c in result["conditions"].values()]
    result["wer"] = round(float(np.mean(wers)), 4) if wers else None
    return result


def table(results: dict[str, Any]) -> str:
    conditions = list(results["encoders"][0]["conditions"])
    lines: list[str] = []
    if conditions:
        lines += [
            "| encoder | " + " | ".join(f"WER, {c}" for c in conditions) + " | mean WER |",
            "|---|" + "---:|" * (len(conditions) + 1),
        ]
    for run in results["encoders"] if conditions else []:
        cells = [f"{run['conditions'][c]['wer']:.3f}" for c in conditions]
        name = " ".join(f"{v}" for k, v in run["settings"].items() if v and k.startswith("encoder"))
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {run['wer']:.3f} |")
    first = results["encoders"][0]
    if "answers" in first:
        replies = first["answers"]
        n_right = sum(r["right"] for r in replies)
        n_said = sum(r["right_said"] for r in replies)
        lines += [
            "",
            f"answers right: {n_right} of {len(replies)} as heard back, {n_said} as said",
            "",
        ]
        lines += [
            "| question | voice | heard | reply (heard back) | right: heard back / said |",
            "|---|---|---|---|---|",
        ]
        for r in replies:
            mark = " / ".join("yes" if r[k] else "no" for k in ("right", "right_said"))
            lines.append(
                f"| {r['question']} | {r['voice']} | {r['heard']} | {r['heard_back']} | {mark} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "offline.yaml")
    parser.add_argument(
        "--encoders",
        default=",".join(DEFAULT_ENCODERS),
        help="encoders compared, comma-separated: BACKEND[=MODEL] (the first answers questions)",
    )
    parser.add_argument("--part", choices=tuple(PARTS), default="test")
    parser.add_argument("--no-answers", action="store_true", help="skip the spoken questions")
    examples = parser.add_mutually_exclusive_group()
    examples.add_argument(
        "--no-examples",
        action="store_true",
        help="the answers without the profile's example exchanges (reasoning.examples)",
    )
    examples.add_argument(
        "--examples-file",
        type=Path,
        help="a YAML list of {user, assistant} exchanges instead of the profile's",
    )
    parser.add_argument("--no-wer", action="store_true", help="skip the word error rates")
    parser.add_argument("--limit", type=int, default=None, help="only the first N questions")
    parser.add_argument("--out", type=Path, default=Path("out/offline-quality"))
    args = parser.parse_args(argv)
    from stages.backends import bundled
    from stages.backends.asr_ctranslate2 import load_ctranslate2_whisper

    args.out.mkdir(parents=True, exist_ok=True)
    questions = list(PARTS[args.part][: args.limit])
    texts = [q for q, _ in questions]
    log(f"saying {len(texts)} questions of the {args.part} part in {len(CONDITIONS)} ways")
    said = {} if args.no_wer else {c.name: utterances(c, texts) for c in CONDITIONS}
    # asked with replies on: the voices in turn, one question each
    asked = [speak([t], VOICES[k % len(VOICES)])[0] for k, t in enumerate(texts)]
    judge = load_ctranslate2_whisper(bundled.resolve("bundled:whisper-base"), cpu_threads=1)
    results: dict[str, Any] = {
        "benchmark": "offline_quality",
        "date": datetime.date.today().isoformat(),
        "command": "python -m loadtest.offline_quality " + " ".join(argv or sys.argv[1:]),
        "machine": describe_machine(),
        "config": args.config.name,
        "part": args.part,
        "questions": len(questions),
        "encoders": [],
    }
    for k, text in enumerate(args.encoders.split(",")):
        with_answers = None if (k or args.no_answers) else asked
        settings = encoder_settings(text)
        if args.no_examples:
            settings["reasoning.examples"] = []
        elif args.examples_file is not None:
            settings["reasoning.examples"] = yaml.safe_load(args.examples_file.read_text())
        results["encoders"].append(
            asyncio.run(run_encoder(args.config, settings, questions, said, with_answers, judge))
        )
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    text = table(results)
    (args.out / "table.md").write_text(text + "\n")
    print(
        json.dumps(
            {
                "machine": results["machine"],
                "part": args.part,
                "encoders": [
                    {
                        "settings": r["settings"],
                        "wer": r["wer"],
                        "right": sum(a["right"] for a in r.get("answers", [])),
                        "right_said": sum(a["right_said"] for a in r.get("answers", [])),
                    }
                    for r in results["encoders"]
                ],
            }
        )
    )
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
