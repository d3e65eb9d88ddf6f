"""G.711 (ITU-T): μ-law (`audio/pcmu`) and A-law (`audio/pcma`), 8 kHz, one byte a sample:
the telephone network's audio, and Twilio's. Coded by FFmpeg's codecs through PyAV; the rate
conversion to and from the pipeline's rates is libswresample's (gateway.resample).

A `G711` codes one direction of one call. The codes are memoryless, so pieces of any length
code alone; the resamplers beside them keep their filter state across pieces.
"""

from __future__ import annotations

import av
import numpy as np

from gateway.resample import Upsampler
from stages.messages import CALLER_RATE

RATE = 8_000
FRAME_BYTES = RATE // 50  # 20 ms: one byte a sample
CODECS = {"audio/pcmu": "pcm_mulaw", "audio/pcma": "pcm_alaw"}


class G711:
    """One direction's coder: `decode` G.711 bytes to PCM16 at 16 kHz (the caller rate), or
    `encode` PCM16 at `source_rate` (the vocoder's) to G.711 bytes."""

    def __init__(self, audio_format: str, source_rate: int = CALLER_RATE) -> None:
        self.audio_format = audio_format
        self._codec = CODECS[audio_format]
        self._decoder = av.CodecContext.create(self._codec, "r")
        self._decoder.sample_rate = RATE
        self._decoder.layout = "mono"
        self._encoder = av.CodecContext.create(self._codec, "w")
        self._encoder.sample_rate = RATE
        self._encoder.format = "s16"
        self._encoder.layout = "mono"
        self._up = Upsampler(RATE, CALLER_RATE)
        self._down = Upsampler(source_rate, RATE)

    def decode(self, data: bytes) -> np.ndarray:
        """G.711 bytes → PCM16 mono at 16 kHz."""
        if not data:
            return np.zeros(0, np.int16)
        frames = self._decoder.decode(av.Packet(data))
        pcm8k = np.concatenate([f.to_ndarray().reshape(-1) for f in frames])
        return self._up.convert(pcm8k.astype(np.int16))

    def encode(self, pcm: np.ndarray) -> bytes:
        """PCM16 mono at the source rate → G.711 bytes (8 kHz); a little is held back in the
        resampler until the next piece or `flush`."""
        return self._code(self._down.convert(pcm))

    def flush(self) -> bytes:
        """What the resampler still holds, coded: the end of a reply."""
        return self._code(self._down.flush())

    def reset(self) -> None:
        """A new reply, or a cleared one: the resampler starts afresh."""
        self._down.reset()

    def _code(self, pcm8k: np.ndarray) -> bytes:
        if not len(pcm8k):
            return b""
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(pcm8k, np.int16).reshape(1, -1), format="s16", layout="mono"
        )
        frame.sample_rate = RATE
        return b"".join(bytes(p) for p in self._encoder.encode(frame))
