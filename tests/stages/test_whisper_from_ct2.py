"""stages.backends.whisper_from_ct2: the bundled CTranslate2 Whisper tiny.en, made into a
transformers checkpoint at set-up, hears through the whisper backend what CTranslate2 hears;
a model.bin it cannot convert is refused, saying why."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest

from stages.audio import resample
from stages.backends import bundled
from stages.backends.asr_ctranslate2 import load_ctranslate2_whisper
from stages.backends.asr_whisper import load_whisper
from stages.backends.tts_piper import load_piper
from stages.backends.whisper_from_ct2 import ConversionError, convert, read_model_bin

pytestmark = pytest.mark.timeout(120)


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def test_the_converted_checkpoint_hears_what_ctranslate2_hears() -> None:
    voice = load_piper(
        bundled.resolve("bundled:piper-en_US-joe-medium"), noise_scale=0.0, noise_w=0.0
    )
    converted = load_whisper(
        bundled.resolve("bundled:whisper-tiny.en-transformers"), partial_interval_ms=0
    )
    original = load_ctranslate2_whisper(
        bundled.resolve("bundled:whisper-tiny.en"), partial_interval_ms=0
    )
    for text in ("It is 42 degrees in Paris today.", "Would you like to book a table for two?"):
        pcm = resample(np.concatenate(list(voice.synthesize(text))), voice.sample_rate, 16000)
        heard = converted.transcribe(pcm)
        assert words(heard) == words(original.transcribe(pcm)), heard
        assert words(heard) == words(text), heard


def _model_bin(path: Path, version: int, spec: str, variables: dict[str, np.ndarray]) -> None:
    def text(s: str) -> bytes:
        return struct.pack("H", len(s) + 1) + s.encode() + b"\0"

    kinds = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.float16): 4}
    out = struct.pack("I", version) + text(spec) + struct.pack("II", 1, len(variables))
    for name, value in variables.items():
        out += text(name) + struct.pack("B", value.ndim)
        out += b"".join(struct.pack("I", d) for d in value.shape)
        out += struct.pack("B", kinds[value.dtype]) + struct.pack("I", value.nbytes)
        out += value.tobytes()
    path.write_bytes(out + struct.pack("I", 0))


def test_model_bin_is_read_as_ctranslate2_writes_it(tmp_path: Path) -> None:
    weight = np.arange(6, dtype=np.float16).reshape(2, 3)
    _model_bin(tmp_path / "model.bin", 6, "WhisperSpec", {"encoder/conv1/weight": weight})
    spec, variables = read_model_bin(tmp_path / "model.bin")
    assert spec == "WhisperSpec"
    np.testing.assert_array_equal(variables["encoder/conv1/weight"], weight)


@pytest.mark.parametrize(
    ("version", "spec", "dtype", "error"),
    [
        (3, "WhisperSpec", np.float16, "binary version 3"),
        (6, "TransformerSpec", np.float16, "a TransformerSpec, not a Whisper model"),
        (6, "WhisperSpec", np.int8, "weights of type int8"),
    ],
)
def test_a_model_bin_it_cannot_convert_is_refused_saying_why(
    tmp_path: Path, version: int, spec: str, dtype: type, error: str
) -> None:
    weights = {"decoder/embeddings/weight": np.ones((4, 2), dtype)}
    _model_bin(tmp_path / "model.bin", version, spec, weights)
    with pytest.raises(ConversionError, match=error):
        convert(tmp_path, tmp_path / "out")
    (tmp_path / "model.bin").write_bytes(struct.pack("I", 6) + b"\x05")  # cut short
    with pytest.raises(ConversionError, match=r"not a whole CTranslate2 model\.bin"):
        read_model_bin(tmp_path / "model.bin")
