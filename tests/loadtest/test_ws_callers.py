"""The GPU run's callers over the WebSocket Realtime API: what they send and how they time it,
against a scripted WebSocket server; then `python -m loadtest.gpu_run --transports websocket`
end to end on the CPU (the real gateway, stages and vLLM CPU engine on the tiny models)."""

from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from loadtest.conversation import FRAME, last_voiced_frame
from loadtest.ws_callers import converse_ws

ROOT = Path(__file__).parents[2]


class ScriptedServer:
    """A /v1/realtime that logs every append and answers each question once it has heard its
    end: after the first, a delta of reply r0; after the second, one more of r0 (the reply
    talked over, still arriving) and, 50 ms later, the first of r1."""

    def __init__(self) -> None:
        self.appends: list[tuple[float, int]] = []  # (arrival, samples)
        self.questions_heard = 0

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        loop = asyncio.get_running_loop()

        async def delta(response_id: str) -> None:
            event = {"type": "response.output_audio.delta", "response_id": response_id}
            await ws.send_str(json.dumps(event | {"delta": ""}))

        await ws.send_str(json.dumps({"type": "session.created", "session": {"id": "sess_a"}}))
        voiced = False
        async for msg in ws:
            event = json.loads(msg.data)
            assert event["type"] == "input_audio_buffer.append"
            pcm = np.frombuffer(base64.b64decode(event["audio"]), "<i2")
            self.appends.append((loop.time(), len(pcm)))
            loud = bool(len(pcm)) and int(np.abs(pcm).max()) > 500
            if voiced and not loud:
                self.questions_heard += 1
                await delta("r0")
                if self.questions_heard == 2:
                    await asyncio.sleep(0.05)
                    await delta("r1")
            voiced = loud
        return ws


async def test_a_caller_paces_its_frames_and_times_the_reply_that_answers() -> None:
    server = ScriptedServer()
    app = web.Application()
    app.router.add_get("/v1/realtime", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    clip = np.zeros(FRAME * 12, np.int16)
    clip[FRAME * 2 : FRAME * 7] = 8000  # voiced frames 2-6, then silence
    try:
        async with asyncio.timeout(20), aiohttp.ClientSession() as http:
            url = f"ws://127.0.0.1:{port}/v1/realtime"
            report = await converse_ws(http, url, clip, 2, listen_s=0.1, reply_timeout_s=5.0)
    finally:
        await runner.cleanup()
    assert report["error"] is None and report["call_id"] == "sess_a"
    first, second = report["turns"]
    for turn in (first, second):
        # the send of the frame holding the last voiced sample: frame 6 of the clip
        spoken = turn["end_of_speech"] - turn["onset"]
        assert spoken == pytest.approx(last_voiced_frame(clip) * 0.02, abs=0.01)
        assert turn["first_audio"] > turn["end_of_speech"]
    # the second turn's answer is r1's delta, 50 ms after the talked-over r0's
    assert second["first_audio"] - second["end_of_speech"] >= 0.05
    assert len(report["arrivals"]) == 3
    # 20 ms of 24 kHz PCM16 an append (the resampler's first holds back its filter delay),
    # sent on the wall clock
    times = [t for t, _ in server.appends]
    assert {n for _, n in server.appends[1:-1]} == {480}
    assert (times[-1] - times[0]) / (len(times) - 1) == pytest.approx(0.02, abs=0.002)


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["websocket", "webrtc"])
def test_gpu_run_answers_every_turn_on_the_cpu(transport: str, tmp_path: Path) -> None:
    """The GPU run's own callers (loadtest.ws_callers, loadtest.conversation), end to end on
    the CPU before any GPU time is spent on them."""
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "loadtest.gpu_run",
        "--device=cpu",
        f"--transports={transport}",
        "--gateway-processes=1",  # fewer processes for 2 cores: one gateway, one vocoder
        "--vocoders=1x1",
        "--loads=1",
        "--turns-single=2",
        "--itl-streams=",
        f"--out={out}",
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=160)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    (name,) = results["layouts"]
    layout = results["layouts"][name]
    assert "error" not in layout, layout
    assert layout["transport"] == transport
    load = layout["loads"]["1"]
    assert load["errors"] == []
    assert load["turns_answered"] == load["turns_asked"] == 2
    # end of speech to first audio: the VAD's silence window (500 ms) and then the reply
    assert load["turn_ms"]["n"] == 2 and load["turn_ms"]["p50"] > 500
    assert load["turn_ms"]["p95"] < 5000
    # joined with the stages' records by the session's id: every hop of the turn is there
    assert all(load["hops_ms"][hop]["n"] == 2 for hop in load["hops_ms"])
    # the second question talked over the first reply: a cancel, acked by all three stages
    assert load["cancel_ms"]["last_ack"]["n"] >= 1
    if transport == "webrtc":  # the agent heard to stop at the caller
        assert load["barge_in_at_client_ms"]["n"] >= 1
    else:
        assert load["barge_in_at_client_ms"]["n"] == 0  # WebRTC's figure only
    assert f"| {name} | 1 |" in (out / "table.md").read_text()
