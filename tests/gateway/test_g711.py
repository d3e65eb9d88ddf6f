"""gateway.g711: G.711 through FFmpeg's codecs, to and from the pipeline's rates."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.g711 import FRAME_BYTES, G711


@pytest.mark.parametrize("audio_format", ["audio/pcmu", "audio/pcma"])
def test_a_tone_survives_coding_and_the_rates(audio_format: str) -> None:
    rate = 22_050  # the vocoder's
    t = np.arange(rate) / rate
    tone = (np.sin(2 * np.pi * 440 * t) * 12_000).astype(np.int16)
    out, back = G711(audio_format, rate), G711(audio_format)
    coded = b"".join(out.encode(tone[i : i + 1234]) for i in range(0, len(tone), 1234))
    coded += out.flush()
    assert abs(len(coded) - 8000) <= FRAME_BYTES  # a second of 8 kHz, a byte a sample
    pcm16k = np.concatenate([back.decode(coded[i : i + 160]) for i in range(0, len(coded), 160)])
    assert abs(len(pcm16k) - 16_000) <= 320
    # the same tone at 16 kHz: its level, and its pitch by zero crossings
    middle = pcm16k[2000:14000].astype(float)
    assert 0.6 < np.sqrt(np.mean(middle**2)) / (12_000 / np.sqrt(2)) < 1.2
    crossings = np.count_nonzero(np.diff(np.signbit(middle)))
    assert abs(crossings / 2 / (len(middle) / 16_000) - 440) < 10


def test_the_two_laws_code_differently() -> None:
    pcm = (np.arange(-4000, 4000, 50)).astype(np.int16)
    assert G711("audio/pcmu").encode(pcm) != G711("audio/pcma").encode(pcm)
    assert G711("audio/pcmu").decode(b"").size == 0
