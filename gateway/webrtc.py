"""The WebRTC transport of a Realtime session: Opus media tracks both ways and the
"oai-events" data channel, as OpenAI's /v1/realtime/calls."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
from aiortc import MediaStreamTrack, RTCDataChannel, RTCPeerConnection
from aiortc.mediastreams import MediaStreamError

from gateway.playout import PLAYOUT_RATE, PlayoutTrack
from gateway.resample import Downmixer, Upsampler
from gateway.session import RealtimeSession, Reply

EVENTS_CHANNEL = "oai-events"


class WebRTCTransport:
    """Caller audio from the remote track, agent audio on a paced local track, events on the
    data channel (queued until it opens)."""

    kind = "webrtc"
    holds_audio = True  # its playout queue is here

    def __init__(
        self,
        session: RealtimeSession,
        pc: RTCPeerConnection,
        playout_rate: int = PLAYOUT_RATE,
        connect_timeout_s: float | None = None,
    ) -> None:
        """`connect_timeout_s`: close the call if ICE has not connected this long from now
        (a peer that took its answer and never came holds a call slot otherwise)."""
        self.session = session
        self.pc = pc
        self.channel: RTCDataChannel | None = None
        self._pending: list[str] = []
        self.downmixer = Downmixer()
        self.upsampler = Upsampler(session.vocoder_rate, playout_rate)
        sent = session.metrics.frame_interval.labels("out")
        self.playout = PlayoutTrack(
            on_started=self._playout_started,
            on_mark=self._played_mark,
            on_interval=sent.observe,
            on_played=self._played,
            rate=playout_rate,
        )
        self.played_rate = self.playout.rate
        pc.addTrack(self.playout)
        pc.on("track", self._attach_track)
        pc.on("datachannel", self._attach_channel)

        connected = asyncio.Event()

        @pc.on("connectionstatechange")
        async def _state() -> None:
            if pc.connectionState == "connected":
                connected.set()
            if pc.connectionState in ("failed", "closed"):
                await session.close(f"connection {pc.connectionState}")

        if connect_timeout_s is not None:
            session.spawn(
                self._close_unless_connected(connected, connect_timeout_s),
                f"ice-bound-{session.call_id}",
            )

    async def _close_unless_connected(self, connected: asyncio.Event, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await connected.wait()
        except TimeoutError:
            self.session.log.warning("ICE did not connect in %.0f s: call closed", timeout_s)
            await self.session.close(f"ICE did not connect within {timeout_s:g} s")

    # -- events ----------------------------------------------------------------------------

    def _attach_channel(self, channel: RTCDataChannel) -> None:
        if channel.label != EVENTS_CHANNEL:
            return
        self.channel = channel
        channel.on("message", self.session.on_client_message)
        channel.on(
            "close", lambda: self.session.spawn(self.session.close("data channel closed"), "close")
        )
        if channel.readyState == "open":
            self._flush()
        else:
            channel.on("open", self._flush)

    def send_event(self, event: dict[str, Any]) -> None:
        text = json.dumps(event)
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(text)
        else:
            self._pending.append(text)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        assert self.channel is not None
        for text in pending:
            self.channel.send(text)

    # -- caller audio ----------------------------------------------------------------------

    def _attach_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio":
            self.session.spawn(self._read_caller_audio(track), f"audio-in-{self.session.call_id}")

    async def _read_caller_audio(self, track: MediaStreamTrack) -> None:
        session = self.session
        received = session.metrics.frame_interval.labels("in")
        try:
            while True:
                frame = await track.recv()
                now = time.monotonic()
                if session.frame_arrivals:
                    received.observe(now - session.frame_arrivals[-1])
                session.frame_arrivals.append(now)
                session.feed_audio(self.downmixer.convert(frame))
        except MediaStreamError:
            await session.close("caller audio ended")

    # -- agent audio -----------------------------------------------------------------------

    def play(self, reply: Reply, pcm: np.ndarray) -> None:
        if reply.playback_start is None:
            self.upsampler.reset()
            reply.playback_start = self.playout.played_samples + self.playout.queued_samples
        self.playout.enqueue(self.upsampler.convert(pcm))

    def audio_end(self, reply: Reply) -> None:
        """Its tail goes out with `finish`: audio here is media, not events."""

    def finish(self, reply: Reply) -> None:
        self.playout.enqueue(self.upsampler.flush(), mark=("done", reply.response_id))

    def hold(self, held: bool) -> None:
        self.playout.held = held

    def clear(self) -> None:
        self.playout.clear()
        self.upsampler.reset()

    def heard_samples(self, reply: Reply) -> int:
        if reply.playback_start is None:
            return 0
        played = max(0, self.playout.played_samples - reply.playback_start)
        return played * self.session.vocoder_rate // self.playout.rate

    def _played(self, pcm: np.ndarray, at: float) -> None:
        if self.session.played is not None:
            self.session.played.play_at(pcm, at)

    def _playout_started(self) -> None:
        reply = self.session.reply
        if reply is not None and reply.response_id is not None:
            self.session.outbox.output_buffer_started(reply.response_id)

    def _played_mark(self, mark: object) -> None:
        if isinstance(mark, tuple) and mark[0] == "done":
            self.session.outbox.output_buffer_stopped(mark[1])
            self.session.playback_done(mark[1])

    async def close(self) -> None:
        self.playout.stop()
        await self.pc.close()
