"""Piper voices (VITS, ONNX) through onnxruntime, on espeak-ng's IPA phonemes.

Any Piper voice: a `.onnx` with its `.onnx.json` beside it, a folder holding one, or the bundled
en_US-joe-medium (`bundled:piper-en_US-joe-medium`, stages.backends.bundled). The text is turned
into phoneme ids as Piper's own phonemizer does: espeak-ng's IPA a clause at a time, the clause's
closing punctuation kept (`, : ;` with a space after), sentences apart, Unicode NFD, and each
phoneme's id followed by the pad id between `^` and `$`. The GPL `piper-tts` package is not
used: espeak-ng is loaded as the espeak voice loads it (stages.backends.espeak_library).

A sentence is one ONNX run (VITS makes its whole waveform at once), so a reply's phrases are
spoken a sentence at a time; a cancel is seen between sentences, and each is at most a phrase
of the vocoder's splitter.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from stages.backends.espeak_library import EspeakLibrary
from stages.backends.speech import (
    MAX_CHUNK_MS,
    SpeechModelNotFoundError,
    SpeechOptionError,
    reject_unknown_options,
    split_pcm16,
)

logger = logging.getLogger(__name__)

PAD, BOS, EOS = "_", "^", "$"
_LANGUAGE_SWITCH = re.compile(r"\([^)]+\)")  # espeak's "(fr)" ... "(en)" marks
_KEPT_PUNCTUATION = ".?!,:;"
_DASHES = "\u2013\u2014"  # espeak ends a clause at them, as at a semicolon


def load_piper(
    model: str,
    *,
    threads: int = 1,
    length_scale: float | None = None,
    volume: float = 1.0,
    warmup: bool = True,
    noise_scale: float | None = None,
    noise_w: float | None = None,
    **unknown: Any,
) -> PiperVoice:
    """Load a Piper voice. ``threads``: onnxruntime's threads for one sentence;
    ``length_scale``: slower (> 1) or faster (< 1) than the voice's own pace; ``volume``: the
    peak of each sentence, as a share of full scale (Piper normalises each to full scale);
    ``noise_scale``, ``noise_w``: the voice's own randomness in sound and timing (its config's
    by default; 0 and 0 say a text the same way every time)."""
    reject_unknown_options(
        "piper",
        unknown,
        ("threads", "length_scale", "volume", "warmup", "noise_scale", "noise_w"),
    )
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SpeechOptionError(f"piper option threads={threads!r} must be an int >= 1")
    if length_scale is not None and not 0.25 <= float(length_scale) <= 4:
        raise SpeechOptionError(f"piper option length_scale={length_scale!r} must be in 0.25..4")
    if not 0 < float(volume) <= 1:
        raise SpeechOptionError(f"piper option volume={volume!r} must be in (0, 1]")
    for name, value in (("noise_scale", noise_scale), ("noise_w", noise_w)):
        if value is not None and not 0 <= float(value) <= 2:
            raise SpeechOptionError(f"piper option {name}={value!r} must be in 0..2")
    onnx, config_path = _voice_files(model)
    import onnxruntime

    started = time.monotonic()
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # its warnings about unused initializers are noise
    try:
        session = onnxruntime.InferenceSession(
            str(onnx), sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:
        raise SpeechModelNotFoundError(f"cannot load the Piper voice {onnx}: {exc}") from exc
    config = json.loads(config_path.read_text(encoding="utf-8"))
    voice = PiperVoice(
        session, config, onnx.stem, length_scale, float(volume), noise_scale, noise_w
    )
    if warmup:
        list(voice.synthesize("Hello."))
    logger.info("piper voice %s loaded in %.1f s", onnx.stem, time.monotonic() - started)
    return voice


def _voice_files(model: str) -> tuple[Path, Path]:
    path = Path(model).expanduser()
    if path.is_dir():
        found = sorted(path.glob("*.onnx"))
        if len(found) != 1:
            raise SpeechModelNotFoundError(
                f"piper voice folder {str(path)!r} holds {len(found)} .onnx files, not one"
            )
        path = found[0]
    if not path.is_file():
        raise SpeechModelNotFoundError(f"piper voice {str(path)!r} does not exist")
    config = path.with_name(path.name + ".json")
    if not config.is_file():
        raise SpeechModelNotFoundError(f"piper voice {path} has no {config.name} beside it")
    return path, config


class PiperVoice:
    """A loaded Piper voice; safe to use from several threads (one sentence at a time)."""

    name = "piper"
    random_weights = False

    def __init__(
        self,
        session: Any,
        config: dict[str, Any],
        voice_name: str,
        length_scale: float | None,
        volume: float,
        noise_scale: float | None = None,
        noise_w: float | None = None,
    ) -> None:
        self._session = session
        self._inputs = {i.name for i in session.get_inputs()}
        self.voice_name = voice_name
        self.sample_rate = int(config["audio"]["sample_rate"])
        self._ids: dict[str, list[int]] = config["phoneme_id_map"]
        self._espeak_voice = config.get("espeak", {}).get("voice", "en-us")
        inference = config.get("inference", {})
        self._scales = np.array(
            [
                inference.get("noise_scale", 0.667) if noise_scale is None else noise_scale,
                length_scale or inference.get("length_scale", 1.0),
                inference.get("noise_w", 0.8) if noise_w is None else noise_w,
            ],
            dtype=np.float32,
        )
        self._volume = volume
        self._espeak = EspeakLibrary.get()
        self._lock = threading.Lock()

    def sentences(self, text: str) -> list[list[str]]:
        """`text` as Piper's phonemizer splits it: sentences of phonemes (code points)."""
        sentences: list[list[str]] = []
        current: list[str] = []
        for ipa, clause in self._espeak.clauses(text, self._espeak_voice):
            mark, sentence_ends = _clause_end(clause)
            ipa = _LANGUAGE_SWITCH.sub("", ipa) + mark
            if mark and mark in ",:;":
                ipa += " "
            current.extend(unicodedata.normalize("NFD", ipa))
            if sentence_ends:
                sentences.append(current)
                current = []
        sentences.append(current)
        return [s for s in sentences if s]

    def ids(self, phonemes: list[str]) -> list[int]:
        """Each phoneme's id, a pad after each, between the start and end ids; phonemes the
        voice has no id for are left out, as Piper leaves them."""
        ids = [*self._ids[BOS], *self._ids[PAD]]
        for phoneme in phonemes:
            if phoneme in self._ids:
                ids += [*self._ids[phoneme], *self._ids[PAD]]
        return [*ids, *self._ids[EOS]]

    def synthesize(self, text: str, stop: Callable[[], bool] | None = None) -> Iterator[np.ndarray]:
        """Yield int16 chunks of at most MAX_CHUNK_MS, a sentence at a time; `stop` is asked
        before each sentence."""
        for phonemes in self.sentences(text):
            if stop is not None and stop():
                return
            audio = self._run(self.ids(phonemes))
            yield from split_pcm16(audio, self.sample_rate, MAX_CHUNK_MS)

    def _run(self, ids: list[int]) -> np.ndarray:
        feeds = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": self._scales,
        }
        if "sid" in self._inputs:
            feeds["sid"] = np.zeros(1, dtype=np.int64)
        with self._lock:
            audio = self._session.run(None, feeds)[0].reshape(-1)
        peak = float(np.max(np.abs(audio))) if audio.size else 0.0
        if peak < 1e-8:
            return np.zeros(len(audio), np.int16)
        return (np.clip(audio / peak * self._volume, -1, 1) * 32767).astype(np.int16)


def _clause_end(clause: str) -> tuple[str, bool]:
    """The punctuation Piper keeps after a clause, and whether the clause ends a sentence."""
    body = clause.rstrip()
    if clause[len(body) :].count("\n") >= 2:
        return "", True  # a paragraph break
    if not body or not any(c.isalnum() for c in body):
        return "", False
    if body.endswith(("..", "\u2026")):
        return "", False  # an ellipsis pauses, it does not end the sentence
    end = re.search(r"[?!]+$", body)
    mark = end.group(0)[0] if end else body[-1]
    if mark in ".?!":
        return mark, True
    if mark in ",:;":
        return mark, False
    if mark in _DASHES:
        return ";", False
    return "", False
