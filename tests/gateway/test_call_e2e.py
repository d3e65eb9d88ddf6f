"""Calls end to end: aiortc clients over 127.0.0.1, real Opus, the gateway, the three stages
(pocketsphinx, vLLM on the tiny model, espeak-ng) on real rings."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import time

import aiohttp
import numpy as np
import pytest

from gateway.app import gateway_of
from gateway.client import RealtimeCall
from gateway.session import RealtimeSession
from loadtest.callers import worst_gap_ms
from stages.audio import resample
from tests.serving import tiny_call_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

SILENT_RMS = 30.0  # Opus silence decodes to a few LSBs
STAGES = ("encoder", "reasoning", "vocoder")


@pytest.fixture(scope="module")
def config():
    return tiny_call_config({"gateway.max_output_tokens": 160, "gateway.max_calls": 12})


def speech48k(recording) -> np.ndarray:
    """The recording at 48 kHz with its leading silence cut, so its first frame is speech."""
    pcm = recording.pcm16
    start = int(np.argmax(np.abs(pcm) > 500))
    return resample(pcm[start:], 16000, 48000)


def voiced_frames(call: RealtimeCall, since: float = 0.0) -> list[int]:
    return [
        i
        for i, (t, lvl) in enumerate(zip(call.speaker.arrivals, call.speaker.levels, strict=True))
        if t >= since and lvl > SILENT_RMS
    ]


async def test_spoken_turn_gets_transcript_and_spoken_reply(server, make_speech) -> None:
    base, app = server
    call = await RealtimeCall.connect(base)
    try:
        created = await call.next_event("session.created")
        assert created["session"]["id"] == call.call_id
        # a reply of seconds is heard whole as well as one of the module's 160 tokens (whose
        # length is for the barge-ins), in a quarter of the time
        call.send({"type": "session.update", "session": {"max_output_tokens": 40}})
        await call.next_event("session.updated", timeout=10)
        call.microphone.play(speech48k(make_speech("what is the weather like today in paris")))
        await call.next_event("input_audio_buffer.speech_started", timeout=10)
        await call.next_event("input_audio_buffer.speech_stopped", timeout=20)
        finished = await call.next_event("response.done", timeout=90)
        assert finished["response"]["status"] == "completed"
        await call.next_event("output_audio_buffer.stopped", timeout=120)
        # The transcript travels encoder -> gateway while the reply goes encoder -> reasoning
        # -> gateway, on other rings: `completed` may come before or after response.created
        # (as with OpenAI's asynchronous transcription), so the order is checked per path.
        seen = [event for _, event in call.history]
        first = {}
        for event in seen:
            first.setdefault(event["type"], event)
        assert first["conversation.item.input_audio_transcription.completed"]["transcript"]
        rid = first["response.created"]["response"]["id"]
        assert finished["response"]["id"] == rid
        delta = first["response.output_audio_transcript.delta"]
        assert delta["response_id"] == rid and delta["delta"]
        order = [e["type"] for e in seen]
        assert (
            order.index("response.created")
            < order.index("response.output_audio_transcript.delta")
            < order.index("response.done")
        )
        assert order.index("output_audio_buffer.started") < order.index(
            "output_audio_buffer.stopped"
        )

        # what arrived is speech, and as long as what the gateway says it played
        session = gateway_of(app).calls[call.call_id]
        playout = session.transport.playout
        played_s = playout.played_samples / playout.rate
        voiced = voiced_frames(call)
        assert played_s > 1.0 and len(voiced) * 0.02 > 0.5 * played_s
        heard = call.speaker.pcm().astype(np.float64)
        assert np.sqrt(np.mean(heard[voiced[0] * 960 : (voiced[-1] + 1) * 960] ** 2)) > 300

        # every frame's interval, both ways, is in the metrics (gaps are the ones over 80 ms)
        registry = gateway_of(app).metrics.registry
        for direction, frames in (("in", len(session.frame_arrivals)), ("out", len(voiced))):
            count = registry.get_sample_value(
                "omni_audio_frame_interval_seconds_count", {"direction": direction}
            )
            assert count is not None and count >= frames - 1
    finally:
        await call.close()


async def test_barge_in_stops_the_agent_fast(config, server, make_speech, monkeypatch) -> None:
    """The caller talks over the agent, 20 times: time from the caller's first speech frame
    leaving to the agent's audio stopping in what the caller receives. The caller runs in a
    process of its own, as a real client does, not on the gateway's event loop, with the
    load generator's client settings (a one-frame jitter buffer, the gateway's Opus)."""
    base, app = server
    gateway = gateway_of(app)
    speech = speech48k(make_speech("stop please"))  # short: each trial waits for it to end
    before = _bucket_counts(gateway.metrics.cancel_latency)
    interrupted: dict[str, list[float]] = {}  # the gateway's interrupt times, per call
    heard: list[float] = []  # when caller audio louder than silence reached the gateway's VAD

    def feed_audio(session: RealtimeSession, pcm16k: np.ndarray) -> None:
        if np.sqrt(np.mean(pcm16k.astype(np.float32) ** 2)) > 100:
            heard.append(time.monotonic())
        feed(session, pcm16k)

    feed = RealtimeSession.feed_audio
    monkeypatch.setattr(RealtimeSession, "feed_audio", feed_audio)

    lost: dict[str, int] = {}  # uplink RTP packets the gateway never received, per call

    def keep(cid: str, call) -> None:
        interrupted[cid] = list(call.replies.interrupted_at)
        streams = [  # aiortc keeps RFC 3550's counts per remote stream, as getStats reports
            stream
            for receiver in call.transport.pc.getReceivers()
            for stream in receiver._RTCRtpReceiver__remote_streams.values()
        ]
        lost[cid] = sum(stream.packets_lost for stream in streams)

    args = (base, speech, 20, config.experiments.opus)
    report = await report_while_serving(gateway, _barge_in_process, args, keep, every_s=0.05)
    assert "error" not in report, report.get("error")
    assert report["statuses"] == ["cancelled"] * 20
    latencies_ms, onsets = report["latencies_ms"], report["onsets"]
    # caller's first speech frame sent -> the gateway interrupting (one host, one clock)
    times = interrupted[report["call_id"]]
    uplink_ms = [1000 * (min(t for t in times if t >= onset) - onset) for onset in onsets]
    # ... of which the caller's speech on its way to the VAD (network, jitter buffer, decode)
    transit_ms = [1000 * (min(t for t in heard if t >= onset) - onset) for onset in onsets]
    p50, p95 = np.percentile(latencies_ms, [50, 95])
    print(
        f"\nbarge-in at the client over {len(latencies_ms)} trials: p50 {p50:.0f} ms, "
        f"p95 {p95:.0f} ms, max {max(latencies_ms):.0f} ms; of which speech sent -> "
        f"gateway interrupts p50 {np.percentile(uplink_ms, 50):.0f} ms, "
        f"p95 {np.percentile(uplink_ms, 95):.0f} ms (speech sent -> its first frame at the "
        f"gateway's VAD p50 {np.percentile(transit_ms, 50):.0f} ms, "
        f"p95 {np.percentile(transit_ms, 95):.0f} ms); uplink packets lost: "
        f"{lost[report['call_id']]}"
    )
    deadline = time.monotonic() + 5  # the last trial's acks may still be on their way
    while True:
        after = _bucket_counts(gateway.metrics.cancel_latency)
        acked = {s: after[s][float("inf")] - before.get(s, {}).get(float("inf"), 0) for s in after}
        if min(acked.get(s, 0) for s in STAGES) >= 20 or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)  # polling the gateway's metrics
    for stage in STAGES:
        counts = {le: n - before.get(stage, {}).get(le, 0) for le, n in after[stage].items()}
        total = counts[float("inf")]
        within = counts[0.03] / max(1, total)
        print(f"  server cancel ack {stage}: {100 * within:.0f}% of {total:.0f} within 30 ms")
        assert total >= 20
    # the target is 150 ms, met here and on the GPU host (docs/benchmarks.md has the runs);
    # this bound leaves a 2-core CI machine its stalls and still catches a barge-in that waits
    # for the end of a phrase or of the caller's words, as peers do (0.5-0.6 s)
    assert p95 < 250, f"barge-in p95 {p95:.0f} ms"


async def report_while_serving(gateway, target, args: tuple, keep, every_s: float = 0.1) -> dict:
    """Run `target(*args, conn)` in a process of its own while this loop serves its calls, and
    return what it sends. Every `every_s`, `keep(call_id, call)` copies what the test needs of
    each call in progress: a call vanishes from the gateway when its caller hangs up."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child))
    proc.start()

    async def snapshot() -> None:
        while True:
            for cid, call in list(gateway.calls.items()):
                keep(cid, call)
            await asyncio.sleep(every_s)

    watcher = asyncio.create_task(snapshot())
    try:
        ready = await asyncio.to_thread(parent.poll, 240)
        assert ready, f"{target.__name__} produced no report"
        return parent.recv()
    finally:
        watcher.cancel()
        await asyncio.to_thread(proc.join, 30)
        if proc.is_alive():
            proc.kill()


def _bucket_counts(histogram) -> dict[str, dict[float, float]]:
    """Per stage, the histogram's cumulative bucket counts by upper bound (s)."""
    counts: dict[str, dict[float, float]] = {}
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                stage, le = sample.labels["stage"], float(sample.labels["le"])
                counts.setdefault(stage, {})[le] = sample.value
    return counts


def _barge_in_process(base: str, speech: np.ndarray, trials: int, opus: str, conn) -> None:
    import traceback

    from gateway import aiortc_tuning
    from gateway.ice import restrict_host_addresses

    try:
        aiortc_tuning.apply(1, opus=opus)
        restrict_host_addresses(["127.0.0.1"])  # as the load generator: loopback only
        conn.send(asyncio.run(_barge_in_trials(base, speech, trials)))
    except Exception:
        conn.send({"error": traceback.format_exc()})


async def _barge_in_trials(base: str, speech: np.ndarray, trials: int) -> dict:
    call = await RealtimeCall.connect(base)
    latencies_ms: list[float] = []
    onsets: list[float] = []
    statuses: list[str] = []
    try:
        await call.next_event("session.created")
        call.send({"type": "response.create"})
        for _ in range(trials):
            await call.next_event("output_audio_buffer.started", timeout=60)
            # let the agent's voice reach us, then talk over it
            while len(voiced_frames(call, since=time.monotonic() - 0.1)) < 3:
                await asyncio.sleep(0.02)  # polling the receiver's frame log
            n_clips = len(call.microphone.clip_started)
            call.microphone.play(speech)
            cleared = await call.next_event("output_audio_buffer.cleared", timeout=10)
            assert cleared["response_id"]
            onset = call.microphone.clip_started[n_clips]
            # the first frame after which the agent stays silent for 200 ms
            deadline = time.monotonic() + 5
            while True:
                arrivals, levels = call.speaker.arrivals, call.speaker.levels
                idx = [i for i, t in enumerate(arrivals) if t >= onset]
                stop = next(
                    (
                        i
                        for i in idx
                        if all(lv <= SILENT_RMS for lv in levels[i : i + 10])
                        and len(levels[i : i + 10]) == 10
                    ),
                    None,
                )
                if stop is not None:
                    break
                assert time.monotonic() < deadline, "agent audio never stopped"
                await asyncio.sleep(0.05)
            latencies_ms.append((arrivals[stop] - onset) * 1000)
            onsets.append(onset)
            done = await call.next_event("response.done", timeout=10)
            statuses.append(done["response"]["status"])
        return {
            "call_id": call.call_id,
            "latencies_ms": latencies_ms,
            "onsets": onsets,
            "statuses": statuses,
        }
    finally:
        await call.close()


def _callers_process(base: str, n: int, speech: np.ndarray, conn) -> None:
    from loadtest.callers import run_callers

    conn.send(run_callers(base, n, speech))


async def test_ten_concurrent_callers_all_get_replies(server, make_speech) -> None:
    """Ten callers from another process speak at once; all hear the agent. Audio gaps in both
    directions are measured and printed (the target, none over 60 ms, is met on the 16-core
    GPU host and not on 2 cores: docs/benchmarks.md)."""
    base, app = server
    gateway = gateway_of(app)
    speech = speech48k(make_speech("tell me something nice"))
    calls = {}  # the gateway's sessions, kept past their end for what they saw

    def server_view(call) -> dict[str, object]:
        """What the gateway saw of a call: did the reply reach playout, did it play?"""
        view = {
            "closed": call.close_reason,
            "frames_in": call.turns.frames,
            "turns": call.turn_id,
            "awaiting_transcript": sorted(call.awaiting_transcript),
            "said": [(m.role, m.text) for m in call.items.history()],
            "responding": call.response is not None,
        }
        playout = getattr(call.transport, "playout", None)
        if playout is not None:
            view |= {
                "played_samples": playout.played_samples,
                "queued_samples": playout.queued_samples,
                "held": playout.held,
            }
        return view

    report = await report_while_serving(
        gateway, _callers_process, (base, 10, speech), calls.__setitem__
    )
    failures = zip(report["call_ids"], report["failures"], strict=True)
    missing = {
        cid: (why, calls.get(cid) and server_view(calls[cid])) for cid, why in failures if why
    }
    assert not missing, f"callers without a reply (and the gateway's view): {missing}"
    start, end = report["window"]
    gaps_in = [
        worst_gap_ms(list(calls[cid].frame_arrivals), start, end)
        for cid in report["call_ids"]
        if cid in calls
    ]
    print(
        f"\n10 callers: replies after {report['reply_wait_s']:.1f} s; worst inter-frame "
        f"interval received by callers {max(report['worst_gap_in_ms']):.0f} ms, by the "
        f"gateway {max(gaps_in, default=float('nan')):.0f} ms"
    )
    # every caller heard the agent's voice; the gap target is reported, not yet reached on a
    # 2-core machine that also runs the callers, pocketsphinx, vLLM and espeak-ng
    assert min(report["voiced_frames"]) > 0


async def test_bad_requests_get_4xx_and_other_calls_go_on(server) -> None:
    base, _ = server
    bystander = await RealtimeCall.connect(base)
    try:
        await bystander.next_event("session.created")
        async with aiohttp.ClientSession() as http:
            url = f"{base}/v1/realtime/calls"
            async with http.post(
                url, data="v=0\r\nnot sdp", headers={"Content-Type": "application/sdp"}
            ) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_sdp"
            async with http.post(url, data="{}", headers={"Content-Type": "text/plain"}) as r:
                assert r.status == 415
            async with http.post(
                url, data=b"v=0\r\n" * 40000, headers={"Content-Type": "application/sdp"}
            ) as r:
                assert r.status == 413
            async with http.post(
                f"{base}/offer", data="{nope", headers={"Content-Type": "application/json"}
            ) as r:
                assert r.status == 400
            async with http.get(f"{base}/health") as r:
                assert r.status == 200 and (await r.json())["status"] == "ready"
            async with http.get(f"{base}/metrics") as r:
                text = await r.text()
                assert "omni_sessions" in text and "omni_ring_bytes_used" in text
        bystander.channel.send("{not json")
        err = await bystander.next_event("error")
        assert err["error"]["code"] == "invalid_json"
        bystander.send({"type": "no.such.event", "event_id": "evt_42"})
        err = await bystander.next_event("error")
        assert err["error"]["event_id"] == "evt_42" and err["error"]["code"] == "unknown_event"
        # the bystander's call still works
        bystander.send({"type": "response.create"})
        assert (await bystander.next_event("response.created"))["response"]["id"]
    finally:
        await bystander.close()


async def calls_gone(gateway, timeout: float = 30) -> None:
    """Calls hung up by earlier tests are torn down once the gateway's peers notice."""
    deadline = time.monotonic() + timeout
    while gateway.calls:
        assert time.monotonic() < deadline, f"calls left over: {list(gateway.calls)}"
        await asyncio.sleep(0.1)  # polling the gateway's bookkeeping


async def test_admission_refuses_beyond_max_calls(server) -> None:
    base, app = server
    gateway = gateway_of(app)
    await calls_gone(gateway)
    calls = [await RealtimeCall.connect(base) for _ in range(gateway.config.gateway.max_calls)]
    try:
        with pytest.raises(ConnectionError, match="503"):
            await RealtimeCall.connect(base)
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{base}/v1/realtime/calls", data="v=0", headers={"Content-Type": "application/sdp"}
            ) as r,
        ):
            assert r.status == 503 and r.headers["Retry-After"]
            assert json.loads(await r.text())["error"]["code"] == "capacity"
    finally:
        await asyncio.gather(*(c.close() for c in calls))


async def test_hang_up_frees_the_session(server) -> None:
    base, app = server
    gateway = gateway_of(app)
    await calls_gone(gateway)
    call = await RealtimeCall.connect(base)
    await call.next_event("session.created")
    session = gateway.calls[call.call_id].session
    assert gateway.link.control.holder(session)
    call.send({"type": "response.create"})
    await call.next_event("response.created")
    await call.close()
    deadline = time.monotonic() + 10
    while call.call_id in gateway.calls or gateway.link.control.holder(session):
        assert time.monotonic() < deadline, "the hung-up call was never torn down"
        await asyncio.sleep(0.05)  # polling the gateway's bookkeeping
