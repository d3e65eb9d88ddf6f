"""The GPU run's conversation over the WebSocket Realtime API (GET /v1/realtime) instead of
WebRTC: the same questions, turns, listening and talking over the agent as loadtest.conversation's
callers, with the caller's voice sent as `input_audio_buffer.append`s of PCM16 mono 24 kHz, one
per 20 ms frame on the wall clock (silence between questions, as a browser streams its
microphone), and the server's VAD ending each turn.

Measured on this host's CLOCK_MONOTONIC, as the WebRTC callers measure it:
- end of speech: when the 20 ms frame holding the clip's last voiced sample was sent;
- first audio: when the first `response.output_audio.delta` of a reply arrived after it (a reply
  already under way when the question began does not count: it is the one talked over).
Over a WebSocket the gateway sends a reply's audio as it is made and the client plays it, so
nothing arrives between replies and there is no "agent stopped" to time: barge-in at the
client is WebRTC's figure only. The cancels a barge-in makes are timed in the stages all the same.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import json
import random
import time
from typing import Any

import aiohttp
import numpy as np
from aiortc.mediastreams import MediaStreamError

from gateway.client import RATE
from gateway.resample import Downmixer
from loadtest.conversation import WatchedMicrophone, _clips, last_voiced_frame
from stages.tasks import cancel_and_wait

INPUT_RATE = 24_000  # `audio/pcm`, a session's input format unless it says otherwise
#: listening before talking over the agent, callers' start times spread over, the wait for a
#: reply: as loadtest.conversation.run_conversations's defaults
LISTEN_S, SPREAD_S, REPLY_TIMEOUT_S = 0.8, 2.0, 30.0


class WebSocketCall:
    """One Realtime session over a WebSocket, heard and spoken to as a client does: a reader task
    logs the agent's audio deltas as they arrive; once the session is created, a talker task sends
    every frame of loadtest.conversation's paced microphone (48 kHz) as a 24 kHz append."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.microphone = WatchedMicrophone()
        self.call_id: str | None = None  # the session's id: the gateway's name for the call
        self.created = asyncio.Event()
        self.deltas: list[tuple[float, str]] = []  # (arrival, response id) of each audio delta
        self.server_errors: list[str] = []
        self.ended: str | None = None  # why the socket stopped delivering events
        self._news = asyncio.Event()  # set on every delta, and at the end
        self._tasks = [asyncio.create_task(self._listen(), name="ws-caller-listen")]

    def start_talking(self) -> None:
        self._tasks.append(asyncio.create_task(self._talk(), name="ws-caller-talk"))

    async def _talk(self) -> None:
        to_input_rate = Downmixer(INPUT_RATE)  # libswresample, its state kept frame to frame
        try:
            while True:
                pcm = to_input_rate.convert(await self.microphone.recv())
                audio = base64.b64encode(pcm.astype("<i2").tobytes()).decode()
                await self.ws.send_str(
                    json.dumps({"type": "input_audio_buffer.append", "audio": audio})
                )
        except (MediaStreamError, ConnectionError):  # stopped, or the socket closed
            return

    async def _listen(self) -> None:
        try:
            async for msg in self.ws:
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    break
                event = json.loads(msg.data)
                if event["type"] == "response.output_audio.delta":
                    self.deltas.append((time.monotonic(), event["response_id"]))
                    self._news.set()
                elif event["type"] == "session.created":
                    self.call_id = event["session"]["id"]
                    self.created.set()
                elif event["type"] == "error":
                    error = event["error"]
                    self.server_errors.append(f"{error.get('code')}: {error.get('message')}")
        finally:
            self.ended = f"the socket closed (code {self.ws.close_code})"
            self._news.set()
            self.created.set()

    async def first_audio_after(self, t: float, talked_over: set[str], timeout: float) -> float:
        """Arrival of the first audio delta after `t` of a reply not in `talked_over`."""
        async with asyncio.timeout(timeout):
            seen = 0
            while True:
                for arrival, response_id in self.deltas[seen:]:
                    if arrival > t and response_id not in talked_over:
                        return arrival
                seen = len(self.deltas)
                if self.ended is not None:
                    raise ConnectionError(self.ended)
                self._news.clear()
                await self._news.wait()

    async def close(self) -> None:
        self.microphone.stop()
        await self.ws.close()
        for task in self._tasks:
            await cancel_and_wait(task)


async def converse_ws(
    http: aiohttp.ClientSession,
    url: str,
    speech48k: np.ndarray | list[np.ndarray],
    turns: int,
    *,
    start_delay_s: float = 0.0,
    listen_s: float = LISTEN_S,
    reply_timeout_s: float = REPLY_TIMEOUT_S,
) -> dict[str, Any]:
    """One caller's conversation over the socket at `url` (one clip, or several spoken in turn);
    its report has the shape of loadtest.conversation.converse's (call id, and each turn's onset,
    end of speech, first audio; `refused` when the gateway is at capacity), `arrivals` being the
    audio deltas'."""
    clips = _clips(speech48k)
    await asyncio.sleep(start_delay_s)  # callers start spread out, as real ones do
    try:
        ws = await http.ws_connect(url, max_msg_size=0)
    except aiohttp.ClientError as exc:  # a handshake answered 503 is a refusal at capacity
        refused = getattr(exc, "status", None) == 503
        return {"call_id": None, "turns": [], "refused": refused, "error": str(exc)}
    call = WebSocketCall(ws)
    out: dict[str, Any] = {"call_id": None, "turns": [], "refused": False, "error": None}
    try:
        await asyncio.wait_for(call.created.wait(), reply_timeout_s)
        if call.call_id is None:
            raise ConnectionError(f"no session.created: {call.ended}")
        out["call_id"] = call.call_id
        call.start_talking()
        for k in range(turns):
            clip = clips[k % len(clips)]
            out["turns"].append(turn := await _ask(call, clip, reply_timeout_s))
            if turn["first_audio"] is None:
                out["error"] = f"no reply within {reply_timeout_s} s at turn {k}"
                break
            if k < turns - 1:
                await asyncio.sleep(listen_s)  # listening to the agent before talking over it
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        out["arrivals"] = [arrival for arrival, _ in call.deltas]
        await call.close()
    if call.server_errors and out["error"] is None:
        out["error"] = f"server error events: {call.server_errors[:3]}"
    return out


async def _ask(call: WebSocketCall, clip: np.ndarray, reply_timeout_s: float) -> dict[str, Any]:
    """Speak `clip` into the call and wait for the agent's answer: the turn's times."""
    mic = call.microphone
    mic.play(clip)
    # bounded: a socket that fails stops the talker, and drained never comes
    await asyncio.wait_for(mic.drained.wait(), len(clip) / RATE + reply_timeout_s)
    onset = mic.clip_started[-1]
    spoken = mic.send_times[bisect.bisect_left(mic.send_times, onset) :]
    turn: dict[str, Any] = {"onset": onset, "end_of_speech": spoken[last_voiced_frame(clip)]}
    talked_over = {response_id for arrival, response_id in call.deltas if arrival < onset}
    try:
        turn["first_audio"] = await call.first_audio_after(
            turn["end_of_speech"], talked_over, reply_timeout_s
        )
    except TimeoutError:
        turn["first_audio"] = None
    return turn


async def _callers(
    url: str, delays: list[float], speech48k: np.ndarray | list[np.ndarray], turns: int
) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http:
        return await asyncio.gather(
            *(converse_ws(http, url, speech48k, turns, start_delay_s=d) for d in delays)
        )


def run_ws_conversations(
    base_url: str, n: int, speech48k: np.ndarray | list[np.ndarray], turns: int, seed: int = 0
) -> list[dict[str, Any]]:
    """Entry point for a spawned process: `n` callers over the WebSocket, each `turns` turns,
    listening, spread out and waiting as loadtest.conversation.run_conversations's over WebRTC."""
    url = base_url.replace("http", "ws", 1).rstrip("/") + "/v1/realtime?model=gpu-run"
    rng = random.Random(seed)  # the same start times as the WebRTC callers'
    delays = [rng.uniform(0, SPREAD_S) for _ in range(n)]
    return asyncio.run(_callers(url, delays, speech48k, turns))
