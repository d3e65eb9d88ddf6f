"""Embedded offline speech recognizer: PocketSphinx with the en-us model that ships in its wheel.

Weak (word error rate 0.2-0.6 on synthetic speech) but real, offline and light: the default
configuration decodes at about 0.3-0.7x real time on one core (``maxhmmpf: 3000`` nearly halves
that for a little accuracy). Each turn gets a decoder from a pool;
making a decoder loads the acoustic model, language model and dictionary (~0.5 s), so decoders are
kept and reused instead of being made per turn.

PocketSphinx holds the GIL while it decodes, so ``feed`` hands it the audio in slices of
``FEED_SLICE_MS``: other threads of the encoder process (the ring reader) get to run in between.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from stages.backends.speech import (
    SpeechModelNotFoundError,
    SpeechOptionError,
    StreamClosedError,
    as_pcm16,
    reject_unknown_options,
)
from stages.messages import CALLER_RATE

logger = logging.getLogger(__name__)

#: Longest slice of audio decoded while holding the GIL: one 10 ms frame. The encoder's CANCEL
#: ack waits behind other sessions' decoding threads for up to a slice each, so longer slices
#: make its tail several times longer on 2 cores (docs/benchmarks.md, load report).
FEED_SLICE_MS = 10
#: Options that name files or folders, checked before the decoder is made.
_PATH_OPTIONS = ("hmm", "lm", "dict", "fdict", "jsgf", "fsg", "kws", "lmctl", "allphone", "mllr")
#: Defaults that differ from PocketSphinx's own. ``loglevel``: it logs every model file it reads.
#: ``fwdflat``: the second search pass costs ~0.5 s at the end of a 5 s turn (the final transcript
#: and a cancel both wait for it) for a word or two of accuracy; without it ``end_utt`` takes
#: ~60 ms.
_DEFAULTS: dict[str, Any] = {"loglevel": "ERROR", "fwdflat": False}


def load_pocketsphinx(pool_size: int = 1, **options: Any) -> PocketSphinxRecognizer:
    """Load PocketSphinx; ``options`` are its config parameters (``hmm``, ``lm``, ``dict``, ...).

    Without options it uses the en-us model from the wheel. ``pool_size`` decoders are made now;
    more are made (and then kept) when more turns than that are open at once.
    """
    import pocketsphinx

    known = {arg.name for arg in pocketsphinx.Config().describe()}
    reject_unknown_options("pocketsphinx", options, known | {"pool_size"})
    if isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1:
        raise SpeechOptionError(f"pocketsphinx option pool_size={pool_size!r} must be an int >= 1")
    samprate = options.get("samprate", CALLER_RATE)
    if samprate != CALLER_RATE:
        raise SpeechOptionError(
            f"pocketsphinx option samprate={samprate!r}: the encoder feeds {CALLER_RATE} Hz audio"
        )
    for key in _PATH_OPTIONS:
        value = options.get(key)
        if value is not None and not Path(value).expanduser().exists():
            raise SpeechModelNotFoundError(
                f"pocketsphinx option {key}: path {value!r} does not exist"
            )
    config = {**_DEFAULTS, **options}
    return PocketSphinxRecognizer(config, pool_size)


class PocketSphinxRecognizer:
    """Owns a pool of PocketSphinx decoders; each open stream borrows one."""

    name = "pocketsphinx"
    sample_rate = CALLER_RATE
    random_weights = False

    def __init__(self, config: dict[str, Any], pool_size: int = 1) -> None:
        self._config = dict(config)
        self._lock = threading.Lock()
        self._idle: list[Any] = []
        self._made = 0
        started = time.perf_counter()
        self._idle.extend(self._make_decoder() for _ in range(pool_size))
        logger.info(
            "pocketsphinx: %d decoder(s) ready in %.2f s", pool_size, time.perf_counter() - started
        )

    @property
    def decoders(self) -> int:
        """Decoders made so far (idle plus in use)."""
        return self._made

    @property
    def idle_decoders(self) -> int:
        """Decoders in the pool, ready for the next stream."""
        with self._lock:
            return len(self._idle)

    def open_stream(self) -> PocketSphinxStream:
        """Start a turn on a pooled decoder (making one if all are busy)."""
        with self._lock:
            decoder = self._idle.pop() if self._idle else None
        if decoder is None:
            logger.info("pocketsphinx: all %d decoders busy, making another", self._made)
            decoder = self._make_decoder()
        try:
            decoder.start_utt()
        except BaseException:
            self._release(decoder)
            raise
        return PocketSphinxStream(self, decoder)

    def _make_decoder(self) -> Any:
        import pocketsphinx

        try:
            decoder = pocketsphinx.Decoder(**self._config)
        except (KeyError, ValueError, TypeError, RuntimeError) as exc:
            raise SpeechOptionError(
                f"pocketsphinx rejected its config {self._config!r}: {type(exc).__name__}: {exc}"
            ) from exc
        self._made += 1
        return decoder

    def _release(self, decoder: Any) -> None:
        with self._lock:
            self._idle.append(decoder)


class PocketSphinxStream:
    """One turn on a borrowed decoder: partial hypotheses as audio comes, the final at the end."""

    def __init__(self, recognizer: PocketSphinxRecognizer, decoder: Any) -> None:
        self._recognizer = recognizer
        self._decoder: Any | None = decoder
        self._partial = ""
        self._slice = CALLER_RATE * FEED_SLICE_MS // 1000
        self._audio: list[np.ndarray] = []  # the turn so far, to decode again after a peek
        self._peeked: str | None = None  # the final of a peek, while no audio came after it

    def feed(self, pcm16: np.ndarray) -> str | None:
        """Decode more audio; return the partial transcript when it changed."""
        decoder = self._live_decoder("feed")
        pcm16 = as_pcm16(pcm16)
        if self._peeked is not None:  # the peek ended the utterance: decode it all again
            self._peeked = None
            decoder.start_utt()
            for earlier in self._audio:
                self._process(decoder, earlier)
        self._audio.append(pcm16.copy())
        self._process(decoder, pcm16)
        hyp = decoder.hyp()
        text = hyp.hypstr.strip() if hyp is not None else ""
        if text and text != self._partial:
            self._partial = text
            return text
        return None

    def _process(self, decoder: Any, pcm16: np.ndarray) -> None:
        for start in range(0, len(pcm16), self._slice):
            decoder.process_raw(pcm16[start : start + self._slice].tobytes(), False, False)

    def peek(self, silence_after: int = 0) -> str:
        """The final transcript if the turn ended now (the final search runs now; pocketsphinx
        decodes the audio as it is fed, and `silence_after` is not fed to it); the stream
        stays open: more audio decodes the whole turn again, `finish` returns this at once."""
        decoder = self._live_decoder("peek")
        if self._peeked is None:
            decoder.end_utt()
            hyp = decoder.hyp()
            self._peeked = hyp.hypstr.strip() if hyp is not None else ""
        return self._peeked

    def finish(self) -> str:
        """End the turn and return its final transcript (runs the final best-path search)."""
        decoder = self._live_decoder("finish")
        try:
            return self.peek()
        finally:
            self._done(decoder)

    def close(self) -> None:
        """Drop the turn; the decoder goes back to the pool. Safe to call twice."""
        decoder = self._decoder
        if decoder is None:
            return
        try:
            if self._peeked is None:
                decoder.end_utt()
        finally:
            self._done(decoder)

    def _live_decoder(self, action: str) -> Any:
        if self._decoder is None:
            raise StreamClosedError(
                f"cannot {action}: this recognizer stream is finished or closed"
            )
        return self._decoder

    def _done(self, decoder: Any) -> None:
        self._decoder = None
        self._audio = []
        self._recognizer._release(decoder)
