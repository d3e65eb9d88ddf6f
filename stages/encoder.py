"""The encoder stage: caller audio in, partial and final transcripts out; for a speech-in
model (reasoning.speech_in), the audio tower's rows of each turn too, window by window.

The model loop only routes: recognition runs on per-session lanes (stages.lanes), so a CANCEL is
acknowledged at once while another session's turn is still being decoded.

At a TURN_PAUSED the turn so far is transcribed (a backend whose stream can `peek`) and sent to
reasoning, which starts the reply on it (stages.prepared). Under speech-in, reasoning gets the
turn's rows instead: each window's as it completes, the open window's at a pause and at the
end, made on lanes of their own (the tower's), so that the reply never waits for the
recognizer; its transcripts are for the client, the turn-taking and the history's text. The
windows the tower lanes ask for at once go through the tower in one pass (stages.tower_batch).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from stages.backends import bundled
from stages.backends.speech import (
    RecognizerStream,
    SpeechRecognizer,
    gpu_stream,
    torch_device,
)
from stages.backends.words_end_turn import WordsEndTurn
from stages.config import EncoderConfig
from stages.envelope import Envelope
from stages.lanes import SessionLanes
from stages.messages import (
    CALLER_RATE,
    AudioEmbeddings,
    SpeechStarted,
    SpeechStopped,
    Transcript,
    TurnPaused,
    TurnResumed,
)
from stages.prepared import PausedTurn
from stages.rings import GATEWAY
from stages.speech_in import speech_in_model
from stages.stage import QueuedStage
from stages.stops import Stop
from stages.tower_batch import BatchedTower

logger = logging.getLogger(__name__)


def load_recognizer(config: EncoderConfig) -> SpeechRecognizer:
    """The configured speech recognizer, loaded (the same code for tests and production)."""
    if config.backend == "pocketsphinx":
        from stages.backends.asr_pocketsphinx import load_pocketsphinx

        return load_pocketsphinx(**config.options)
    assert config.model is not None  # the config validator makes sure
    model = bundled.resolve(config.model)
    if config.backend == "ctranslate2":
        from stages.backends.asr_ctranslate2 import load_ctranslate2_whisper

        return load_ctranslate2_whisper(
            model,
            device=config.device,
            partial_interval_ms=config.partial_interval_ms,
            **config.options,
        )
    from stages.backends.asr_whisper import load_whisper

    return load_whisper(
        model,
        device=config.device,
        partial_interval_ms=config.partial_interval_ms,
        **config.options,
    )


def load_words_judge(config: EncoderConfig) -> WordsEndTurn | None:
    """The model that judges at a pause whether the words end the turn, if configured."""
    if config.end_of_turn_words is None:
        return None
    from stages.backends.words_end_turn import load_words_end_turn

    return load_words_end_turn(bundled.resolve(config.end_of_turn_words), config.device)


@dataclass
class Turn:
    """One caller turn. The model loop creates and drops it; its stream is touched only by jobs
    on the session's lane, which skip a dropped turn."""

    turn_id: int
    epoch: int
    stream: RecognizerStream | None = None  # opened by the turn's first job
    dropped: bool = False
    stopped_ns: int = 0  # stamp of the SPEECH_STOPPED record that ends the turn
    # recognizer time after that stamp: the audio still being decoded, then the final decode
    model_after_stop_ns: int = 0
    paused: PausedTurn | None = None  # since a TURN_PAUSED, until the caller goes on
    provisional: bool = False  # over the agent: transcribed only, no speech-in rows
    # speech-in, on the tower's lane: the open window's audio, the records of rows sent so
    # far, and the audio held since a pause (None: not paused)
    window: list[np.ndarray] = field(default_factory=list)
    window_samples: int = 0
    rows_sent: int = 0
    held: list[np.ndarray] | None = None


class EncoderStage(QueuedStage):
    name = "encoder"
    # Its pump does nothing, so taking every waiting record at once gains nothing, and on 2
    # cores it makes the final decode slower: the loop's bursts of hand-offs to the lanes
    # contend for the GIL with their decoding.
    records_a_pump = 1

    def load(self) -> dict[str, Any]:
        t0 = time.monotonic()
        self.recognizer = load_recognizer(self.config.encoder)
        self.words = load_words_judge(self.config.encoder)
        self.tower: BatchedTower | None = None
        speech_in = speech_in_model(self.config.reasoning)
        if speech_in is not None:
            options = self.config.reasoning.speech_in
            assert options is not None
            device = self.config.encoder.device
            on_stream = gpu_stream(
                torch_device(device, "audio tower"), options.stream_priority, "audio tower"
            )
            self.tower = BatchedTower(speech_in.tower(device, options.dtype), on_stream=on_stream)
            logger.info(
                "encoder: speech-in, %s's audio tower on %s (windows of %d ms)",
                speech_in.family,
                self.config.encoder.device,
                self.tower.window_samples * 1000 // CALLER_RATE,
            )
        self.turns: dict[int, Turn] = {}
        self.lanes = SessionLanes(
            self.config.encoder.decode_threads,
            "encoder-decode",
            on_error=lambda s, exc: self.error(
                s, "recognition_failed", f"{type(exc).__name__}: {exc}"
            ),
        )
        # speech-in: the tower's rows on lanes of their own, so that a window's rows (on the
        # reply's path) never wait behind the recognizer's passes (beside it)
        self.tower_lanes = SessionLanes(
            self.config.encoder.decode_threads,
            "encoder-tower",
            on_error=lambda s, exc: self.error(
                s, "audio_tower_failed", f"{type(exc).__name__}: {exc}"
            ),
        )
        logger.info("encoder: %s ready in %.1f s", self.recognizer.name, time.monotonic() - t0)
        return {"backend": self.recognizer.name}

    def close(self) -> None:
        if hasattr(self, "lanes"):
            for session in list(self.turns):
                self._drop(session)
            self.lanes.close(wait=True)
            self.tower_lanes.close(wait=True)
            if self.tower is not None:
                self.tower.close()
        super().close()

    def handle(self, env: Envelope) -> None:
        s, msg = env.session, env.msg
        match msg:
            case SpeechStarted():
                self._open(s, msg.turn_id, env.epoch).provisional = msg.provisional
            case SpeechStopped():
                turn = self.turns.pop(s, None)
                if turn is not None:
                    turn.stopped_ns = env.t_ns
                    if self._speaks_in(turn):
                        self.tower_lanes.submit(s, lambda: self._last_rows(s, turn, env))
                self.lanes.submit(s, lambda: self._finish(s, turn, env))
            case TurnPaused():
                turn = self.turns.get(s)
                if turn is not None and turn.turn_id == msg.turn_id:
                    if self._speaks_in(turn):
                        self.tower_lanes.submit(s, lambda: self._pause_rows(s, turn, msg))
                    self.lanes.submit(s, lambda: self._pause(s, turn, msg))
            case memoryview() | bytes():  # AUDIO_IN
                turn = self.turns.get(s) or self._open(s, -1, env.epoch)
                pcm = np.frombuffer(msg, dtype=np.int16)
                if self._speaks_in(turn):
                    self.tower_lanes.submit(s, lambda: self._tower(s, turn, pcm))
                self.lanes.submit(s, lambda: self._feed(s, turn, pcm))

    def on_stop(self, session: int, stop: Stop) -> None:
        """A cancel (or the session's open or close) drops a turn begun before it (stale audio
        is gone from the ring already; the speech that caused a cancel is in its epoch and
        kept); the caller going on after a pause undoes the pause."""
        turn = self.turns.get(session)
        if turn is not None:
            if stop.ends(turn.epoch):
                self._drop(session)
            elif stop.ends_prepared(turn.turn_id, turn.epoch):
                if self._speaks_in(turn):
                    self.tower_lanes.submit(session, lambda: self._resume_rows(session, turn))
                self.lanes.submit(session, lambda: self._resume(session, turn))
        if stop.cancel is not None:
            self.ack(session, stop.cancel)

    def _open(self, session: int, turn_id: int, epoch: int) -> Turn:
        self._drop(session)
        turn = Turn(turn_id, epoch)
        self.turns[session] = turn
        return turn

    def _drop(self, session: int) -> None:
        turn = self.turns.pop(session, None)
        if turn is not None:
            turn.dropped = True  # its queued jobs skip it; the lane closes its stream
            self.lanes.submit(session, lambda: self._close(turn))

    # -- jobs, on the session's lane -------------------------------------------------------

    def _stream(self, turn: Turn) -> RecognizerStream:
        if turn.stream is None:
            turn.stream = self.recognizer.open_stream()
        return turn.stream

    def _close(self, turn: Turn) -> None:
        if turn.stream is not None:
            stream, turn.stream = turn.stream, None
            stream.close()

    def _feed(self, session: int, turn: Turn, pcm: np.ndarray) -> None:
        if turn.dropped:
            return
        if turn.paused is not None:
            turn.paused.audio.append(pcm)
            return
        t0 = time.monotonic_ns()
        partial = self._stream(turn).feed(pcm)
        self._count_model_time(turn, t0)
        if partial:
            self.send(
                GATEWAY,
                session,
                Transcript(turn.turn_id, partial, final=False),
                epoch=turn.epoch,
            )

    # -- speech-in: the tower's rows, window by window, on the session's tower lane ------------

    def _speaks_in(self, turn: Turn) -> bool:
        return self.tower is not None and not turn.provisional

    def _tower(self, session: int, turn: Turn, pcm: np.ndarray) -> None:
        if turn.dropped:
            return
        if turn.held is not None:  # paused: the rows at the pause stand until it goes on
            turn.held.append(pcm)
            return
        self._windows(session, turn, pcm)

    def _pause_rows(self, session: int, turn: Turn, paused: TurnPaused) -> None:
        """At a pause: the turn's rows so far (the open window's), for the reply made on them."""
        if turn.dropped or turn.held is not None:
            return
        turn.held = []
        rows = self._open_rows(turn)
        create = paused.create_response
        self._send_rows(session, turn, rows, final=True, speculative=True, create_response=create)

    def _resume_rows(self, session: int, turn: Turn) -> None:
        if turn.dropped or turn.held is None:
            return
        held, turn.held = turn.held, None
        for pcm in held:
            self._windows(session, turn, pcm)

    def _last_rows(self, session: int, turn: Turn, env: Envelope) -> None:
        """The turn's end: its last rows (none if nothing was said since the pause: the rows
        at the pause are the turn's), before the transcript, which the reply does not wait for."""
        msg = env.msg
        assert isinstance(msg, SpeechStopped)
        if turn.dropped:
            return
        as_paused = turn.held is not None
        rows = None if as_paused else self._open_rows(turn)
        self._send_rows(
            session,
            turn,
            rows,
            final=True,
            create_response=msg.create_response and not msg.provisional,
            as_paused=as_paused,
            stopped_ns=env.t_ns,
        )

    def _windows(self, session: int, turn: Turn, pcm: np.ndarray) -> None:
        """Take caller audio into the open window; send each window's rows once complete."""
        assert self.tower is not None
        size = self.tower.window_samples
        turn.window.append(pcm)
        turn.window_samples += len(pcm)
        while turn.window_samples >= size:
            audio = np.concatenate(turn.window)
            turn.window = [audio[size:]] if len(audio) > size else []
            turn.window_samples = len(audio) - size
            self._send_rows(session, turn, self.tower.rows(audio[:size]))

    def _open_rows(self, turn: Turn) -> np.ndarray | None:
        """The rows of the open window's audio so far (None: it holds none)."""
        assert self.tower is not None
        if not turn.window_samples:
            return None
        return self.tower.rows(np.concatenate(turn.window))

    def _send_rows(
        self,
        session: int,
        turn: Turn,
        rows: np.ndarray | None,
        *,
        final: bool = False,
        speculative: bool = False,
        create_response: bool = True,
        as_paused: bool = False,
        stopped_ns: int = 0,
    ) -> None:
        assert self.tower is not None
        count = 0 if rows is None else len(rows)
        record = AudioEmbeddings(
            turn.turn_id,
            turn.rows_sent,
            count,
            self.tower.dim,
            self.tower.dtype,
            b"" if rows is None else rows.tobytes(),
            final=final,
            speculative=speculative,
            create_response=create_response,
            as_paused=as_paused,
            speech_stopped_ns=stopped_ns,
        )
        self.send("reasoning", session, record, epoch=turn.epoch)
        if not speculative:  # a pause's rows are the open window's, sent again as it goes on
            turn.rows_sent += 1

    @staticmethod
    def _count_model_time(turn: Turn, started_ns: int) -> None:
        """Add the part of a recognizer call since `started_ns` that came after the turn's
        end (model time on the path to the reply; the rest was hidden while the caller spoke)."""
        if turn.stopped_ns:
            turn.model_after_stop_ns += max(
                0, time.monotonic_ns() - max(started_ns, turn.stopped_ns)
            )

    def _pause(self, session: int, turn: Turn, paused: TurnPaused) -> None:
        """At a pause: transcribe the turn so far and let reasoning start on it."""
        if turn.dropped or turn.paused is not None:
            return
        peek = getattr(self._stream(turn), "peek", None)
        if peek is None:  # this backend cannot transcribe a turn that goes on: no words to weigh
            unjudged = Transcript(turn.turn_id, "", final=True, speculative=True)
            self.send(GATEWAY, session, unjudged, epoch=turn.epoch)
            return
        t0 = time.monotonic_ns()
        turn.paused = PausedTurn(peek(paused.silence_to_come_ms * CALLER_RATE // 1000))
        self._count_model_time(turn, t0)  # a turn that ended meanwhile waits for it
        early = Transcript(
            turn.turn_id,
            turn.paused.text,
            final=True,
            create_response=paused.create_response,
            speculative=True,
        )
        if not self._speaks_in(turn):  # under speech-in, the reply is made on the rows
            self.send("reasoning", session, early, epoch=turn.epoch)
        # semantic_vad weighs the words with the sound; the gateway waits for this answer
        finished = self.words.probability(early.text) if self.words is not None else None
        judged = msgspec.structs.replace(early, finished=-1.0 if finished is None else finished)
        self.send(GATEWAY, session, judged, epoch=turn.epoch)

    def _resume(self, session: int, turn: Turn) -> None:
        """The caller went on: reasoning drops its early start, the held audio is decoded."""
        if turn.dropped or turn.paused is None:
            return
        paused, turn.paused = turn.paused, None
        self.send("reasoning", session, TurnResumed(turn.turn_id), epoch=turn.epoch)
        for pcm in paused.audio:
            self._feed(session, turn, pcm)

    def _finish(self, session: int, turn: Turn | None, env: Envelope) -> None:
        msg = env.msg
        assert isinstance(msg, SpeechStopped)
        text, decode_ns = "", 0
        if turn is not None:
            try:
                if turn.paused is not None:  # nothing said since: the one at the pause it is
                    text = "" if turn.dropped else turn.paused.text
                elif not turn.dropped:
                    t0 = time.monotonic_ns()
                    text = self._stream(turn).finish()
                    self._count_model_time(turn, t0)
                decode_ns = turn.model_after_stop_ns
            finally:
                self._close(turn)
        final = Transcript(
            msg.turn_id,
            text,
            final=True,
            create_response=msg.create_response,
            speech_stopped_ns=env.t_ns,
            decode_ns=decode_ns,
        )
        self.send(GATEWAY, session, final, epoch=env.epoch)
        if not msg.provisional:  # the gateway decides what a provisional turn was
            self.send("reasoning", session, final, epoch=env.epoch)
