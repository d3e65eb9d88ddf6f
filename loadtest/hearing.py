"""The recognizer's models and decoding options compared on the spoken questions, in this
process: a fast way to choose on the tuning part before loadtest.offline_quality reports the
choice through the gateway on the test part.

    python -m loadtest.hearing [--part tuning] [--limit N] [--out DIR] [--pause-ms 80]
        [--variants 'tiny.en beam 5=bundled:whisper-tiny.en,beam_size=5;...']

Each question of the part is said in every one of loadtest.offline_quality's `CONDITIONS` and
brought through the transport's codec as the gateway would get it: Opus at 48 kHz (aiortc's
encoder and decoder, 20 ms frames) then the gateway's downmix to 16 kHz, or for the phone
μ-law at 8 kHz through the gateway's G.711 coder. Every variant (a CTranslate2 Whisper model
and its options, `loadtest.hearing.parse_variants`) then transcribes each clip whole, as the
encoder's last decode of a turn does, one at a time on `cpu_threads` threads. Per variant:
the mean word error rate, by condition, and the decode's time p50/p95 (the time to the
transcript once the turn has ended).

With `--pause-ms`, the transcript at the caller's pause against the whole turn's (the reply
prepared at the pause answers the one, the turn ends with the other). Each clip, between
silences, goes through the gateway's VAD (gateway.turns.detector, a 500 ms window) as a turn,
and is transcribed three ways: whole, as the window ends it; up to its last pause of that
many ms; and up to that pause with the silence the window would still add after it, as the
encoder does. Per variant: how many of each equal the whole turn's, and each one's WER.
Prints JSON and a table; writes results.json and table.md under --out.
"""

from __future__ import annotations

import argparse
import datetime
import fractions
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from loadtest.bench import describe_machine, log, publish, summary
from loadtest.offline_quality import CONDITIONS, Condition, errors, utterances
from loadtest.spoken_questions import PARTS

DEFAULT_VARIANTS = (
    "tiny.en greedy=bundled:whisper-tiny.en,beam_size=1",
    "tiny.en beam 5=bundled:whisper-tiny.en,beam_size=5",
    "base beam 5=bundled:whisper-base,beam_size=5",
)


@dataclass(frozen=True)
class Variant:
    """A recognizer to compare: a name, a CTranslate2 Whisper model and its options."""

    name: str
    model: str
    options: dict[str, Any]


def parse_variants(text: str) -> list[Variant]:
    """`NAME=MODEL[,KEY=VALUE...]` separated by ";", the values YAML scalars
    (`base prompted=bundled:whisper-base,beam_size=5,initial_prompt=A caller asks.`)."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, sep, rest = item.partition("=")
        model, *pairs = rest.split(",")
        if not sep or not name.strip() or not model:
            raise argparse.ArgumentTypeError(f"--variants {item!r}: NAME=MODEL[,KEY=VALUE...]")
        options = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise argparse.ArgumentTypeError(f"--variants {item!r}: {pair!r} is not KEY=VALUE")
            options[key.strip()] = yaml.safe_load(value)
        out.append(Variant(name.strip(), model.strip(), options))
    if not out:
        raise argparse.ArgumentTypeError("--variants: none given")
    return out


def through_opus(clip: np.ndarray) -> np.ndarray:
    """48 kHz PCM16 through WebRTC's Opus in 20 ms frames and the gateway's downmix: 16 kHz."""
    from aiortc.codecs.opus import OpusDecoder, OpusEncoder
    from aiortc.jitterbuffer import JitterFrame
    from av import AudioFrame

    from gateway.resample import Downmixer

    encoder, decoder, downmix = OpusEncoder(), OpusDecoder(), Downmixer()
    out = []
    for at in range(0, len(clip) - 959, 960):
        frame = AudioFrame.from_ndarray(clip[at : at + 960].reshape(1, -1), layout="mono")
        frame.sample_rate, frame.pts = 48000, at
        frame.time_base = fractions.Fraction(1, 48000)
        packets, _ = encoder.encode(frame)
        for packet in packets:
            for decoded in decoder.decode(JitterFrame(data=packet, timestamp=at)):
                out.append(downmix.convert(decoded))
    out.append(downmix.flush())
    return np.concatenate(out)


def through_phone(clip: np.ndarray) -> np.ndarray:
    """8 kHz PCM16 as μ-law and back through the gateway's G.711 coder: 16 kHz."""
    from gateway.g711 import G711

    coder = G711("audio/pcmu", source_rate=8000)
    return coder.decode(coder.encode(clip) + coder.flush())


def heard_as(condition: Condition, texts: list[str]) -> list[np.ndarray]:
    """The texts said as `condition` says them, at 16 kHz as the encoder would get them."""
    carry = through_phone if condition.phone else through_opus
    return [carry(clip) for clip in utterances(condition, texts)]


def loaded(variant: Variant) -> tuple[dict[str, Any], Any]:
    """The variant's options (2 threads unless it says) and its recognizer, loaded with
    them; no partial transcripts, as the offline profile."""
    from stages.backends import bundled
    from stages.backends.asr_ctranslate2 import load_ctranslate2_whisper

    options = {"cpu_threads": 2, "partial_interval_ms": 0} | variant.options
    return options, load_ctranslate2_whisper(bundled.resolve(variant.model), **options)


def run_variant(
    variant: Variant, clips: dict[str, list[np.ndarray]], texts: list[str]
) -> dict[str, Any]:
    options, recognizer = loaded(variant)
    by_condition: dict[str, Any] = {}
    seconds: list[float] = []
    for name, audios in clips.items():
        edits = total = 0
        heard = []
        for text, audio in zip(texts, audios, strict=True):
            started = time.perf_counter()
            transcript = recognizer.transcribe(audio)
            seconds.append(time.perf_counter() - started)
            e, n = errors(text, transcript)
            edits, total = edits + e, total + n
            heard.append(transcript)
        by_condition[name] = {"wer": round(edits / total, 4), "heard": heard}
    wers = [c["wer"] for c in by_condition.values()]
    return {
        "model": variant.model,
        "options": options,
        "mean_wer": round(float(np.mean(wers)), 4),
        "worst_wer": max(wers),
        "decode_ms": summary([s * 1000 for s in seconds], 50, 95),
        "conditions": by_condition,
    }


SILENCE_MS = 500  # the VAD's window, the default's


def at_pause(audio: np.ndarray, pause_ms: int) -> tuple[np.ndarray, int, int] | None:
    """`audio` said between silences, as the gateway's VAD makes it a turn: the turn's audio
    up to its end, where its last pause began (samples), and the silence still to come then
    (samples); None if the VAD found no turn with a pause."""
    from gateway.turns.detector import TurnDetector, VadPause, VadStart, VadStop
    from stages.messages import CALLER_RATE, FRAME_SAMPLES

    quiet = np.zeros(CALLER_RATE, np.int16)
    audio = np.concatenate([quiet, audio, quiet])
    detector = TurnDetector(silence_duration_ms=SILENCE_MS, pause_ms=pause_ms)
    turn: list[np.ndarray] = []
    paused: tuple[int, int] | None = None
    for start in range(0, len(audio) - FRAME_SAMPLES + 1, FRAME_SAMPLES):
        frame = audio[start : start + FRAME_SAMPLES]
        for event in detector.feed(frame):
            if isinstance(event, VadStart):
                turn, paused = [event.prefix], None
            elif isinstance(event, VadPause):
                to_come = event.silence_to_come_ms * CALLER_RATE // 1000
                paused = (sum(len(a) for a in turn), to_come)
            elif isinstance(event, VadStop):
                return None if paused is None else (np.concatenate(turn), *paused)
        if detector.in_speech:
            turn.append(frame)
    return None


def run_pauses(
    variant: Variant, clips: dict[str, list[np.ndarray]], texts: list[str], pause_ms: int
) -> dict[str, Any]:
    """The variant's transcripts at the pause against the whole turn's (`--pause-ms`), the
    pause's through the encoder's own stream (`peek`, with and without the silence)."""
    options, recognizer = loaded(variant)
    ways = ("whole", "at_pause", "with_silence")
    same = dict.fromkeys(ways, 0)
    edits = dict.fromkeys(ways, 0)
    words = turns = 0
    for audios in clips.values():
        for text, audio in zip(texts, audios, strict=True):
            if (found := at_pause(audio, pause_ms)) is None:
                continue
            turn, end, to_come = found
            stream = recognizer.open_stream()
            try:
                stream.feed(turn[:end])
                heard = {
                    "whole": recognizer.transcribe(turn),
                    "at_pause": stream.peek(),
                    "with_silence": stream.peek(to_come),
                }
            finally:
                stream.close()
            turns += 1
            for way, said in heard.items():
                same[way] += said == heard["whole"]
                e, n = errors(text, said)
                edits[way] += e
            words += n  # the question's words: the same for each way
    return {
        "model": variant.model,
        "options": options,
        "pause_ms": pause_ms,
        "turns": turns,
        "same_as_whole": same,
        "wer": {way: round(edits[way] / max(words, 1), 4) for way in ways},
    }


def pause_table(results: dict[str, Any]) -> str:
    lines = [
        "| variant | pause ms | turns | at the pause: same as the whole turn's, WER | "
        "with the silence to come: same, WER | the whole turn's WER |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        same, wer = r["same_as_whole"], r["wer"]
        lines.append(
            f"| {name} | {r['pause_ms']} | {r['turns']} | {same['at_pause']}, "
            f"{wer['at_pause']:.3f} | {same['with_silence']}, {wer['with_silence']:.3f} | "
            f"{wer['whole']:.3f} |"
        )
    return "\n".join(lines)


def table(results: dict[str, Any]) -> str:
    conditions = [c.name for c in CONDITIONS]
    lines = [
        "| variant | mean WER | worst | decode p50 / p95 ms | " + " | ".join(conditions) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(conditions),
    ]
    for name, r in results.items():
        by = " | ".join(f"{r['conditions'][c]['wer']:.3f}" for c in conditions)
        d = r["decode_ms"]
        lines.append(
            f"| {name} | {r['mean_wer']:.3f} | {r['worst_wer']:.3f} | {d['p50']} / {d['p95']} "
            f"| {by} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=tuple(PARTS), default="tuning")
    parser.add_argument(
        "--variants", type=parse_variants, default=parse_variants(";".join(DEFAULT_VARIANTS))
    )
    parser.add_argument("--limit", type=int, default=None, help="only the first N questions")
    parser.add_argument("--pause-ms", type=int, help="the transcript at a pause this long")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit {args.limit}: must be at least 1")
    if args.pause_ms is not None and not 0 < args.pause_ms < SILENCE_MS:
        parser.error(f"--pause-ms {args.pause_ms}: must be between 0 and {SILENCE_MS} ms")
    texts = [text for text, _ in PARTS[args.part][: args.limit]]
    started = time.monotonic()
    clips = {}
    for condition in CONDITIONS:
        clips[condition.name] = heard_as(condition, texts)
        log(f"{condition.name}: {len(texts)} questions said")
    results = {}
    for variant in args.variants:
        if args.pause_ms is not None:
            results[variant.name] = r = run_pauses(variant, clips, texts, args.pause_ms)
            log(f"{variant.name}: of {r['turns']} turns the same at the pause {r['same_as_whole']}")
            continue
        results[variant.name] = r = run_variant(variant, clips, texts)
        log(f"{variant.name}: mean WER {r['mean_wer']}, decode p50 {r['decode_ms']['p50']} ms")
    report = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m loadtest.hearing " + " ".join(argv or sys.argv[1:]),
        "machine": describe_machine(),
        "part": args.part,
        "questions": texts,
        "seconds": round(time.monotonic() - started, 1),
        "variants": results,
    }
    publish(report, (table if args.pause_ms is None else pause_table)(results), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
