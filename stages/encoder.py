"""The encoder stage: caller audio in, partial and final transcripts out."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from stages.backends.speech import RecognizerStream, SpeechRecognizer
from stages.config import EncoderConfig
from stages.messages import Kind, SpeechStopped, Transcript
from stages.rings import GATEWAY
from stages.worker import Inbound, QueuedStage

logger = logging.getLogger(__name__)


def load_recognizer(config: EncoderConfig) -> SpeechRecognizer:
    """The configured speech recognizer, loaded (the same code for tests and production)."""
    if config.backend == "pocketsphinx":
        from stages.backends.asr_pocketsphinx import load_pocketsphinx

        return load_pocketsphinx(**config.options)
    from stages.backends.asr_whisper import load_whisper

    assert config.model is not None  # the config validator makes sure
    return load_whisper(
        config.model,
        device=config.device,
        partial_interval_ms=config.partial_interval_ms,
        **config.options,
    )


@dataclass
class Turn:
    turn_id: int
    epoch: int
    stream: RecognizerStream


class EncoderStage(QueuedStage):
    name = "encoder"

    def load(self) -> dict[str, Any]:
        t0 = time.monotonic()
        self.recognizer = load_recognizer(self.config.encoder)
        self.turns: dict[int, Turn] = {}
        logger.info("encoder: %s ready in %.1f s", self.recognizer.name, time.monotonic() - t0)
        return {"backend": self.recognizer.name}

    def handle(self, item: Inbound) -> None:
        s = item.session
        if item.kind is Kind.AUDIO_IN:
            turn = self.turns.get(s) or self._open(s, -1, item.epoch)
            partial = turn.stream.feed(np.frombuffer(item.msg, dtype=np.int16))
            if partial:
                self.send(
                    GATEWAY, s, Transcript(turn.turn_id, partial, final=False), epoch=item.epoch
                )
        elif item.kind is Kind.SPEECH_STARTED:
            self._open(s, item.msg.turn_id, item.epoch)
        elif item.kind is Kind.SPEECH_STOPPED:
            self._finish(item)
        elif item.kind is Kind.CANCEL:
            # stale audio is gone from the ring already; a turn begun before the cancel is
            # dropped, the speech that caused it (newer epoch) is kept
            turn = self.turns.get(s)
            if turn is not None and turn.epoch != item.epoch:
                self._drop(s)
            self.ack(s, item.msg.cancel_id)
        elif item.kind in (Kind.SESSION_OPEN, Kind.SESSION_CLOSE):
            self._drop(s)

    def _open(self, session: int, turn_id: int, epoch: int) -> Turn:
        self._drop(session)
        turn = Turn(turn_id, epoch, self.recognizer.open_stream())
        self.turns[session] = turn
        return turn

    def _drop(self, session: int) -> None:
        turn = self.turns.pop(session, None)
        if turn is not None:
            turn.stream.close()

    def _finish(self, item: Inbound) -> None:
        msg: SpeechStopped = item.msg
        turn = self.turns.pop(item.session, None)
        text = ""
        if turn is not None:
            try:
                text = turn.stream.finish()
            finally:
                turn.stream.close()
        final = Transcript(
            msg.turn_id,
            text,
            final=True,
            create_response=msg.create_response,
            speech_stopped_ns=item.t_ns,
        )
        self.send(GATEWAY, item.session, final, epoch=item.epoch)
        self.send("reasoning", item.session, final, epoch=item.epoch)
