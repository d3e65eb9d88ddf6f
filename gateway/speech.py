"""POST /v1/audio/speech: OpenAI's text-to-speech shape, run on the vocoder stage alone and
streamed as it is synthesized (PCM16 mono 24 kHz raw, or in a WAV container)."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import numpy as np
from aiohttp import web

from gateway import events as ev
from gateway.protocol import OUTPUT_RATE, ProtocolError, unsupported
from gateway.resample import Upsampler
from stages.envelope import Envelope
from stages.link import PipelineLink
from stages.messages import Kind

MAX_INPUT_CHARS = 4096  # OpenAI's limit
FORMATS = {"pcm": "audio/pcm", "wav": "audio/wav"}
STALL_TIMEOUT_S = 30.0  # no audio for this long: the vocoder is stuck


def parse_request(data: Any, voice: str) -> dict[str, Any]:
    """The request's fields, checked; ProtocolError names the bad one."""
    if not isinstance(data, dict):
        raise ProtocolError("the body must be a JSON object")
    allowed = {
        "model",
        "input",
        "voice",
        "response_format",
        "speed",
        "instructions",
        "stream_format",
        "stream",
    }
    for key in data:
        if key not in allowed:
            raise ProtocolError(f"unknown field {key!r}", param=key)
    if not isinstance(data.get("model"), str):
        raise ProtocolError(
            "model is required (any name: the configured vocoder speaks)", param="model"
        )
    text = data.get("input")
    if not isinstance(text, str) or not text.strip():
        raise ProtocolError("input must be non-empty text", param="input")
    if len(text) > MAX_INPUT_CHARS:
        raise ProtocolError(f"input is longer than {MAX_INPUT_CHARS} characters", param="input")
    wanted = data.get("voice")
    if isinstance(wanted, dict):
        wanted = wanted.get("id")
    if wanted != voice:
        raise unsupported(
            f"voice={wanted!r}", f"this gateway's vocoder speaks with voice {voice!r}"
        )
    fmt = data.get("response_format", "pcm")
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise unsupported(f"response_format={fmt!r}", "the formats are 'pcm' and 'wav'")
    if data.get("speed", 1.0) != 1.0:
        raise unsupported("speed", "the vocoder speaks at speed 1.0")
    if data.get("instructions"):
        raise unsupported("instructions", "the vocoder takes no style instructions")
    if data.get("stream_format", "audio") != "audio":
        raise unsupported(f"stream_format={data['stream_format']!r}", "only 'audio' streams")
    stream = data.get("stream", True)
    if not isinstance(stream, bool):
        raise ProtocolError("stream must be true or false", param="stream")
    return {"input": text, "format": fmt, "stream": stream}


def wav_header(n_samples: int | None, rate: int = OUTPUT_RATE) -> bytes:
    """A PCM16 mono WAV header; with n_samples None, the sizes say 'unknown' (streaming)."""
    data_bytes = 0xFFFFFFFF if n_samples is None else n_samples * 2
    riff_bytes = 0xFFFFFFFF if n_samples is None else 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff_bytes)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data_bytes)
    )


class SpeechRequest:
    """One /v1/audio/speech request's pipeline session: its stage events, as a queue."""

    def __init__(self, link: PipelineLink, session: int, vocoder_rate: int) -> None:
        self.link = link
        self.session = session
        self.call_id = f"speech-{session}"
        self.queue: asyncio.Queue[Envelope] = asyncio.Queue()
        self.resampler = Upsampler(vocoder_rate, OUTPUT_RATE)
        self.done = False

    def on_stage_event(self, event: Envelope) -> None:
        self.queue.put_nowait(event)

    async def audio(self, text: str) -> Any:
        """Yield PCM16 24 kHz chunks as the vocoder makes them."""
        self.link.speak(self.session, ev.new_id("speech"), text)
        while True:
            async with asyncio.timeout(STALL_TIMEOUT_S):
                event = await self.queue.get()
            if event.kind is Kind.AUDIO_OUT:
                yield self.resampler.convert(np.frombuffer(event.msg, np.int16))
            elif event.kind is Kind.AUDIO_DONE:
                yield self.resampler.flush()
                self.done = True
                return
            elif event.kind is Kind.ERROR:
                raise RuntimeError(f"{event.msg.stage}: {event.msg.message}")


async def respond(
    request: web.Request, speech_request: SpeechRequest, fields: dict[str, Any]
) -> web.StreamResponse:
    """Stream (or, with stream false, send whole) the audio of `fields['input']`."""
    content_type = FORMATS[fields["format"]]
    wav = fields["format"] == "wav"
    if not fields["stream"]:
        chunks = [c async for c in speech_request.audio(fields["input"])]
        pcm = np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
        body = (wav_header(len(pcm)) if wav else b"") + pcm.astype("<i2").tobytes()
        return web.Response(body=body, content_type=content_type)
    response = web.StreamResponse(headers={"Content-Type": content_type})
    response.enable_chunked_encoding()
    await response.prepare(request)
    if wav:
        await response.write(wav_header(None))
    async for chunk in speech_request.audio(fields["input"]):
        if len(chunk):
            await response.write(chunk.astype("<i2").tobytes())
    await response.write_eof()
    return response
