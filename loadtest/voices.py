"""The load generator's callers' voices: sentences spoken by Debian's espeak-ng, and the
question of the GPU run's callers spoken by espeak-ng from its wheel."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import numpy as np

# espeak's Klatt variant: pocketsphinx recognizes it far better than the default voice
ESPEAK_VOICE = ("-v", "en-us+klatt", "-s", "140")
VOICED_SAMPLE = 500  # |sample| above which a clip counts as speech
QUESTION = "tell me about the weather today"  # what the GPU run's callers ask
#: a question of several seconds: several of a speech-in tower's windows (2 s) before it ends
LONG_QUESTION = (
    "I am going hiking in the mountains next weekend with two friends of mine, so tell me "
    "about the weather up there and what we should pack"
)
QUESTIONS = {"short": QUESTION, "long": LONG_QUESTION}


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


def caller_speech(pause_ms: int = 0, question: str = QUESTION) -> np.ndarray:
    """The caller's `question` spoken by espeak-ng (from its wheel), 48 kHz, leading silence
    cut.

    With `pause_ms` the question is two halves with that much silence between them: a caller
    who stops mid-sentence, so a reply prepared at the pause is started and then dropped."""
    from stages.audio import resample
    from stages.backends.tts_espeak import load_espeak

    voice = load_espeak(voice="en-us")

    def speak(text: str, *, trailing_silence: bool = True) -> np.ndarray:
        pcm = np.concatenate(list(voice.synthesize(text)))
        voiced = np.flatnonzero(np.abs(pcm) > VOICED_SAMPLE)
        end = len(pcm) if trailing_silence else voiced[-1] + 1
        return resample(pcm[voiced[0] : end], voice.sample_rate, 48000)

    if not pause_ms:
        return speak(question)
    words = question.split()
    first, rest = " ".join(words[: len(words) // 2]), " ".join(words[len(words) // 2 :])
    silence = np.zeros(48 * pause_ms, dtype=np.int16)
    return np.concatenate([speak(first, trailing_silence=False), silence, speak(rest)])
