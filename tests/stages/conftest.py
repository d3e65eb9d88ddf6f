"""Fixtures of the speech backend tests: speech recordings made with espeak-ng, tiny models.

The recordings come from Debian's ``espeak-ng`` and ``sox`` command-line tools (independent of the
espeak backend under test), with espeak's Klatt variant: PocketSphinx recognizes it far better than
the default voice (17 of 20 words against 8 in a trial here).
"""

from __future__ import annotations

import shutil
import subprocess
import wave
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from stages.backends.tiny_speech_models import (
    TinySpeechT5,
    ensure_tiny_speecht5,
    ensure_tiny_whisper,
)

SPEECH_VOICE = ["-v", "en-us+klatt", "-s", "140"]


@dataclass(frozen=True)
class SpeechRecording:
    """A spoken sentence as 16 kHz mono PCM16, with the text it says."""

    text: str
    path: Path
    pcm16: np.ndarray

    @property
    def seconds(self) -> float:
        return len(self.pcm16) / 16000


@pytest.fixture(scope="session")
def make_speech(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], SpeechRecording]:
    """Speak a sentence with the espeak-ng CLI into a 16 kHz WAV (0.5 s of silence around it)."""
    missing = [tool for tool in ("espeak-ng", "sox") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: apt-get install -y espeak-ng sox")
    folder = tmp_path_factory.mktemp("speech")
    made: dict[str, SpeechRecording] = {}

    def make(text: str) -> SpeechRecording:
        if text not in made:
            stem = folder / f"utt{len(made)}"
            raw, wav = stem.with_suffix(".22k.wav"), stem.with_suffix(".wav")
            subprocess.run(["espeak-ng", *SPEECH_VOICE, "-w", str(raw), text], check=True)
            subprocess.run(
                [
                    "sox",
                    str(raw),
                    "-r",
                    "16000",
                    "-c",
                    "1",
                    "-b",
                    "16",
                    str(wav),
                    "pad",
                    "0.5",
                    "0.5",
                ],
                check=True,
            )
            with wave.open(str(wav)) as reader:
                assert reader.getframerate() == 16000 and reader.getsampwidth() == 2
                pcm16 = np.frombuffer(reader.readframes(reader.getnframes()), dtype=np.int16)
            made[text] = SpeechRecording(text, wav, pcm16)
        return made[text]

    return make


@pytest.fixture(scope="session")
def tiny_whisper(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder of a tiny random-weight Whisper, built once per session."""
    return ensure_tiny_whisper(tmp_path_factory.mktemp("models") / "tiny-whisper")


@pytest.fixture(scope="session")
def tiny_speecht5(tmp_path_factory: pytest.TempPathFactory) -> TinySpeechT5:
    """Folders of a tiny random-weight SpeechT5 and HiFi-GAN, built once per session."""
    return ensure_tiny_speecht5(tmp_path_factory.mktemp("models") / "tiny-speecht5")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Run torch on one thread for the module, then restore the count.

    Tiny models spend their time in thread hand-offs: on 2 busy cores one thread is ~8x faster.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
