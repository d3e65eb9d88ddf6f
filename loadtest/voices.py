"""The load generator's callers' voices: sentences spoken by Debian's espeak-ng."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import numpy as np

# espeak's Klatt variant: pocketsphinx recognizes it far better than the default voice
ESPEAK_VOICE = ("-v", "en-us+klatt", "-s", "140")
VOICED_SAMPLE = 500  # |sample| above which a clip counts as speech


def spoken(text: str, rate: int = 48_000, *, trim: bool = True) -> np.ndarray:
    """`text` spoken by the espeak-ng command, PCM16 mono at `rate`; with `trim` its leading
    silence is cut, so the clip's first 20 ms frame is speech."""
    from stages.audio import read_wav, resample

    with tempfile.TemporaryDirectory() as tmp:
        wav = Path(tmp) / "spoken.wav"
        subprocess.run(
            ["espeak-ng", *ESPEAK_VOICE, "-w", str(wav), text], check=True, capture_output=True
        )
        pcm, source_rate = read_wav(wav)
    if trim:
        pcm = pcm[int(np.argmax(np.abs(pcm) > VOICED_SAMPLE)) :]
    return resample(pcm, source_rate, rate)
