"""gateway.opus: libopus at the pipeline's rates, and the WebSocket packet codec."""

from __future__ import annotations

import fractions
from dataclasses import dataclass

import numpy as np
import pytest
from av import AudioFrame

from gateway.opus import (
    ENCODER_APPLICATION,
    ENCODER_COMPLEXITY,
    VOICE_BITRATE,
    OpuslibDecoder,
    OpuslibEncoder,
    PacketCodec,
    opus_rate_for,
    opuslib,
)


def tone(rate: int, seconds: float, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (np.sin(2 * np.pi * hz * t) * 8000).astype(np.int16)


def frame(pcm: np.ndarray, rate: int, layout: str = "mono") -> AudioFrame:
    channels = 2 if layout == "stereo" else 1
    f = AudioFrame.from_ndarray(
        np.repeat(pcm, channels).reshape(1, -1), format="s16", layout=layout
    )
    f.sample_rate, f.pts, f.time_base = rate, 0, fractions.Fraction(1, rate)
    return f


@dataclass
class RtpFrame:  # what aiortc's jitter buffer hands a decoder
    data: bytes
    timestamp: int


def level(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(pcm.astype(float) ** 2)))


def test_rates_map_to_the_nearest_opus_rate() -> None:
    assert [opus_rate_for(r) for r in (8000, 16000, 22050, 24000, 44100)] == [
        8000,
        16000,
        24000,
        24000,
        48000,
    ]


def test_encoder_codes_opus_rates_as_they_are_and_resamples_the_rest() -> None:
    encoder = OpuslibEncoder()
    decoder = OpuslibDecoder(16_000)
    pcm = tone(24_000, 1.0)
    out = []
    for i, start in enumerate(range(0, len(pcm), 480)):
        payloads, timestamp = encoder.encode(frame(pcm[start : start + 480], 24_000))
        assert len(payloads) == 1 and timestamp == i * 960  # RTP clock is 48 kHz
        for f in decoder.decode(RtpFrame(payloads[0], timestamp)):
            assert (f.sample_rate, f.layout.name, f.samples) == (16_000, "mono", 320)
            out.append(f.to_ndarray().reshape(-1))
    heard = np.concatenate(out)
    assert level(heard[1600:]) > 0.7 * level(pcm)  # the tone survives, at 16 kHz
    # 44.1 kHz stereo in 10 ms frames (not an Opus shape) goes through a resampler
    other = OpuslibEncoder()
    payloads = []
    for _ in range(10):
        payloads += other.encode(frame(tone(44_100, 0.01), 44_100, "stereo"))[0]
    assert len(payloads) in (4, 5)  # 100 ms of audio, 20 ms packets, minus filter delay


@pytest.mark.parametrize("rate", [16_000, 24_000])
def test_a_voice_cut_to_silence_stops_at_the_cut(rate: int) -> None:
    """A low buzz (a periodic voice, as the random-weight SpeechT5 makes) cut to digital
    silence, as a barge-in cuts the agent: what the caller decodes is silent from the frame
    after the cut. libopus' CELT alone rings on for a dozen frames (the stock encoder, below)."""
    t = np.arange(rate) / rate
    buzz = (np.sign(np.sin(2 * np.pi * 50 * t)) * 4700).astype(np.int16)
    pcm = np.concatenate([buzz, np.zeros(rate // 2, np.int16)])
    n = rate // 50
    ours = OpuslibEncoder()
    stock = opuslib().Encoder(rate, 1, ENCODER_APPLICATION)
    stock.bitrate, stock.complexity = VOICE_BITRATE, ENCODER_COMPLEXITY
    heard_ours, heard_stock = OpuslibDecoder(48_000), OpuslibDecoder(48_000)
    levels: dict[str, list[float]] = {"ours": [], "stock": []}
    for i, start in enumerate(range(0, len(pcm), n)):
        chunk = pcm[start : start + n]
        packet = ours.encode(frame(chunk, rate))[0][0]
        levels["ours"].append(level(heard_ours.decode(RtpFrame(packet, i * 960))[0].to_ndarray()))
        packet = stock.encode(chunk.tobytes(), n)
        levels["stock"].append(level(heard_stock.decode(RtpFrame(packet, i * 960))[0].to_ndarray()))
    cut = 50  # the first silent frame
    assert min(levels["ours"][:cut]) > 1000  # the buzz went through
    assert max(levels["ours"][cut + 1 :]) < 30  # silent from the frame after the cut
    assert sum(lv >= 30 for lv in levels["stock"][cut + 1 :]) >= 3  # what the reset prevents


def test_decoder_drops_a_corrupt_packet_and_goes_on() -> None:
    decoder = OpuslibDecoder(16_000)
    assert decoder.decode(RtpFrame(b"\xff\xff\xff", 0)) == []
    packet = OpuslibEncoder().encode(frame(tone(16_000, 0.02), 16_000))[0][0]
    assert decoder.decode(RtpFrame(packet, 960))[0].samples == 320


def test_packet_codec_round_trip_and_bad_packets() -> None:
    sender, receiver = PacketCodec(out_rate=24_000), PacketCodec(in_rate=16_000)
    pcm = tone(24_000, 0.5)
    packets = sender.encode(pcm[:5000]) + sender.encode(pcm[5000:]) + sender.flush()
    assert len(packets) == 25 and all(len(p) < 200 for p in packets)
    heard = np.concatenate([receiver.decode(p) for p in packets])
    assert len(heard) == 25 * 320 and level(heard[1600:]) > 0.7 * level(pcm)
    for bad in (b"", b"\xff\xfe\x00garbage", bytes(2000)):
        with pytest.raises(ValueError):
            receiver.decode(bad)


def test_without_libopus_the_error_says_what_to_install(monkeypatch) -> None:
    import sys

    from gateway.opus import OpusUnavailable
    from gateway.protocol import ProtocolError, SessionConfig

    monkeypatch.setitem(sys.modules, "opuslib", None)  # as if not installed
    with pytest.raises(OpusUnavailable, match=r"libopus0 and the opuslib package"):
        PacketCodec()
    with pytest.raises(ProtocolError) as err:
        SessionConfig(voice="v").apply({"audio": {"input": {"format": {"type": "audio/opus"}}}})
    assert err.value.code == "unsupported" and "libopus0" in str(err.value)


def test_without_a_system_libopus_opuslib_uses_pyav_s_own() -> None:
    """Where Debian's libopus0 is missing (the GPU machines), opuslib loads the libopus in
    PyAV's wheel and codes as before. In a fresh interpreter: opuslib is imported once."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import ctypes.util
        system = ctypes.util.find_library
        ctypes.util.find_library = lambda name: None if name == "opus" else system(name)
        import numpy as np
        from gateway.opus import PacketCodec, opuslib
        lib = opuslib()
        assert ctypes.util.find_library("opus") is None  # put back as it was
        codec = PacketCodec()
        t = np.arange(24000) / 24000  # a second of the agent's voice at 24 kHz, heard at 16
        pcm = (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16)
        heard = np.concatenate([codec.decode(p) for p in codec.encode(pcm) + codec.flush()])
        print(lib.api.lib_location, len(heard), int(np.abs(heard[3200:]).max()))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    location, samples, peak = done.stdout.split()
    assert "av.libs" in location and "libopus" in location
    assert int(samples) == 16000 and int(peak) > 4000
