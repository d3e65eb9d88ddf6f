"""The turn models' cost to the event loop that every call of a gateway process shares.

    python -m loadtest.vad_load [--calls 20] [--seconds 20]

In one asyncio loop, as in a gateway process, `--calls` callers each feed a 20 ms frame every
20 ms (a spoken question, then silence, over and over) to their own TurnDetector; at each
pause of 200 ms the end-of-turn model is asked, off the loop as semantic_vad asks it. A 20 ms
timer beside them measures how late the loop wakes (what every call's audio waits). Variants,
one after the other in the same run: webrtcvad alone; Silero alone; Silero with the
end-of-turn model. Prints JSON and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import numpy as np

from loadtest.bench import describe_machine, summary

FRAME = 320  # 20 ms at 16 kHz
PAUSE_MS = 200


async def _predict(end_of_turn: Any, audio: np.ndarray, out: dict) -> None:
    _, took_s = await end_of_turn.probability(audio)
    out["predictions_ms"].append(took_s * 1000)


async def _caller(clip: np.ndarray, vad: Any, end_of_turn: Any, until: float, out: dict) -> None:
    """One call's frames on time; a pause's question runs beside them, as CallerTurns'."""
    frames = [clip[i : i + FRAME] for i in range(0, len(clip) - FRAME + 1, FRAME)]
    asked_at, k, asked = -1, 0, []
    next_at = time.monotonic()
    while time.monotonic() < until:
        started = time.perf_counter()
        vad.feed(frames[k % len(frames)])
        out["frame_ms"].append((time.perf_counter() - started) * 1000)
        k += 1
        pause = end_of_turn is not None and vad.in_speech and vad.silence_ms >= PAUSE_MS
        if pause and vad.speech_end_ms != asked_at:
            asked_at = vad.speech_end_ms
            audio = np.concatenate(frames[max(0, k % len(frames) - 400) : k % len(frames)])
            asked.append(asyncio.create_task(_predict(end_of_turn, audio, out)))
        next_at += 0.02
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
    await asyncio.gather(*asked)


async def _lag(until: float, lags: list[float]) -> None:
    while time.monotonic() < until:
        t = time.monotonic()
        await asyncio.sleep(0.02)
        lags.append((time.monotonic() - t - 0.02) * 1000)


async def run(variant: str, calls: int, seconds: float, clip: np.ndarray) -> dict[str, Any]:
    from gateway.turns.classifiers import SileroClassifier, WebrtcClassifier
    from gateway.turns.detector import TurnDetector
    from gateway.turns.silero import SileroModel
    from gateway.turns.smart_turn import SmartTurn, SmartTurnModel
    from stages.backends import bundled

    silero = SileroModel(bundled.resolve("bundled:silero-vad"))
    end_of_turn = None
    if variant == "silero+end_of_turn":
        end_of_turn = SmartTurn(SmartTurnModel(bundled.resolve("bundled:smart-turn-v3.2")))
    out: dict[str, list[float]] = {"frame_ms": [], "predictions_ms": []}
    lags: list[float] = []
    until = time.monotonic() + seconds
    tasks = [asyncio.create_task(_lag(until, lags))]
    for i in range(calls):
        voice = WebrtcClassifier() if variant == "webrtc" else SileroClassifier(silero)
        vad = TurnDetector(silence_duration_ms=4000 if end_of_turn else 500, classifier=voice)
        shifted = np.roll(clip, i * 997)  # callers out of step with each other
        tasks.append(asyncio.create_task(_caller(shifted, vad, end_of_turn, until, out)))
    await asyncio.gather(*tasks)
    if end_of_turn is not None:
        end_of_turn.close()
    return {
        "loop_lag_ms": summary(lags, 50, 99),
        "frame_ms": summary(out["frame_ms"], 50, 99),
        "prediction_ms": summary(out["predictions_ms"], 50, 99),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    from loadtest.offline_quality import speak
    from stages.audio import resample

    question = resample(speak(["What is the capital of France?"], "piper")[0], 48000, 16000)
    clip = np.concatenate([question, np.zeros(16000, np.int16)])
    results = {
        "benchmark": "vad_load",
        "command": "python -m loadtest.vad_load " + " ".join(argv or sys.argv[1:]),
        "machine": describe_machine(),
        "calls": args.calls,
        "variants": {
            v: asyncio.run(run(v, args.calls, args.seconds, clip))
            for v in ("webrtc", "silero", "silero+end_of_turn")
        },
    }
    print(json.dumps(results))
    print(f"\n{args.calls} calls in one event loop, {args.seconds:.0f} s each variant\n")
    print("| variant | loop lag p50 / p99 ms | one frame p50 / p99 ms | prediction p50 / p99 ms |")
    print("|---|---:|---:|---:|")
    for v, r in results["variants"].items():
        lag, frame, pred = r["loop_lag_ms"], r["frame_ms"], r["prediction_ms"]
        print(
            f"| {v} | {lag['p50']} / {lag['p99']} | {frame['p50']} / {frame['p99']} "
            f"| {pred['p50']} / {pred['p99']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
