"""The caller's side of a session: audio in 20 ms frames through the VAD, speech to the encoder
in 200 ms chunks, turns begun and committed, and their transcripts.

It tells the stages about turns (down the link) and the client (its outbox); what a turn
means for the agent's reply (a barge-in, a reply asked for) it leaves to the session, through
a `TurnListener`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from gateway import events as ev
from gateway.chunker import Chunker
from gateway.conversation import Conversation, Item
from gateway.metrics import GatewayMetrics
from gateway.protocol import ProtocolError, SessionConfig
from gateway.resample import CALLER_RATE
from gateway.session.outbox import Outbox
from gateway.vad import SpeechPaused, SpeechResumed, SpeechStarted, SpeechStopped, TurnDetector
from stages.link import PipelineLink

FRAME_SAMPLES_16K = 320  # 20 ms at 16 kHz
MANUAL_BUFFER_S = 120  # audio held for a manual commit, at most
CHUNK_SAMPLES = 3200  # 200 ms at 16 kHz, what a commit sends at a time


class TurnListener(Protocol):
    """What the session does about the caller's turns."""

    def speech_onset(self) -> None:
        """The VAD heard the caller start, before their turn begins (so that a barge-in's
        cancel goes first: it would purge the new turn's speech)."""

    def turn_ended(self, create_response: bool) -> None:
        """The caller's turn ended; the stages answer it when `create_response`."""

    def transcribed(self, turn_id: int, text: str) -> None:
        """A turn's final transcript came (empty: nothing was said)."""

    def maybe_speaking(self, unsure: bool) -> None:
        """After each frame: whether the caller has started a voiced run that the VAD has
        not yet called speech."""


class CallerTurns:
    """One session's caller audio and turns. `pause_ms`: silence inside a turn after which the
    stages start on the reply (gateway.prepare_reply_ms; 0: off)."""

    def __init__(
        self,
        link: PipelineLink,
        session: int,
        config: SessionConfig,
        outbox: Outbox,
        items: Conversation,
        listener: TurnListener,
        metrics: GatewayMetrics,
        pause_ms: int = 0,
    ) -> None:
        self.link, self.session, self.config = link, session, config
        self.outbox, self.items, self.listener, self.metrics = outbox, items, listener, metrics
        td = config.turn_detection
        self.vad = (
            TurnDetector(
                td.threshold, td.prefix_padding_ms, td.silence_duration_ms, pause_ms=pause_ms
            )
            if td
            else TurnDetector(pause_ms=pause_ms)
        )
        self.chunker = Chunker()
        self.turn_id = 0
        self.turn_items: dict[int, str] = {}  # turn id -> its user item
        self.transcribing: set[int] = set()  # turns ended whose final transcript is to come
        self._partials: dict[int, str] = {}  # turn id -> the partial transcript sent so far
        self.speech_stopped_ns = 0  # when the last turn's end went to the stages (0: taken)
        self.frames = 0
        self.manual_audio: list[np.ndarray] = []
        self.manual_samples = 0
        self._partial_frame = np.zeros(0, np.int16)

    @property
    def create_response(self) -> bool:
        td = self.config.turn_detection
        return td is not None and td.create_response

    # -- audio ---------------------------------------------------------------------------------

    def feed(self, pcm16k: np.ndarray) -> None:
        """Caller audio, PCM16 mono 16 kHz, in pieces of any length."""
        if len(self._partial_frame):
            pcm16k = np.concatenate([self._partial_frame, pcm16k])
        whole = len(pcm16k) - len(pcm16k) % FRAME_SAMPLES_16K
        self._partial_frame = pcm16k[whole:].copy()
        for start in range(0, whole, FRAME_SAMPLES_16K):
            self._frame(pcm16k[start : start + FRAME_SAMPLES_16K])

    def _frame(self, frame: np.ndarray) -> None:
        self.frames += 1
        if self.config.turn_detection is None:
            if self.manual_samples < MANUAL_BUFFER_S * CALLER_RATE:
                self.manual_audio.append(frame)
                self.manual_samples += len(frame)
            return
        for vad_event in self.vad.feed(frame):
            if isinstance(vad_event, SpeechStarted):
                self.speech_started(vad_event)
            elif isinstance(vad_event, SpeechStopped):
                self.end(vad_event.audio_end_ms, self.create_response)
                return
            elif isinstance(vad_event, SpeechPaused):
                # the encoder transcribes what it has: everything the caller said, up to now
                if (rest := self.chunker.flush()) is not None:
                    self.link.send_audio(self.session, rest)
                self.link.turn_paused(self.session, self.turn_id, self.create_response)
            elif isinstance(vad_event, SpeechResumed):
                self.link.turn_resumed(self.session, self.turn_id)
        self.listener.maybe_speaking(not self.vad.in_speech and self.vad.voiced_run > 0)
        if self.vad.in_speech:
            for chunk in self.chunker.push(frame):
                self.link.send_audio(self.session, chunk)

    # -- turns ---------------------------------------------------------------------------------

    def speech_started(self, started: SpeechStarted) -> None:
        self.metrics.vad_events.labels("speech_started").inc()
        self.listener.speech_onset()
        self.begin(started.audio_start_ms)
        for chunk in self.chunker.push(started.prefix):
            self.link.send_audio(self.session, chunk)
        self.outbox.speech_started(started.audio_start_ms, self.turn_items[self.turn_id])

    def begin(self, audio_start_ms: int) -> None:
        """A new turn: the stages are told, and its user item named."""
        self.turn_id += 1
        self.turn_items[self.turn_id] = ev.new_id("item")
        self.link.speech_started(self.session, self.turn_id, audio_start_ms)
        self.chunker.reset()

    def end(self, audio_end_ms: int, create_response: bool) -> None:
        """The turn ends: its last audio and its end go to the stages, its item is committed."""
        self.metrics.vad_events.labels("speech_stopped").inc()
        rest = self.chunker.flush()
        if rest is not None:
            self.link.send_audio(self.session, rest)
        self.speech_stopped_ns = self.link.speech_stopped(
            self.session, self.turn_id, audio_end_ms, create_response
        )
        self.listener.turn_ended(create_response)
        item_id = self.turn_items[self.turn_id]
        if self.config.turn_detection is not None:
            self.outbox.speech_stopped(audio_end_ms, item_id)
        self.transcribing.add(self.turn_id)
        item = Item(item_id, "user", [{"type": "input_audio", "transcript": None}], "completed")
        previous = self.items.add(item)
        self.outbox.committed(item_id, previous)
        self.outbox.item_added(item, previous)

    def take_speech_stopped_ns(self) -> int:
        """When the last turn's end went to the stages, once (0 after): for its first audio."""
        stopped, self.speech_stopped_ns = self.speech_stopped_ns, 0
        return stopped

    def commit(self) -> None:
        """input_audio_buffer.commit: the buffered audio is a user turn."""
        if self.config.turn_detection is not None:
            if not self.vad.in_speech:
                raise ProtocolError(
                    "the input audio buffer is empty: server_vad commits turns by itself",
                    code="input_audio_buffer_commit_empty",
                )
            end_ms = self.vad.audio_ms
            self.vad.reset()
            self.end(end_ms, self.create_response)
            return
        if self.manual_samples < CALLER_RATE // 10:
            raise ProtocolError(
                f"the input audio buffer holds {self.manual_samples / 16:.0f} ms of audio; "
                "a commit needs at least 100 ms",
                code="input_audio_buffer_commit_empty",
            )
        audio = np.concatenate(self.manual_audio)
        self.manual_audio, self.manual_samples = [], 0
        self.begin(0)
        for start in range(0, len(audio), CHUNK_SAMPLES):
            self.link.send_audio(self.session, audio[start : start + CHUNK_SAMPLES])
        self.end(len(audio) // 16, False)

    def clear(self) -> None:
        """input_audio_buffer.clear."""
        self.manual_audio, self.manual_samples = [], 0
        self._partial_frame = np.zeros(0, np.int16)
        self.vad.reset()
        self.chunker.reset()
        self.outbox.buffer_cleared()

    def reconfigure(self, had_vad: bool) -> None:
        """session.update changed the turn detection (`had_vad`: whether it was on before)."""
        td = self.config.turn_detection
        if td is not None:
            self.vad.update(
                threshold=td.threshold,
                prefix_padding_ms=td.prefix_padding_ms,
                silence_duration_ms=td.silence_duration_ms,
            )
        if had_vad != (td is not None):
            self.vad.reset()
            self.manual_audio, self.manual_samples = [], 0

    # -- transcripts ---------------------------------------------------------------------------

    def transcript(self, turn_id: int, text: str, final: bool) -> None:
        item_id = self.turn_items.get(turn_id)
        if item_id is None:
            return
        if not final:
            # The encoder sends its whole current guess; Realtime deltas are additions. Send
            # what the guess added; a guess that revises earlier words waits for `completed`.
            said = self._partials.get(turn_id, "")
            if text.startswith(said) and len(text) > len(said):
                self._partials[turn_id] = text
                self._transcription("delta", item_id, delta=text[len(said) :])
            return
        self._partials.pop(turn_id, None)
        self._transcription("completed", item_id, transcript=text)
        self.transcribing.discard(turn_id)
        if item_id in self.items:
            item = self.items.get(item_id)
            item.content[0]["transcript"] = text
            self.outbox.item_done(item)
        self.listener.transcribed(turn_id, text)

    def _transcription(self, name: str, item_id: str, **fields: str) -> None:
        if self.config.transcription is not None:
            self.outbox.transcription(name, item_id, **fields)
