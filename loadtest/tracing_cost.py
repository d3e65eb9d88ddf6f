"""What gateway.tracing costs the event loop, off and on, in one process without stages (a
session on a link that pushes nothing):

1. per 20 ms frame: the caller's audio through the VAD and turns, the agent's audio to the
   transport (no hook runs per frame either way: only at a turn's edges and a first audio);
2. per turn and per cancel: a whole turn's records by hand (its end, transcript, start, first
   token, audio, end, played), a cancel and its three acks;
3. the CPU the exporter's thread spends on a span (encoded, sent to an OTLP/HTTP receiver in
   another process), and the loop's lateness on a 20 ms tick (the audio's pace) while turns
   end and their spans are exported, against the same without tracing.

    python -m loadtest.tracing_cost [--seconds 4]

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import platform
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from gateway.config import TracingConfig, TurnsConfig
from gateway.metrics import GatewayMetrics
from gateway.protocol import SessionConfig
from gateway.session import RealtimeSession
from gateway.tracing import Tracing
from loadtest.voices import spoken
from stages.envelope import Envelope
from stages.messages import (
    AudioDone,
    CancelAck,
    Kind,
    Phrase,
    ResponseDone,
    ResponseStarted,
    TextDelta,
    Transcript,
)
from stages.rings import STAGES

VOCODER_RATE = 22_050
AGENT_FRAME = VOCODER_RATE // 50
SPANS_A_TURN = 6  # turn, vad, encoder, reasoning.first_token, vocoder.first_audio, playout


class NoRings:
    """The link's methods a session calls, pushing nothing."""

    def __init__(self) -> None:
        self.cancels = 0

    def speech_stopped(self, *args: Any, **kwargs: Any) -> int:
        return time.monotonic_ns()

    def cancel(self, *args: Any) -> tuple[int, int]:
        self.cancels += 1
        return self.cancels, time.monotonic_ns()

    def send_audio(self, *args: Any) -> bool:
        return True

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


class SilentTransport:
    """A WebRTC-like transport that drops what it is given."""

    kind = "webrtc"

    def send_event(self, event: dict[str, Any]) -> None: ...
    def play(self, reply: Any, pcm: np.ndarray) -> None: ...
    def audio_end(self, reply: Any) -> None: ...
    def finish(self, reply: Any) -> None: ...
    def clear(self) -> None: ...
    def hold(self, held: bool) -> None: ...
    def heard_samples(self, reply: Any) -> int:
        return 0

    async def close(self) -> None: ...


def _session(tracing: Tracing | None) -> RealtimeSession:
    session = RealtimeSession(
        "bench",
        NoRings(),  # type: ignore[arg-type]
        1,
        VOCODER_RATE,
        GatewayMetrics(),
        SessionConfig(voice="v"),
        lambda call: None,
        # the reply made once a turn ends, any sound over the agent cutting it, as measured
        turns=TurnsConfig(prepare_reply_ms=0, interruptions={"policy": "immediate"}),
        tracing=tracing,
    )
    session.bind(SilentTransport())  # type: ignore[arg-type]
    return session


def _record(session: RealtimeSession, src: str, kind: Kind, msg: Any) -> None:
    session.on_stage_event(Envelope(src, kind, 1, 0, 0, time.monotonic_ns(), msg))


def turn(session: RealtimeSession, n: int) -> None:
    """One turn's records, begin to played, as they reach the session."""
    turns, rid = session.turns, f"resp_{n}"
    turns.begin(n * 1000)
    turns.end(n * 1000 + 900, True)
    _record(session, "encoder", Kind.TRANSCRIPT, Transcript(turns.turn_id, "what time", True))
    _record(session, "reasoning", Kind.RESPONSE_STARTED, ResponseStarted(rid, turns.turn_id))
    _record(session, "reasoning", Kind.TEXT_DELTA, TextDelta(rid, "It is ", 0, 1000))
    _record(session, "vocoder", Kind.PHRASE, Phrase(rid, "It is noon.", VOCODER_RATE))
    audio = np.zeros(AGENT_FRAME, np.int16).tobytes()
    for _ in range(3):
        _record(session, "vocoder", Kind.AUDIO_OUT, audio)
    _record(session, "reasoning", Kind.TEXT_DELTA, TextDelta(rid, "noon.", 1))
    _record(session, "reasoning", Kind.RESPONSE_DONE, ResponseDone(rid, "completed", "It is"))
    _record(session, "vocoder", Kind.AUDIO_DONE, AudioDone(rid, "completed"))
    session.playback_done(rid)


def cancel(session: RealtimeSession) -> None:
    cancel_id = session.cancels.send(None, "", "barge_in")
    for stage in STAGES:
        ack = CancelAck(cancel_id, stage, time.monotonic_ns(), 0.1)
        _record(session, stage, Kind.CANCEL_ACK, ack)


def _us_each(run: Callable[[], None], n: int, repeats: int = 5) -> float:
    """Median over `repeats` of the CPU time of `run` per call, µs."""
    times = []
    for _ in range(repeats):
        t0 = time.process_time_ns()
        for _ in range(n):
            run()
        times.append((time.process_time_ns() - t0) / n / 1000)
    return round(statistics.median(times), 2)


class Discard:
    """An exporter that takes spans and drops them: the loop's side alone."""

    def export(self, spans: Any) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self) -> None: ...

    def force_flush(self, timeout_millis: int = 0) -> bool:
        return True


def micro(caller: np.ndarray) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    frames = [caller[i : i + 320] for i in range(0, len(caller) - 319, 320)]
    audio = np.zeros(AGENT_FRAME, np.int16).tobytes()
    agent_frame = Envelope("vocoder", Kind.AUDIO_OUT, 1, 0, 0, 0, audio)
    for label in ("off", "on"):
        tracing = Tracing(TracingConfig(), exporter=Discard()) if label == "on" else None  # type: ignore[arg-type]
        listening, playing, turning = _session(tracing), _session(tracing), _session(tracing)
        heard, turns = iter(range(10**9)), iter(range(10**9))
        _record(playing, "reasoning", Kind.RESPONSE_STARTED, ResponseStarted("r", -1))
        _record(playing, "vocoder", Kind.PHRASE, Phrase("r", "Hello there.", VOCODER_RATE))
        runs = {
            "caller 20 ms frame (VAD, turns), us": (
                lambda s=listening, i=heard: s.feed_audio(frames[next(i) % len(frames)]),
                len(frames),
            ),
            "agent 20 ms frame (to the transport), us": (
                lambda s=playing: s.on_stage_event(agent_frame),
                5000,
            ),
            "a whole turn's records, us": (lambda s=turning, i=turns: turn(s, next(i)), 300),
            "a cancel and its 3 acks, us": (lambda s=turning: cancel(s), 300),
        }
        for name, (run, n) in runs.items():
            rows.setdefault(name, {})[label] = _us_each(run, n)
        if tracing is not None:
            tracing.shutdown()
    return rows


def _receive(port: int, ready: Any) -> None:
    """An OTLP/HTTP traces endpoint that answers every export (another process)."""
    from aiohttp import web

    async def export(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def serve() -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", export)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(serve())


@contextlib.contextmanager
def receiver() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    process = ctx.Process(target=_receive, args=(port, ready), daemon=True)
    process.start()
    try:
        if not ready.wait(30):
            raise RuntimeError("the OTLP receiver did not start in 30 s")
        yield f"http://127.0.0.1:{port}/v1/traces"
    finally:
        process.terminate()
        process.join(5)


async def _lateness(tracing: Tracing | None, seconds: float, turns_per_s: int) -> dict:
    """A 20 ms tick's lateness while `turns_per_s` turns end (all their spans made)."""
    session, late, n = _session(tracing), [], 0
    loop = asyncio.get_running_loop()
    start = next_tick = loop.time()
    while loop.time() - start < seconds:
        next_tick += 0.02
        await asyncio.sleep(max(0.0, next_tick - loop.time()))
        late.append((loop.time() - next_tick) * 1000)
        for _ in range(max(1, turns_per_s // 50)):
            turn(session, n)
            n += 1
    if tracing is not None:
        await asyncio.to_thread(tracing.flush, 30)
    return {
        "turns": n,
        "late_ms_p50": round(statistics.median(late), 3),
        "late_ms_p99": round(float(np.percentile(late, 99)), 3),
        "late_ms_max": round(max(late), 3),
    }


def export_us_per_span(url: str, turns: int = 500) -> float:
    """The CPU the batch processor's thread spends encoding and sending one span (all of the
    process's CPU for `turns` turns, exported, less the same with the spans dropped)."""
    cpu = {}
    for label, exporter in (("dropped", Discard()), ("sent", None)):
        tracing = Tracing(TracingConfig(otlp_endpoint=url), exporter=exporter)  # type: ignore[arg-type]
        session = _session(tracing)
        t0 = time.process_time_ns()
        for n in range(turns):
            turn(session, n)
        assert tracing.flush(60)
        cpu[label] = time.process_time_ns() - t0
        tracing.shutdown()
    return round((cpu["sent"] - cpu["dropped"]) / (turns * SPANS_A_TURN) / 1000, 2)


def lateness(url: str, seconds: float, turns_per_s: int, rounds: int) -> list[dict]:
    """Off and on in turn, `rounds` times each (a busy machine shows in either)."""
    out = []
    for _ in range(rounds):
        out.append({"tracing": "off", **asyncio.run(_lateness(None, seconds, turns_per_s))})
        tracing = Tracing(TracingConfig(otlp_endpoint=url))
        out.append({"tracing": "on", **asyncio.run(_lateness(tracing, seconds, turns_per_s))})
        tracing.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="each lateness run")
    parser.add_argument("--turns-per-s", type=int, default=100, help="during the lateness run")
    parser.add_argument("--rounds", type=int, default=2, help="lateness runs, off and on")
    args = parser.parse_args()
    speech = spoken("what is the weather like today", 16_000)
    caller = np.concatenate([speech, np.zeros(16_000, np.int16)])
    rows = micro(caller)
    print(f"{'':44} {'off':>9} {'on':>9}")
    for name, row in rows.items():
        print(f"{name:44} {row['off']:9.2f} {row['on']:9.2f}")
    with receiver() as url:
        export_us = export_us_per_span(url)
        late = lateness(url, args.seconds, args.turns_per_s, args.rounds)
    print(f"{'export, one span (the batch thread), us':44} {'':>9} {export_us:9.2f}")
    for run in late:
        print(
            f"20 ms tick, {run['turns']} turns, tracing {run['tracing']}: late p50 "
            f"{run['late_ms_p50']} ms, p99 {run['late_ms_p99']} ms, max {run['late_ms_max']} ms"
        )
    print(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "micro": rows,
                "export_us_per_span": export_us,
                "tick": late,
            }
        )
    )


if __name__ == "__main__":
    main()
