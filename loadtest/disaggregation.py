"""The disaggregation experiment: the same pipeline with a compute-heavy vocoder, run
monolithic (every stage in one process and one event loop) and disaggregated (each stage in
its own process, joined by the shared-memory rings), side by side in one run.

    python -m loadtest.disaggregation [--sessions 4] [--rounds 2] [--max-tokens 40] [--out DIR]

Both ways run the same backends, loaded by the same functions the stages use: pocketsphinx
(encoder), vLLM's AsyncLLM on the tiny random-weight chat model (reasoning), and SpeechT5 +
HiFi-GAN with RANDOM WEIGHTS of a mid size built here (vocoder: real compute, static for a
voice). `--sessions` callers speak a question in real time (200 ms chunks every 200 ms), each
`--rounds` times; every reply is `--max-tokens` tokens (ignore_eos), cut into phrases by the
stages' PhraseSplitter and synthesized unpaced.

- monolithic, vocoder on the loop: `MonolithicPipeline`, one asyncio loop holding the encoder,
  vLLM's front end (its output handler and detokenizer) and the vocoder, which synthesizes on
  the loop as a single-process server would;
- monolithic, vocoder on a thread: the same, with synthesis on one worker thread (torch drops
  the GIL inside its kernels);
- disaggregated: the Supervisor's three stage processes; the caller side drives them through
  the rings (stages.driver.speak_turn, one thread per session).
vLLM's engine core is a process of its own in all three (AsyncLLM always runs it so).

Reported for each: the reasoning stage's inter-token latency p50/p99 (where each token is
handed on: the ring stamp of each text delta, or the moment the monolithic loop gets it),
time to first token, and turn latency (end of speech to the first synthesized audio chunk).
Writes results.json under --out; prints a table and the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import itertools
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.bench import log, summary
from loadtest.voices import spoken
from stages.messages import CALLER_RATE, CHUNK_SAMPLES
from stages.tasks import cancel_and_wait

CONFIG = Path(__file__).parents[1] / "configs" / "tiny.yaml"
QUESTION = "what is the weather like today in paris"
#: SpeechT5 between the tests' tiny one and the real 144 M one (768 wide, 6+6 layers): heavy
#: enough on a CPU that a phrase takes a few hundred ms, light enough for 2 cores.
SPEECHT5_MID_SHAPE: dict[str, Any] = {
    "hidden_size": 384,
    "encoder_layers": 3,
    "decoder_layers": 3,
    "encoder_attention_heads": 6,
    "decoder_attention_heads": 6,
    "encoder_ffn_dim": 1536,
    "decoder_ffn_dim": 1536,
    "speech_decoder_prenet_units": 256,
    "speech_decoder_postnet_units": 256,
    "speaker_embedding_dim": 512,
}
HIFIGAN_MID_SHAPE: dict[str, Any] = {"upsample_initial_channel": 128}
MODES = ("monolithic_loop", "monolithic_thread", "disaggregated")


@dataclass
class TurnTimes:
    """One turn's CLOCK_MONOTONIC stamps (ns), taken where each stage hands its output on."""

    speech_stopped: int = 0
    transcript: int = 0
    tokens: list[int] = field(default_factory=list)
    first_audio: int = 0
    done: int = 0
    transcript_text: str = ""
    reply_text: str = ""
    audio_samples: int = 0

    def inter_token_ms(self) -> list[float]:
        return [(b - a) / 1e6 for a, b in itertools.pairwise(self.tokens)]

    def turn_ms(self) -> float | None:
        if not self.first_audio:
            return None
        return (self.first_audio - self.speech_stopped) / 1e6

    def first_token_ms(self) -> float | None:
        if not self.tokens or not self.transcript:
            return None
        return (self.tokens[0] - self.transcript) / 1e6


def mode_figures(turns: list[TurnTimes], wall_s: float) -> dict[str, Any]:
    """What one way of running the pipeline did over its turns."""
    turn = [t.turn_ms() for t in turns]
    ttft = [t.first_token_ms() for t in turns]
    return {
        "turns": len(turns),
        "turns_with_audio": sum(x is not None for x in turn),
        "deltas": sum(len(t.tokens) for t in turns),  # merged when the consumer lags
        "inter_token_ms": summary([x for t in turns for x in t.inter_token_ms()], 50, 99),
        "first_token_ms": summary([x for x in ttft if x is not None], 50, 95),
        "turn_ms": summary([x for x in turn if x is not None], 50, 95),
        "wall_s": round(wall_s, 1),
    }


def chunks(pcm16k: np.ndarray) -> Iterator[np.ndarray]:
    for start in range(0, len(pcm16k), CHUNK_SAMPLES):
        yield pcm16k[start : start + CHUNK_SAMPLES]


# -- (a) monolithic ----------------------------------------------------------------------


class MonolithicPipeline:
    """Encoder, reasoning and vocoder in this process, on one event loop, without rings: the
    stages' backends (encoder.load_recognizer, llm_vllm.VllmEngine, vocoder.load_voice),
    their conversation keeping and phrase splitting. Create with `start()` on the loop that
    will run it; `turn()` serves one caller turn; turns of different sessions run at once."""

    def __init__(
        self, config: Any, recognizer: Any, engine: Any, voice: Any, vocoder_thread: bool
    ) -> None:
        self.config = config
        self.recognizer = recognizer
        self.engine = engine
        self.voice = voice
        self._synth: concurrent.futures.ThreadPoolExecutor | None = None
        self.set_vocoder_thread(vocoder_thread)
        self._conversations: dict[int, Any] = {}
        self._ids = itertools.count()

    @classmethod
    async def start(cls, config: Any, vocoder_thread: bool = False) -> MonolithicPipeline:
        from stages.backends.llm_vllm import VllmEngine
        from stages.encoder import load_recognizer
        from stages.reasoning import resolve_model
        from stages.vocoder import load_voice

        recognizer = load_recognizer(config.encoder)
        voice = load_voice(config.vocoder)
        cfg = config.reasoning
        engine = await VllmEngine.start(resolve_model(cfg), cfg.engine_args, cfg.sampling)
        return cls(config, recognizer, engine, voice, vocoder_thread)

    def set_vocoder_thread(self, on: bool) -> None:
        """Synthesize on one worker thread (one vocoder, as one vocoder stage: phrases of all
        sessions take turns), or on the event loop. Between turns only."""
        if self._synth is not None:
            self._synth.shutdown(wait=True)
        self._synth = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vocoder") if on else None
        )

    @property
    def sample_rate(self) -> int:
        return int(self.voice.sample_rate)

    def conversation(self, session: int) -> Any:
        from stages.conversation import ChatHistory

        if session not in self._conversations:
            cfg = self.config.reasoning
            self._conversations[session] = ChatHistory(cfg.system_prompt, cfg.max_history_messages)
        return self._conversations[session]

    async def turn(self, session: int, pcm16k: np.ndarray, realtime: bool = True) -> TurnTimes:
        """The caller speaks `pcm16k` (in real time unless told otherwise); the reply is
        generated and spoken. Returns the turn's stamps; the audio is counted, not kept."""
        from stages.phrases import PhraseSplitter

        times = TurnTimes()
        stream = self.recognizer.open_stream()
        try:
            for chunk in chunks(pcm16k):
                stream.feed(chunk)
                # a live caller's next 200 ms; without it, other sessions still get a turn
                await asyncio.sleep(CHUNK_SAMPLES / CALLER_RATE if realtime else 0)
            times.speech_stopped = time.monotonic_ns()
            times.transcript_text = stream.finish()
        finally:
            stream.close()
        times.transcript = time.monotonic_ns()
        conversation = self.conversation(session)
        conversation.add("user", times.transcript_text)
        cfg = self.config.vocoder
        splitter = PhraseSplitter(cfg.first_phrase_words, cfg.max_phrase_words)
        phrases: asyncio.Queue[str | None] = asyncio.Queue()
        speaker = asyncio.get_running_loop().create_task(
            self._speak(phrases, times), name=f"speak-{session}"
        )
        request_id = f"mono-{session}-{next(self._ids)}"
        try:
            async for text in self.engine.generate(request_id, conversation.prompt()):
                times.tokens.append(time.monotonic_ns())
                times.reply_text += text
                for phrase in splitter.feed(text):
                    phrases.put_nowait(phrase)
            if rest := splitter.flush():
                phrases.put_nowait(rest)
            phrases.put_nowait(None)
            await speaker
        finally:
            if not speaker.done():
                await cancel_and_wait(speaker)
        conversation.add("assistant", times.reply_text)
        times.done = time.monotonic_ns()
        return times

    async def _speak(self, phrases: asyncio.Queue[str | None], times: TurnTimes) -> None:
        while (phrase := await phrases.get()) is not None:
            if self._synth is None:
                # on the loop: every other session waits while this phrase is synthesized
                for chunk in self.voice.synthesize(phrase):
                    self._heard(times, chunk)
                    await asyncio.sleep(0)
            else:
                # chunks are stamped on the thread as the voice makes them
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._synth, self._speak_phrase, phrase, times)

    def _speak_phrase(self, phrase: str, times: TurnTimes) -> None:
        for chunk in self.voice.synthesize(phrase):
            self._heard(times, chunk)

    @staticmethod
    def _heard(times: TurnTimes, chunk: np.ndarray) -> None:
        if not times.first_audio and len(chunk):
            times.first_audio = time.monotonic_ns()
        times.audio_samples += len(chunk)

    def close(self) -> None:
        self.set_vocoder_thread(False)
        self.engine.shutdown()


async def run_monolithic(
    config: Any, speech: np.ndarray, sessions: int, rounds: int, vocoder_thread: bool
) -> dict[str, Any]:
    pipeline = await MonolithicPipeline.start(config, vocoder_thread)
    try:
        await pipeline.turn(-1, speech, realtime=False)  # warm-up, not counted
        turns: list[TurnTimes] = []
        t0 = time.monotonic()
        for _ in range(rounds):
            turns += await asyncio.wait_for(
                asyncio.gather(*(pipeline.turn(s, speech) for s in range(sessions))), 600
            )
        return mode_figures(turns, time.monotonic() - t0)
    finally:
        pipeline.close()


# -- (b) disaggregated -------------------------------------------------------------------


def run_disaggregated(
    config: Any, speech: np.ndarray, sessions: int, rounds: int
) -> dict[str, Any]:
    from stages.driver import speak_turn
    from stages.link import EventQueues, PipelineLink
    from stages.messages import Kind
    from stages.supervisor import Supervisor

    def times_of(result: Any) -> TurnTimes:
        t = TurnTimes(
            speech_stopped=result.t_ns["speech_stopped"],
            transcript=result.t_ns.get("transcript", 0),
            first_audio=result.t_ns.get("first_audio", 0),
            done=result.t_ns.get("audio_done", 0),
            transcript_text=result.transcript,
            reply_text=result.reply_text,
            audio_samples=len(result.pcm16),
        )
        t.tokens = [e.t_ns for e in result.events if e.kind is Kind.TEXT_DELTA]
        return t

    with Supervisor(config) as supervisor:
        supervisor.start(progress=log)
        events = EventQueues()
        link = PipelineLink(supervisor.names, events)
        ids = [link.open_session() for _ in range(sessions + 1)]
        try:
            speak_turn(link, events, ids[-1], speech, timeout=300)  # warm-up, not counted
            turns: list[TurnTimes] = []
            t0 = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(sessions) as pool:
                for r in range(rounds):
                    futures = [
                        pool.submit(speak_turn, link, events, s, speech, r + 1, 600, True)
                        for s in ids[:sessions]
                    ]
                    turns += [times_of(f.result()) for f in futures]
            return mode_figures(turns, time.monotonic() - t0)
        finally:
            for s in ids:
                link.close_session(s)
            link.close()


# -- the run -----------------------------------------------------------------------------


def experiment_config(speecht5: Any, max_tokens: int, sessions: int) -> Any:
    """configs/tiny.yaml with SpeechT5 as the vocoder, fixed-length replies, no pacing."""
    from gateway.config import load_config

    return load_config(
        CONFIG,
        {
            "gateway.port": 0,
            "max_sessions": max(16, sessions + 4),
            "reasoning.sampling": {"max_tokens": max_tokens, "ignore_eos": True},
            "vocoder.backend": "speecht5",
            "vocoder.model": str(speecht5.model),
            "vocoder.vocoder": str(speecht5.vocoder),
            # static as long as speech: 4 mel frames (64 ms) a character; one torch thread,
            # as two cores are shared by every stage
            "vocoder.options": {"maxlenratio": 4.0, "num_threads": 1},
            "vocoder.max_lead_ms": 600_000,  # unpaced, as the monolithic driver
        },
    )


def question_pcm(text: str = QUESTION) -> np.ndarray:
    """`text` spoken by espeak-ng, 16 kHz PCM16, with 0.3 s of silence after it."""
    return np.concatenate([spoken(text, 16_000, trim=False), np.zeros(4800, np.int16)])


def table(results: dict[str, Any]) -> str:
    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}"

    rows = [
        "| mode | turns with audio | text deltas | inter-token p50 / p99 ms | first token p50 ms "
        "| turn p50 / p95 ms | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, m in results["modes"].items():
        if "error" in m:
            rows.append(f"| {mode} | failed: {m['error']} |")
            continue
        i, t = m["inter_token_ms"], m["turn_ms"]
        rows.append(
            f"| {mode} | {m['turns_with_audio']} of {m['turns']} | {m['deltas']} | "
            f"{f(i['p50'])} / {f(i['p99'])} | {f(m['first_token_ms']['p50'])} | "
            f"{f(t['p50'])} / {f(t['p95'])} | {m['wall_s']} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--models-root", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("out/disaggregation"))
    args = parser.parse_args(argv)
    from loadtest.report import machine
    from stages.backends.model_cache import cache_folder
    from stages.backends.tiny_speech_models import ensure_speecht5

    args.out.mkdir(parents=True, exist_ok=True)
    root = args.models_root or cache_folder("disaggregation")
    t0 = time.monotonic()
    speecht5 = ensure_speecht5(root / "speecht5-mid", SPEECHT5_MID_SHAPE, HIFIGAN_MID_SHAPE)
    config = experiment_config(speecht5, args.max_tokens, args.sessions)
    speech = question_pcm()
    results: dict[str, Any] = {
        "benchmark": "disaggregation",
        "date": datetime.date.today().isoformat(),
        "command": "python -m loadtest.disaggregation " + " ".join(argv or sys.argv[1:]),
        "machine": machine(),
        "vocoder": {
            "model": "SpeechT5 + HiFi-GAN, RANDOM WEIGHTS (static, timed as speech)",
            "speecht5_shape": SPEECHT5_MID_SHAPE,
            "hifigan_shape": HIFIGAN_MID_SHAPE,
            "build_s": round(time.monotonic() - t0, 1),
        },
        "workload": {
            "sessions": args.sessions,
            "rounds": args.rounds,
            "reply_tokens": args.max_tokens,
            "question_s": round(len(speech) / 16000, 2),
        },
        "modes": {},
    }
    log(f"machine: {results['machine']['summary']}")
    for mode in args.modes.split(","):
        log(f"{mode}: {args.sessions} sessions x {args.rounds} rounds")
        try:
            if mode == "disaggregated":
                figures = run_disaggregated(config, speech, args.sessions, args.rounds)
            else:
                figures = asyncio.run(
                    run_monolithic(
                        config, speech, args.sessions, args.rounds, mode == "monolithic_thread"
                    )
                )
        except Exception as exc:  # the other modes still run; the failure is reported
            log(f"{mode} failed: {type(exc).__name__}: {exc}")
            figures = {"error": f"{type(exc).__name__}: {exc}"}
        results["modes"][mode] = figures
        log(f"{mode}: {json.dumps(figures)}")
        (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"machine: {results['machine']['summary']}")
    print(table(results))
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
