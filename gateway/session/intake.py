"""The caller's audio as a WebSocket client sends it (input_audio_buffer.append), in the
session's input format, to 16 kHz PCM for the turns; and the session's coders for the formats
that have state (Opus, G.711), which the WebSocket transport also encodes the agent with.

A long append is taken in a second at a time, the loop served between, and the client events
that come meanwhile wait for it in order.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
from collections.abc import Callable
from typing import Any

import numpy as np

from gateway.g711 import G711
from gateway.opus import PacketCodec
from gateway.protocol import G711_FORMATS, INPUT_RATE, OPUS, OUTPUT_RATE, ProtocolError
from gateway.resample import Upsampler
from stages.messages import CALLER_RATE

MAX_BACKLOG = 1000  # client events kept waiting behind a long append; past it, refused


class Intake:
    """One session's input formats. `feed` takes 16 kHz PCM; `spawn` runs the intake of a
    long append as one of the session's tasks; `dispatch` handles a client event that waited
    behind it; `refuse` tells the client of one dropped."""

    def __init__(
        self,
        input_format: Callable[[], tuple[str, int]],  # the session's: (type, rate)
        vocoder_rate: int,
        feed: Callable[[np.ndarray], None],
        spawn: Callable[[Any, str], asyncio.Task[Any]],
        dispatch: Callable[[Any], None],
        refuse: Callable[[str], None],
    ) -> None:
        self.input_format, self.vocoder_rate = input_format, vocoder_rate
        self.feed, self.spawn, self.dispatch, self.refuse = feed, spawn, dispatch, refuse
        self.closed = False
        self._resampler: Upsampler | None = None
        self._opus: PacketCodec | None = None
        self._g711: dict[str, G711] = {}
        self._long: asyncio.Task[None] | None = None  # a long append being taken in
        self._backlog: collections.deque[Any] = collections.deque()  # events behind it

    def append(self, audio_b64: Any) -> None:
        """input_audio_buffer.append: base64 PCM16 mono 24 kHz, G.711 bytes, or one 20 ms
        Opus packet."""
        if not isinstance(audio_b64, str):
            raise ProtocolError("audio must be a base64 string", param="audio")
        try:
            raw = base64.b64decode(audio_b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ProtocolError(
                f"audio is not valid base64: {exc}", param="audio", code="invalid_audio"
            ) from None
        audio_format, rate = self.input_format()
        if audio_format in G711_FORMATS:
            # any length: every byte is a sample
            self.feed(self.g711(audio_format).decode(raw))
            return
        if audio_format == OPUS:
            try:
                self.feed(self.opus.decode(raw))
            except ValueError as exc:
                raise ProtocolError(
                    f"audio/opus: {exc}; the packet was dropped",
                    param="audio",
                    code="invalid_audio",
                ) from None
            return
        if len(raw) % 2:
            raise ProtocolError(
                "audio/pcm is 16-bit samples: an odd number of bytes cannot be it",
                param="audio",
                code="invalid_audio",
            )
        pcm = np.frombuffer(raw, dtype="<i2").astype(np.int16)
        # at 16 kHz (the caller rate) it goes as it is, at 24 kHz through the resampler
        take = self.feed if rate == CALLER_RATE else lambda p: self.feed(self.resampler.convert(p))
        if len(pcm) <= INPUT_RATE:
            take(pcm)
            return
        # Longer: a second at a time, the loop served between (15 MiB is minutes of audio,
        # half a second of VAD work), and the resampler (libswresample) never given more:
        # it sizes its buffers, kept for the session's life, to the largest piece it had
        self._long = self.spawn(self._take_in(pcm, take), "intake")

    @property
    def opus(self) -> PacketCodec:
        """This session's libopus coder for the audio/opus format (made on first use)."""
        if self._opus is None:
            self._opus = PacketCodec(CALLER_RATE, OUTPUT_RATE)
        return self._opus

    def g711(self, audio_format: str) -> G711:
        """The session's coder of audio/pcmu or audio/pcma (made on first use)."""
        coder = self._g711.get(audio_format)
        if coder is None:
            coder = self._g711[audio_format] = G711(audio_format, self.vocoder_rate)
        return coder

    @property
    def resampler(self) -> Upsampler:
        """24 kHz audio/pcm from a WebSocket client down to the caller rate."""
        if self._resampler is None:
            self._resampler = Upsampler(INPUT_RATE, CALLER_RATE)
        return self._resampler

    @property
    def taking_in(self) -> bool:
        """A long append is still being fed to the VAD, a second at a time."""
        return self._long is not None

    def event(self, message: Any) -> None:
        """One client event as received: handled now, or after the long append in progress."""
        if self._long is None:
            self.dispatch(message)
        elif len(self._backlog) < MAX_BACKLOG:
            self._backlog.append(message)
        else:
            self.refuse(
                f"more than {MAX_BACKLOG} events came while a long input_audio_buffer.append "
                "was taken in: this one was dropped"
            )

    async def _take_in(self, pcm: np.ndarray, take: Callable[[np.ndarray], None]) -> None:
        try:
            for start in range(0, len(pcm), INPUT_RATE):
                take(pcm[start : start + INPUT_RATE])
                await asyncio.sleep(0)  # the other calls on this loop, between seconds
        finally:
            self._long = None
            while self._backlog and self._long is None and not self.closed:
                self.dispatch(self._backlog.popleft())

    def close(self) -> None:
        """The coders' native buffers go now, not at a collection."""
        self.closed = True
        self._resampler = self._opus = None
        self._g711.clear()
