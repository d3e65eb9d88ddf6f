"""The WebSocket transport of a Realtime session (GET /v1/realtime?model=...): JSON events both
ways; the caller's audio in `input_audio_buffer.append`, the agent's in
`response.output_audio.delta`, both base64: PCM16 mono 24 kHz, G.711 at 8 kHz (`audio/pcmu`,
`audio/pcma`), or (the `audio/opus` extension) one 20 ms Opus packet each."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from typing import Any

import numpy as np
from aiohttp import WSMsgType, web

from gateway.protocol import G711_FORMATS, OPUS, OUTPUT_RATE
from gateway.resample import Upsampler
from gateway.session import MAX_EVENT_BYTES, RealtimeSession, Reply
from stages.tasks import cancel_and_wait

SUBPROTOCOL = "realtime"
MAX_QUEUED_EVENTS = 10_000  # a client that stops reading is dropped past this
FAIR_SHARE_EVENTS = 16  # client events handled in a row before the loop serves other calls


class WebSocketTransport:
    """Events go out in order through one writer task; the client plays the audio itself,
    so what it has heard is estimated from the wall clock since the reply's first delta."""

    kind = "websocket"
    holds_audio = False  # the client holds what it was sent

    def __init__(self, session: RealtimeSession, ws: web.WebSocketResponse) -> None:
        self.session = session
        self.ws = ws
        self.resampler = Upsampler(session.vocoder_rate, OUTPUT_RATE)
        self.played_rate = session.vocoder_rate
        self._out: asyncio.Queue[str] = asyncio.Queue()
        self._writer = session.spawn(self._write(), f"ws-out-{session.call_id}")

    def send_event(self, event: dict[str, Any]) -> None:
        if self._out.qsize() >= MAX_QUEUED_EVENTS:
            self.session.spawn(self.session.close("client not reading its events"), "close")
            return
        self._out.put_nowait(json.dumps(event))

    async def _write(self) -> None:
        try:
            while True:
                await self.ws.send_str(await self._out.get())
        except (ConnectionError, RuntimeError):
            await self.session.close("websocket write failed")

    def play(self, reply: Reply, pcm: np.ndarray) -> None:
        kind = self.session.config.output_format
        if reply.playback_start is None:
            self.resampler.reset()
            if kind == OPUS:
                self.session.intake.opus.reset()
            if kind in G711_FORMATS:
                self.session.intake.g711(kind).reset()
            reply.playback_start = time.monotonic()
        if self.session.played is not None:  # the client plays it as it comes
            self.session.played.play_next(pcm)
        if kind in G711_FORMATS:  # from the vocoder's rate straight to 8 kHz
            self._g711_delta(reply, self.session.intake.g711(kind).encode(pcm))
            return
        self._delta(reply, self.resampler.convert(pcm))

    def _g711_delta(self, reply: Reply, payload: bytes) -> None:
        if payload:
            self.session.outbox.output_audio_delta(reply, base64.b64encode(payload).decode())

    def _delta(self, reply: Reply, pcm24k: np.ndarray, last: bool = False) -> None:
        if self.session.config.output_format == OPUS:  # one 20 ms packet per delta
            payloads = self.session.intake.opus.encode(pcm24k)
            if last:
                payloads += self.session.intake.opus.flush()
        else:
            payloads = [pcm24k.astype("<i2").tobytes()] if len(pcm24k) else []
        for payload in payloads:
            self.session.outbox.output_audio_delta(reply, base64.b64encode(payload).decode())

    def audio_end(self, reply: Reply) -> None:
        kind = self.session.config.output_format
        if kind in G711_FORMATS:
            self._g711_delta(reply, self.session.intake.g711(kind).flush())
            return
        self._delta(reply, self.resampler.flush(), last=True)

    def finish(self, reply: Reply) -> None:
        assert reply.response_id is not None
        self.session.playback_done(reply.response_id)  # the client holds the rest

    def clear(self) -> None:
        self.resampler.reset()
        if self.session.played is not None:  # the client stops as it is told
            self.session.played.cut()
        kind = self.session.config.output_format
        if kind == OPUS:
            self.session.intake.opus.reset()
        if kind in G711_FORMATS:
            self.session.intake.g711(kind).reset()

    def hold(self, held: bool) -> None:
        """The client plays (and holds) the audio it was sent; nothing to pause here."""

    def heard_samples(self, reply: Reply) -> int:
        if reply.playback_start is None:
            return 0
        elapsed = time.monotonic() - reply.playback_start
        return min(reply.samples, int(elapsed * self.session.vocoder_rate))

    async def close(self) -> None:
        # stop the writer, then let what is still queued (the last events) go out in order,
        # briefly, and close
        if self._writer is not asyncio.current_task():  # (a failed write closes from it)
            await cancel_and_wait(self._writer)
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError, RuntimeError):
            async with asyncio.timeout(1.0):
                while not self._out.empty() and not self.ws.closed:
                    await self.ws.send_str(self._out.get_nowait())
        await self.ws.close()


async def serve_websocket(
    request: web.Request,
    session: RealtimeSession,
    ws: web.WebSocketResponse,
    first_event_timeout_s: float | None = None,
) -> None:
    """Run a prepared WebSocket as `session` until either side closes; one that sends no
    event in `first_event_timeout_s` is closed (it holds a call slot otherwise)."""
    session.bind(WebSocketTransport(session, ws))
    session.start()
    reason, events = "websocket closed", 0
    try:
        while True:
            try:
                msg = await ws.receive(first_event_timeout_s if events == 0 else None)
            except TimeoutError:
                session.outbox.error(
                    f"no event came within {first_event_timeout_s:g} s of the session's start "
                    "(gateway.limits.first_event_timeout_s): closed",
                    code="idle_connection",
                )
                reason = "no first event"
                break
            if msg.type is WSMsgType.TEXT:
                session.on_client_message(msg.data)
            elif msg.type is WSMsgType.BINARY:
                session.outbox.error(
                    "events are JSON text frames, not binary", code="invalid_event"
                )
            else:  # closing, closed, or an error
                break
            events += 1
            if events % FAIR_SHARE_EVENTS == 0:
                # a burst already read is handled without a wait between events: let the
                # other calls on this loop have it now and then
                await asyncio.sleep(0)
    finally:
        await session.close(reason)


def websocket_response() -> web.WebSocketResponse:
    # answers the "realtime" subprotocol when offered (browsers pass the key beside it)
    return web.WebSocketResponse(
        protocols=(SUBPROTOCOL,), max_msg_size=MAX_EVENT_BYTES, heartbeat=30
    )
