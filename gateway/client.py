"""A Python WebRTC client for omni-gateway (and the OpenAI Realtime WebRTC shape).

    call = await RealtimeCall.connect("http://127.0.0.1:8080", api_key="sk-...")
    call.send_file("question.wav")             # speak a WAV (any rate), paced at 20 ms
    event = await call.next_event("response.done")
    heard = call.speaker.pcm()                 # what the agent said, as received (48 kHz)
    await call.close()

`connect(..., track=...)` sends any aiortc audio track instead (a real microphone through
`aiortc.contrib.media.MediaPlayer`, for instance); `connect(..., speakerphone=...)` puts the call
on a simulated speakerphone (`loadtest.speakerphone`), its loudspeaker's echo in the microphone.
Events arrive on the "oai-events" data channel as dicts; `typed_event()` turns one into the
`openai` SDK's model of it. The load generator and the tests use this client.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fractions
import json
import time
from typing import Any, Protocol

import aiohttp
import numpy as np
from aiortc import (
    MediaStreamTrack,
    RTCConfiguration,
    RTCIceServer,
    RTCPeerConnection,
    RTCSessionDescription,
)
from aiortc.mediastreams import MediaStreamError
from av import AudioFrame

from stages.audio import read_wav, resample
from stages.tasks import cancel_and_wait

RATE = 48_000
FRAME = 960  # 20 ms at 48 kHz
_TIME_BASE = fractions.Fraction(1, RATE)
PLAYOUT_DELAY_S = 0.06  # a receiver's jitter buffer, for the speakerphone's loudspeaker


class EchoPath(Protocol):
    """What a caller's loudspeaker leaks into its microphone, at 48 kHz (a speakerphone's echo:
    loadtest.speakerphone.Speakerphone). Times are time.monotonic()."""

    def played(self, pcm: np.ndarray, at: float) -> None:
        """The loudspeaker began playing `pcm` (int16) at `at`."""

    def mix(self, speech: np.ndarray, at: float) -> np.ndarray:
        """The microphone frame captured from `at` on: `speech` (int16) and the echo, int16."""


class Microphone(MediaStreamTrack):
    """An audio track that sends queued PCM (48 kHz mono int16) in 20 ms frames, silence
    otherwise, on the wall clock. `sent_at` records when each queued clip started going out;
    an `echo` path mixes what the loudspeaker leaks into every frame, speech or silence."""

    kind = "audio"

    def __init__(self, echo: EchoPath | None = None) -> None:
        super().__init__()
        self.echo = echo
        self._queue: collections.deque[np.ndarray] = collections.deque()
        self._pts = 0
        self._start: float | None = None
        self.frames_sent = 0
        self.clip_started: list[float] = []  # monotonic time the first frame of a clip left
        self.send_times: list[float] = []
        # A clip played while another is still queued starts after it: each clip's first frame
        # is known by its place in the queue's whole history, not as "the next frame popped".
        self._clip_starts: collections.deque[int] = collections.deque()
        self._queued_total = 0
        self._popped_total = 0

    def play(self, pcm48k: np.ndarray) -> None:
        pcm = np.asarray(pcm48k, dtype=np.int16).reshape(-1)
        pad = (-len(pcm)) % FRAME
        pcm = np.concatenate([pcm, np.zeros(pad, np.int16)])
        if len(pcm):
            self._clip_starts.append(self._queued_total)
        for i in range(0, len(pcm), FRAME):
            self._queue.append(pcm[i : i + FRAME])
        self._queued_total += len(pcm) // FRAME

    @property
    def busy(self) -> bool:
        return bool(self._queue)

    @property
    def queued_s(self) -> float:
        """Seconds of queued audio still to go out."""
        return len(self._queue) * FRAME / RATE

    async def recv(self) -> AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        loop = asyncio.get_running_loop()
        if self._start is None:
            self._start = loop.time()
        else:
            self._pts += FRAME
            wait = self._start + self._pts / RATE - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
        if self._queue:
            pcm = self._queue.popleft()
            if self._clip_starts and self._clip_starts[0] == self._popped_total:
                self._clip_starts.popleft()
                self.clip_started.append(time.monotonic())
            self._popped_total += 1
        else:
            pcm = np.zeros(FRAME, np.int16)
        sent = time.monotonic()
        if self.echo is not None:
            pcm = self.echo.mix(pcm, sent)
        frame = AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = RATE, self._pts, _TIME_BASE
        self.frames_sent += 1
        self.send_times.append(sent)
        return frame


class Speaker:
    """Records the agent's audio as it arrives: frames, their arrival times and levels; plays
    each into an `echo` path as it arrives."""

    def __init__(self, echo: EchoPath | None = None) -> None:
        self.echo = echo
        self.frames: list[np.ndarray] = []
        self.arrivals: list[float] = []
        self.levels: list[float] = []  # RMS of each frame
        self._anchor: float | None = None  # the play clock, less the RTP clock (echo only)
        self._task: asyncio.Task[None] | None = None

    def start(self, track: MediaStreamTrack) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(track), name="speaker")

    async def _run(self, track: MediaStreamTrack) -> None:
        with contextlib.suppress(MediaStreamError):
            while True:
                frame = await track.recv()
                pcm = frame.to_ndarray().reshape(-1)
                if frame.layout.name == "stereo":
                    pcm = pcm.reshape(-1, 2).mean(axis=1).astype(np.int16)
                arrival = time.monotonic()
                self.frames.append(pcm)
                self.arrivals.append(arrival)
                if self.echo is not None:
                    self.echo.played(pcm, self._play_time(frame, arrival))
                self.levels.append(float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2))))

    def _play_time(self, frame: AudioFrame, arrival: float) -> float:
        """When a device plays `frame` from a jitter buffer: by its RTP clock, the first
        frame `PLAYOUT_DELAY_S` after it came, and later only from a frame that comes after
        its time (the buffer ran dry); so this loop waking late does not move the audio."""
        if frame.pts is None or frame.time_base is None:
            return arrival
        at = float(frame.pts * frame.time_base)
        if self._anchor is None or arrival > self._anchor + at:
            self._anchor = arrival + PLAYOUT_DELAY_S - at
        return self._anchor + at

    def pcm(self) -> np.ndarray:
        return np.concatenate(self.frames) if self.frames else np.zeros(0, np.int16)

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)


class RealtimeCall:
    """One call to /v1/realtime/calls."""

    def __init__(
        self, pc: RTCPeerConnection, channel: Any, speakerphone: EchoPath | None = None
    ) -> None:
        self.pc = pc
        self.channel = channel
        self.microphone = Microphone(speakerphone)
        self.speaker = Speaker(speakerphone)
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.history: list[tuple[float, dict[str, Any]]] = []
        self.call_id: str | None = None

    @classmethod
    async def connect(
        cls,
        base_url: str,
        *,
        api_key: str | None = None,
        ice_servers: list[str] | None = None,
        track: MediaStreamTrack | None = None,
        speakerphone: EchoPath | None = None,
        timeout: float = 20,
    ) -> RealtimeCall:
        """Call the gateway at `base_url`; `track` replaces the built-in microphone, and
        `speakerphone` sends the agent's audio back through it as a speakerphone's echo."""
        if track is not None and speakerphone is not None:
            raise ValueError("a speakerphone echoes into the built-in microphone, not a track")
        pc = RTCPeerConnection(
            RTCConfiguration(iceServers=[RTCIceServer(urls=u) for u in ice_servers or []])
        )
        channel = pc.createDataChannel("oai-events")
        call = cls(pc, channel, speakerphone)
        pc.addTrack(track if track is not None else call.microphone)
        pc.on("track", lambda track: call.speaker.start(track) if track.kind == "audio" else None)
        channel.on("message", call._on_message)
        opened = asyncio.Event()
        channel.on("open", opened.set)
        await pc.setLocalDescription(await pc.createOffer())
        headers = {"Content-Type": "application/sdp"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    # with the gateway's own events (omni.*) beside OpenAI's
                    f"{base_url.rstrip('/')}/v1/realtime/calls?omni_events=on",
                    data=pc.localDescription.sdp,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=timeout),
                ) as resp,
            ):
                text = await resp.text()
                if resp.status != 201:
                    raise ConnectionError(f"gateway answered {resp.status}: {text}")
                call.call_id = resp.headers.get("Location", "").rsplit("/", 1)[-1] or None
            await pc.setRemoteDescription(RTCSessionDescription(text, "answer"))
            await asyncio.wait_for(opened.wait(), timeout)
        except BaseException:
            await pc.close()
            raise
        return call

    def _on_message(self, message: str) -> None:
        event = json.loads(message)
        self.history.append((time.monotonic(), event))
        self.events.put_nowait(event)

    def send(self, event: dict[str, Any]) -> None:
        """Send a client event; ConnectionError once the call's data channel has closed."""
        if self.channel.readyState != "open":
            raise ConnectionError(f"the call's data channel is {self.channel.readyState}")
        self.channel.send(json.dumps(event))

    async def next_event(self, *types: str, timeout: float = 30) -> dict[str, Any]:
        """The next event of one of `types` (any type if none given); others are skipped.
        An `error` event raises unless asked for."""
        async with asyncio.timeout(timeout):
            while True:
                event = await self.events.get()
                if not types or event["type"] in types:
                    return event
                if event["type"] == "error":
                    raise RuntimeError(f"server error: {event['error']}")

    def send_file(self, path: str) -> float:
        """Speak a WAV file (PCM16, any rate, mono or stereo) into the call; its seconds."""
        pcm, rate = read_wav(path)
        self.microphone.play(resample(pcm, rate, RATE))
        return len(pcm) / rate

    def cancel(self) -> None:
        self.send({"type": "response.cancel"})

    async def close(self) -> None:
        self.microphone.stop()
        await self.speaker.stop()
        await self.pc.close()


def typed_event(event: dict[str, Any]) -> Any:
    """A server event as the `openai` SDK's model of it (`pip install openai`); unknown
    types, such as the gateway's `omni.*` extensions, keep their fields as attributes."""
    try:
        from openai._models import construct_type_unchecked
        from openai.types.realtime import RealtimeServerEvent
    except ImportError as exc:
        raise ImportError("typed events need the openai package: pip install openai") from exc
    return construct_type_unchecked(value=event, type_=RealtimeServerEvent)
