"""A phone call as Twilio makes it to a Media Streams WebSocket, written from Twilio's published
message formats: `connected`, then `start` (streamSid, callSid, custom parameters, μ-law 8 kHz),
then a `media` message every 20 ms for as long as the call lasts (the caller's speech, μ-law
silence between), and `stop` at the hang-up. What comes back is played as Twilio plays it: the
agent's `media` queued and played out in real time, each `mark` echoed once the audio sent
before it has played, and a `clear` dropping what is queued (its pending marks echoed at once,
as Twilio does). On a speakerphone (`dial(..., speakerphone=...)`) the caller's microphone also
picks up the agent's audio it played, mixed into every frame it sends.

    async with PhoneCall.dial("ws://127.0.0.1:8080/v1/telephony/twilio", {"api_key": K}) as call:
        call.say(pcm8k)                      # the caller speaks (PCM16 at 8 kHz)
        await call.until_agent_speaks()
        heard = call.heard                   # the agent's audio as played, PCM16 8 kHz

The μ-law coding is FFmpeg's (PyAV), on its own here: the gateway's coder is what is tested.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import av
import numpy as np

from loadtest.speakerphone import Speakerphone

RATE = 8_000
FRAME = 160  # 20 ms of μ-law: a byte a sample
SILENCE = b"\xff" * FRAME  # μ-law's zero
VOICED = 300  # |sample| above which received audio counts as the agent speaking


def mulaw_encode(pcm8k: np.ndarray) -> bytes:
    codec = av.CodecContext.create("pcm_mulaw", "w")
    codec.sample_rate, codec.format, codec.layout = RATE, "s16", "mono"
    frame = av.AudioFrame.from_ndarray(
        np.ascontiguousarray(pcm8k, np.int16).reshape(1, -1), format="s16", layout="mono"
    )
    frame.sample_rate = RATE
    return b"".join(bytes(p) for p in codec.encode(frame))


def mulaw_decode(data: bytes) -> np.ndarray:
    codec = av.CodecContext.create("pcm_mulaw", "r")
    codec.sample_rate, codec.layout = RATE, "mono"
    frames = codec.decode(av.Packet(data))
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.int16)


class PhoneCall:
    """One call's Media Stream, from Twilio's side. Times are time.monotonic()."""

    def __init__(
        self, ws: aiohttp.ClientWebSocketResponse, speakerphone: Speakerphone | None = None
    ) -> None:
        self.ws = ws
        self.speakerphone = speakerphone  # at RATE
        self.stream_sid = "MZ" + secrets.token_hex(16)
        self.call_sid = "CA" + secrets.token_hex(16)
        # frames to send: (PCM, voiced, the first of a say(), the last); μ-law at send time,
        # after the speakerphone's echo is mixed in
        self._speech: collections.deque[tuple[np.ndarray, bool, bool, bool]] = collections.deque()
        self.said: list[tuple[float, float]] = []  # (first voiced frame sent, last) per say()
        self.onsets: list[float] = []  # when each say()'s first voiced frame was sent
        self._says = 0
        self._saying: list[float] | None = None
        # what came to be played: (μ-law, mark name, when it came)
        self._queue: collections.deque[tuple[bytes | None, str | None, float]] = collections.deque()
        self.heard = np.zeros(0, np.int16)  # the agent's audio as played
        self.voiced_at: list[float] = []  # when each received voiced frame was played
        self.media_at: list[float] = []  # when each media message came
        self.clears: list[float] = []
        self.marks_echoed: list[str] = []
        self.closed: tuple[int | None, str] | None = None  # the socket's close code, reason
        self._sequence = 0
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    @contextlib.asynccontextmanager
    async def dial(
        cls,
        url: str,
        parameters: dict[str, str] | None = None,
        speakerphone: Speakerphone | None = None,
    ) -> AsyncIterator[PhoneCall]:
        """Call `url`; on a `speakerphone` (at 8 kHz) the agent's audio echoes into the call."""
        if speakerphone is not None and speakerphone.rate != RATE:
            raise ValueError(
                f"a phone call's speakerphone runs at {RATE} Hz, not {speakerphone.rate}"
            )
        async with aiohttp.ClientSession() as http, http.ws_connect(url) as ws:
            call = cls(ws, speakerphone)
            await call._send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
            await call._send(
                {
                    "event": "start",
                    "start": {
                        "accountSid": "AC" + secrets.token_hex(16),
                        "streamSid": call.stream_sid,
                        "callSid": call.call_sid,
                        "tracks": ["inbound"],
                        "customParameters": parameters or {},
                        "mediaFormat": {
                            "encoding": "audio/x-mulaw",
                            "sampleRate": RATE,
                            "channels": 1,
                        },
                    },
                    "streamSid": call.stream_sid,
                }
            )
            call._tasks = [asyncio.create_task(call._talk()), asyncio.create_task(call._listen())]
            try:
                yield call
            finally:
                for task in call._tasks:
                    task.cancel()
                with contextlib.suppress(BaseException):
                    await asyncio.gather(*call._tasks)

    async def _send(self, message: dict[str, Any]) -> None:
        self._sequence += 1
        await self.ws.send_str(json.dumps({**message, "sequenceNumber": str(self._sequence)}))

    async def send_raw(self, text: str) -> None:
        """A frame as given (bad ones, for the tests)."""
        await self.ws.send_str(text)

    def say(self, pcm8k: np.ndarray) -> int:
        """Queue the caller's speech (PCM16 8 kHz); it goes out in real time after whatever
        is queued, silence around it. Its number, for `until_said`."""
        pcm = np.asarray(pcm8k, np.int16).reshape(-1)
        pcm = np.concatenate([pcm, np.zeros((-len(pcm)) % FRAME, np.int16)])
        voiced = np.abs(pcm8k) > VOICED
        frames = [pcm[i : i + FRAME] for i in range(0, len(pcm), FRAME)]
        for i, frame in enumerate(frames):
            chunk = voiced[i * FRAME : (i + 1) * FRAME]
            self._speech.append((frame, bool(chunk.any()), i == 0, i == len(frames) - 1))
        self._says += 1
        return self._says

    @property
    def speaking(self) -> bool:
        return bool(self._speech)

    async def _talk(self) -> None:
        """A media message every 20 ms, on an absolute clock: speech when there is some, and
        the speakerphone's echo under speech and silence alike."""
        start, chunk = time.monotonic(), 0
        while True:
            pcm, voiced, first, last = (
                self._speech.popleft() if self._speech else (None, False, False, False)
            )
            now = time.monotonic()
            if self.speakerphone is not None:
                pcm = self.speakerphone.mix(np.zeros(FRAME, np.int16) if pcm is None else pcm, now)
            frame = SILENCE if pcm is None else mulaw_encode(pcm)
            # what the caller said, not what its microphone heard: `voiced` is the speech's own
            if first:
                self._saying = [0.0, 0.0]
            if voiced and self._saying is not None:
                if not self._saying[0]:
                    self._saying[0] = now
                    self.onsets.append(now)
                self._saying[1] = now + FRAME / RATE
            if last and self._saying is not None:
                self.said.append((self._saying[0], self._saying[1]))
                self._saying = None
            chunk += 1
            await self._send(
                {
                    "event": "media",
                    "streamSid": self.stream_sid,
                    "media": {
                        "track": "inbound",
                        "chunk": str(chunk),
                        "timestamp": str(chunk * 20),
                        "payload": base64.b64encode(frame).decode(),
                    },
                }
            )
            await asyncio.sleep(max(0.0, start + chunk * FRAME / RATE - time.monotonic()))

    async def _listen(self) -> None:
        player = asyncio.create_task(self._play())
        reason = ""
        try:
            while True:
                msg = await self.ws.receive()
                if msg.type is not aiohttp.WSMsgType.TEXT:
                    reason = str(msg.extra or "") if msg.type is aiohttp.WSMsgType.CLOSE else ""
                    break
                event = json.loads(msg.data)
                kind = event.get("event")
                assert event.get("streamSid") == self.stream_sid, event
                if kind == "media":
                    self.media_at.append(time.monotonic())
                    payload = base64.b64decode(event["media"]["payload"])
                    self._queue.append((payload, None, self.media_at[-1]))
                elif kind == "mark":
                    self._queue.append((None, event["mark"]["name"], time.monotonic()))
                elif kind == "clear":
                    self.clears.append(time.monotonic())
                    for _, name, _ in self._queue:
                        if name is not None:
                            await self._echo(name)  # Twilio answers a cleared mark at once
                    self._queue.clear()
        finally:
            self.closed = (self.ws.close_code, reason)
            player.cancel()

    async def _play(self) -> None:
        """Play what came, in real time, echoing each mark when the audio before it has. As a
        phone's player: each frame follows the last unless it came after that one had played
        (the player ran dry), so this loop waking late does not move the audio."""
        clock = time.monotonic()
        while True:
            if not self._queue:
                await asyncio.sleep(0.005)
                continue
            payload, name, came = self._queue.popleft()
            if name is not None:
                await asyncio.sleep(max(0.0, clock - time.monotonic()))
                await self._echo(name)
                continue
            assert payload is not None
            pcm = mulaw_decode(payload)
            playing = max(clock, came)
            clock = playing + len(pcm) / RATE
            if self.speakerphone is not None:
                self.speakerphone.played(pcm, playing)
            await asyncio.sleep(max(0.0, clock - time.monotonic()))
            self.heard = np.concatenate([self.heard, pcm])
            if np.abs(pcm).max(initial=0) > VOICED:
                self.voiced_at.append(time.monotonic())

    async def _echo(self, name: str) -> None:
        self.marks_echoed.append(name)
        await self._send({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})

    async def until_agent_speaks(self, after: float = 0.0, timeout: float = 60) -> float:
        """When the agent's voice was first played after `after`."""
        async with asyncio.timeout(timeout):
            while True:
                played = [t for t in self.voiced_at if t > after]
                if played:
                    return played[0]
                await asyncio.sleep(0.01)

    async def until_said(self, n: int, timeout: float = 60) -> tuple[float, float]:
        """The `n`th say()'s (first voiced frame sent, last), once all of it went out."""
        async with asyncio.timeout(timeout):
            while len(self.said) < n:
                await asyncio.sleep(0.01)
        return self.said[n - 1]

    async def until_silent(self, quiet_s: float = 0.5, timeout: float = 60) -> None:
        """Until no voiced agent audio has been played for `quiet_s`."""
        async with asyncio.timeout(timeout):
            while not self.voiced_at or time.monotonic() - self.voiced_at[-1] < quiet_s:
                await asyncio.sleep(0.02)

    async def hang_up(self) -> None:
        await self._send(
            {
                "event": "stop",
                "streamSid": self.stream_sid,
                "stop": {"accountSid": "AC", "callSid": self.call_sid},
            }
        )
