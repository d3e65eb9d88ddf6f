"""libopus through opuslib (Debian's libopus0, else PyAV's own), at the pipeline's own rates.

Opus codes at 8, 12, 16, 24 or 48 kHz internally whatever the RTP clock says (always 48 kHz),
and any decoder can decode any stream at any of those rates. So the gateway needs no resampler
where aiortc's stock codecs need two: a caller's audio decodes straight to 16 kHz mono (what
the VAD and the encoder stage want) instead of 48 kHz stereo that is then downmixed and
resampled, and the agent's audio is encoded from the playout rate (24 kHz for espeak-ng's
22,050 Hz) instead of being resampled to 48 kHz stereo first.

`OpuslibDecoder` and `OpuslibEncoder` implement aiortc's codec interface; gateway.aiortc_tuning
installs them. `PacketCodec` is the same library for the WebSocket API's `audio/opus` format.
"""

from __future__ import annotations

import fractions
import logging
from pathlib import Path
from types import ModuleType

import av
import numpy as np
from av import AudioFrame

from stages.messages import CALLER_RATE

logger = logging.getLogger(__name__)

OPUS_RATES = (8_000, 12_000, 16_000, 24_000, 48_000)
RTP_RATE = 48_000  # Opus' RTP clock, whatever the coded rate
FRAME_MS = 20
MAX_PACKET_BYTES = 1275  # RFC 6716: the largest Opus frame
VOICE_BITRATE = 32_000  # mono speech: transparent well below aiortc's 96 kb/s stereo
# The agent's voice is clean synthesized speech: libopus' "audio" mode at complexity 5 codes it
# in about a quarter of the CPU of "voip" at 10 (SILK), which is what the gateway pays per call
# (loadtest/opus_bench.py compares them).
ENCODER_APPLICATION = "audio"
ENCODER_COMPLEXITY = 5


class OpusUnavailable(ValueError):
    """opuslib or the libopus it loads is missing; the message says what to install."""


def opuslib() -> ModuleType:
    """The opuslib module, imported on first use: a gateway on `experiments.opus: aiortc` and
    without the audio/opus format runs where libopus is not installed.

    Without a system libopus (Debian's libopus0), opuslib is pointed at the libopus that
    PyAV's wheel bundles, which aiortc loads anyway: the same library, under its wheel's name.
    """
    try:
        import opuslib as lib
    except ModuleNotFoundError as exc:
        raise _unavailable(exc) from None
    except Exception as exc:  # opuslib raises a bare Exception when libopus is missing
        bundled = _bundled_libopus()
        if bundled is None:
            raise _unavailable(exc) from None
        lib = _import_opuslib_with(bundled)
        logger.info("opuslib: no system libopus; using PyAV's bundled %s", bundled.name)
    return lib


def _unavailable(exc: Exception) -> OpusUnavailable:
    return OpusUnavailable(
        f"libopus through opuslib is not available ({exc}): install Debian's libopus0 "
        "and the opuslib package (scripts/setup.sh does both)"
    )


def _bundled_libopus() -> Path | None:
    """The libopus shared library inside PyAV's wheel (auditwheel's `av.libs`), if any."""
    folder = Path(av.__file__).parent.parent / "av.libs"
    found = sorted(folder.glob("libopus-*.so*"))
    return found[0] if found else None


def _import_opuslib_with(library: Path) -> ModuleType:
    """Import opuslib with its `find_library("opus")` answered by `library`."""
    import ctypes.util

    find_library = ctypes.util.find_library

    def find(name: str) -> str | None:
        return str(library) if name == "opus" else find_library(name)

    ctypes.util.find_library = find
    try:
        import opuslib as lib
    finally:
        ctypes.util.find_library = find_library
    return lib


class VoiceEncoder:
    """A mono libopus encoder for the agent's voice at `rate`, 20 ms a packet.

    Audio mode codes with CELT, whose decoder rings on after its input is cut to silence: its
    pitch post-filter decays by about 0.7 a frame, so a strongly periodic voice cut by a
    barge-in goes on sounding for 100-300 ms at the caller (with the random-weight SpeechT5
    voice, 17 frames above the silence level, where SILK stops at once). A cut from
    sound to digital silence therefore resets the encoder first; its first silent packet then
    ends the sound where it was cut.
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._encoder = opuslib().Encoder(rate, 1, ENCODER_APPLICATION)
        self._encoder.bitrate = VOICE_BITRATE
        self._encoder.complexity = ENCODER_COMPLEXITY
        self._sounding = False

    def encode(self, pcm16: np.ndarray) -> bytes:
        """One Opus packet for one frame of int16 samples at `rate`."""
        sounding = bool(pcm16.any())
        if self._sounding and not sounding:
            self._encoder.reset_state()
        self._sounding = sounding
        return self._encoder.encode(np.ascontiguousarray(pcm16, np.int16).tobytes(), len(pcm16))


def opus_rate_for(rate: int) -> int:
    """The lowest Opus rate that carries `rate` without losing band (48 kHz above 24 kHz)."""
    return next(r for r in OPUS_RATES if r >= rate) if rate <= OPUS_RATES[-1] else RTP_RATE


class OpuslibDecoder:
    """aiortc Decoder: RTP Opus payloads to s16 mono frames at `rate`, no resampling. A packet
    libopus rejects is logged and dropped; the stream goes on."""

    def __init__(self, rate: int = CALLER_RATE) -> None:
        if rate not in OPUS_RATES:
            raise ValueError(f"Opus decodes at {OPUS_RATES} Hz, not {rate}")
        self.rate = rate
        self.time_base = fractions.Fraction(1, rate)
        self.max_samples = rate * 120 // 1000  # the longest Opus packet: 120 ms
        self._lib = opuslib()
        self._decoder = self._lib.Decoder(rate, 1)

    def decode(self, encoded_frame: object) -> list[AudioFrame]:
        try:
            pcm = self._decoder.decode(bytes(encoded_frame.data), self.max_samples)
        except self._lib.OpusError as exc:
            logger.warning("dropped an Opus packet libopus rejected: %s", exc)
            return []
        samples = np.frombuffer(pcm, dtype=np.int16)
        frame = AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.rate
        frame.pts = encoded_frame.timestamp * self.rate // RTP_RATE
        frame.time_base = self.time_base
        return [frame]


class OpuslibEncoder:
    """aiortc Encoder: 20 ms s16 mono frames at an Opus rate are coded as they are; anything
    else (stereo, 44.1 kHz, other frame sizes) is first resampled to 48 kHz mono, 20 ms."""

    def __init__(self) -> None:
        self._encoders: dict[int, VoiceEncoder] = {}
        self._resampler: av.AudioResampler | None = None
        self._timestamp = 0  # RTP clock of the next packet

    def _encoder(self, rate: int) -> VoiceEncoder:
        encoder = self._encoders.get(rate)
        if encoder is None:
            encoder = self._encoders[rate] = VoiceEncoder(rate)
        return encoder

    def encode(self, frame: AudioFrame, force_keyframe: bool = False) -> tuple[list[bytes], int]:
        rate = frame.sample_rate
        if (
            rate in OPUS_RATES
            and frame.layout.name == "mono"
            and frame.format.name == "s16"
            and frame.samples == rate * FRAME_MS // 1000
        ):
            frames = [frame]
        else:
            if self._resampler is None:
                self._resampler = av.AudioResampler(
                    format="s16", layout="mono", rate=RTP_RATE, frame_size=RTP_RATE // 50
                )
            frames = self._resampler.resample(frame)
        payloads = []
        timestamp = self._timestamp
        for f in frames:
            payloads.append(self._encoder(f.sample_rate).encode(f.to_ndarray().reshape(-1)))
            self._timestamp += RTP_RATE * FRAME_MS // 1000
        return payloads, timestamp

    def pack(self, packet: object) -> tuple[list[bytes], int]:
        raise NotImplementedError("pre-encoded Opus packets are not sent through the gateway")


class PacketCodec:
    """One session's `audio/opus` over the WebSocket API: a 20 ms packet per event, decoded to
    16 kHz for the pipeline; the agent's audio encoded at 24 kHz, 20 ms a packet."""

    def __init__(self, in_rate: int = CALLER_RATE, out_rate: int = 24_000) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._lib = opuslib()
        self._decoder = self._lib.Decoder(in_rate, 1)
        self._encoder = VoiceEncoder(out_rate)
        self._frame = out_rate * FRAME_MS // 1000
        self._held = np.zeros(0, np.int16)

    def decode(self, packet: bytes) -> np.ndarray:
        """PCM16 at `in_rate`; ValueError for a packet that is not Opus."""
        if not packet or len(packet) > MAX_PACKET_BYTES:
            raise ValueError(f"an Opus packet is 1 to {MAX_PACKET_BYTES} bytes, not {len(packet)}")
        try:
            pcm = self._decoder.decode(packet, self.in_rate * 120 // 1000)
        except self._lib.OpusError as exc:
            raise ValueError(f"not an Opus packet: {exc}") from None
        return np.frombuffer(pcm, dtype=np.int16)

    def encode(self, pcm: np.ndarray) -> list[bytes]:
        """Opus packets for whole 20 ms frames of `pcm` (at `out_rate`); the rest is held."""
        pcm = np.concatenate([self._held, np.asarray(pcm, np.int16)])
        whole = len(pcm) - len(pcm) % self._frame
        self._held = pcm[whole:].copy()
        frame = self._frame
        return [self._encoder.encode(pcm[i : i + frame]) for i in range(0, whole, frame)]

    def flush(self) -> list[bytes]:
        """The held samples, padded with silence to a last packet."""
        if not len(self._held):
            return []
        pad = np.zeros(self._frame - len(self._held), np.int16)
        return self.encode(pad)

    def reset(self) -> None:
        self._held = np.zeros(0, np.int16)
