"""The caller's side of a session: audio in 20 ms frames through the VAD, speech to the encoder
in 200 ms chunks, turns begun and committed, and their transcripts.

It tells the stages about turns (down the link) and the client (its outbox); what a turn
means for the agent's reply (a barge-in, a reply asked for) it leaves to the session, through
a `TurnListener`.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Protocol

import numpy as np

from gateway import events as ev
from gateway.chunker import Chunker
from gateway.config import TurnsConfig
from gateway.conversation import Conversation, Item
from gateway.metrics import GatewayMetrics
from gateway.protocol import ProtocolError, SessionConfig, TurnDetection
from gateway.session.outbox import Outbox
from gateway.session.spans import NO_SPANS, Spans
from gateway.turns.detector import TurnDetector, VadPause, VadResume, VadStart, VadStop
from gateway.turns.end_of_turn import Decision, EndOfTurnJudge, Spawn
from stages.link import PipelineLink
from stages.messages import CALLER_RATE, CHUNK_SAMPLES, FRAME_MS, FRAME_SAMPLES

if TYPE_CHECKING:
    from gateway.turns.models import TurnModels

MANUAL_BUFFER_S = 120  # audio held for a manual commit, at most
TURN_AUDIO_FRAMES = 12 * 1000 // FRAME_MS  # a turn's audio kept: the end-of-turn model reads
# the last 8 s, a provisional turn is replayed from its start once it interrupts (confirm_ms
# of voice, at most 5 s)


class TurnListener(Protocol):
    """What the session does about the caller's turns."""

    def speech_onset(self) -> bool:
        """The VAD heard the caller start, before their turn begins (so that a barge-in's
        cancel goes first: it would purge the new turn's speech). True: the turn is
        provisional (gateway.turns.interruption)."""

    def turn_ended(self, create_response: bool) -> None:
        """The caller's turn ended; the stages answer it when `create_response`."""

    def transcribed(self, turn_id: int, text: str) -> None:
        """A turn's final transcript came (empty: nothing was said); a provisional turn's
        before anything of it is committed."""

    def voiced(self, turn_id: int, voiced_ms: int) -> None:
        """The provisional turn `turn_id` has been voiced this long (after each voiced frame)."""

    def maybe_speaking(self, unsure: bool) -> None:
        """After each frame: whether the caller has started a voiced run that the VAD has
        not yet called speech."""


class CallerTurns:
    """One session's caller audio and turns, as the gateway.turns section sets them. `models`:
    the process's classifier and end-of-turn model (webrtcvad and no semantic_vad without),
    the latter asked through a judge of this session's, running its questions with `spawn`;
    `spans`: the session's trace (gateway.session.spans)."""

    def __init__(
        self,
        link: PipelineLink,
        session: int,
        config: SessionConfig,
        outbox: Outbox,
        items: Conversation,
        listener: TurnListener,
        metrics: GatewayMetrics,
        turns: TurnsConfig,
        *,
        models: TurnModels | None = None,
        spawn: Spawn | None = None,
        spans: Spans = NO_SPANS,
    ) -> None:
        self.link, self.session, self.config = link, session, config
        self.outbox, self.items, self.listener, self.metrics = outbox, items, listener, metrics
        self.spans = spans
        td = config.turn_detection or TurnDetection()
        classifier = models.classifier(td.threshold) if models is not None else None
        sound = models.end_of_turn if models is not None else None
        # its own limit is the silence window, for semantic_vad too: the judge's decision at a
        # pause ends the turn sooner or holds it longer, and one that has not come by the
        # window (a sound model queued behind other calls) never makes the caller wait more
        self.detector = TurnDetector(
            td.threshold,
            td.prefix_padding_ms,
            td.silence_duration_ms,
            pause_ms=turns.prepare_reply_ms,
            classifier=classifier,
        )
        self.judge: EndOfTurnJudge | None = None
        if sound is not None and spawn is not None:
            asked = turns.end_of_turn
            self.judge = EndOfTurnJudge(
                self.detector,
                sound,
                lambda: self.config.turn_detection,
                metrics,
                spawn,
                self._decided,
                ask_after_ms=asked.ask_after_ms,
                sure=asked.sure,
            )
        self.chunker = Chunker()
        self.turn_id = 0
        self.turn_items: dict[int, str] = {}  # turn id -> its user item
        self.transcribing: set[int] = set()  # turns ended whose final transcript is to come
        self.provisional: set[int] = set()  # turns begun over the agent, not yet settled
        self.voiced_ms_of: dict[int, int] = {}  # a provisional turn's voiced time, once ended
        self._partials: dict[int, str] = {}  # turn id -> the partial transcript sent so far
        self.speech_stopped_ns = 0  # when the last turn's end went to the stages (0: taken)
        self.frames = 0
        self.manual_audio: list[np.ndarray] = []
        self.manual_samples = 0
        self._partial_frame = np.zeros(0, np.int16)
        self.turn_audio: collections.deque[np.ndarray] = collections.deque(maxlen=TURN_AUDIO_FRAMES)
        self.turn_audio_start_ms = 0
        self._voiced_ms = 0  # voiced time in the turn in progress

    @property
    def create_response(self) -> bool:
        td = self.config.turn_detection
        return td is not None and td.create_response

    # -- audio ---------------------------------------------------------------------------------

    def feed(self, pcm16k: np.ndarray) -> None:
        """Caller audio, PCM16 mono 16 kHz, in pieces of any length."""
        if len(self._partial_frame):
            pcm16k = np.concatenate([self._partial_frame, pcm16k])
        whole = len(pcm16k) - len(pcm16k) % FRAME_SAMPLES
        self._partial_frame = pcm16k[whole:].copy()
        for start in range(0, whole, FRAME_SAMPLES):
            self._frame(pcm16k[start : start + FRAME_SAMPLES])

    def _frame(self, frame: np.ndarray) -> None:
        self.frames += 1
        if self.config.turn_detection is None:
            if self.manual_samples < MANUAL_BUFFER_S * CALLER_RATE:
                self.manual_audio.append(frame)
                self.manual_samples += len(frame)
            return
        detector = self.detector
        for vad_event in detector.feed(frame):
            if isinstance(vad_event, VadStart):
                self.speech_started(vad_event)
            elif isinstance(vad_event, VadStop):
                self.end(vad_event.audio_end_ms, self.create_response)
                return
            elif isinstance(vad_event, VadPause):
                if self.turn_id in self.provisional:
                    continue  # nothing is prepared for a turn that may not count
                # the encoder transcribes what it has: everything the caller said, up to now
                if (rest := self.chunker.flush()) is not None:
                    self.link.send_audio(self.session, rest)
                self.link.turn_paused(
                    self.session,
                    self.turn_id,
                    self.create_response,
                    vad_event.silence_to_come_ms,
                )
                if self.judge is not None:  # semantic_vad weighs the words at this pause
                    self.judge.expect_words(vad_event.speech_end_ms)
            elif isinstance(vad_event, VadResume):
                self.link.turn_resumed(self.session, self.turn_id)
        self.listener.maybe_speaking(not detector.in_speech and detector.voiced_run > 0)
        if not detector.in_speech:
            return
        self.turn_audio.append(frame)
        for chunk in self.chunker.push(frame):
            self.link.send_audio(self.session, chunk)
        provisional = self.turn_id in self.provisional
        if detector.voiced_run:
            self._voiced_ms += FRAME_MS
            if provisional:
                self.listener.voiced(self.turn_id, self._voiced_ms)
        if self.judge is not None and not provisional:
            self.judge.listen(self.turn_audio)

    def _decided(self, decision: Decision, wait_ms: int) -> None:
        """semantic_vad's judge decided the pause the caller is in."""
        if decision == "ended":
            stopped = self.detector.end_turn()
            assert stopped is not None
            self.end(stopped.audio_end_ms, self.create_response)
        else:  # window, or held: the caller gets up to wait_ms of silence
            self.detector.limit_pause(wait_ms)

    def words_judged(self, turn_id: int, finished: float) -> None:
        """The encoder's judgement of the words at a pause (speculative transcripts)."""
        if self.judge is not None:
            self.judge.words_judged(turn_id, finished)

    # -- turns ---------------------------------------------------------------------------------

    def speech_started(self, started: VadStart) -> None:
        self.metrics.vad_events.labels("speech_started").inc()
        with self.outbox.holding() as cut:  # what a barge-in does to the reply, told after
            provisional = self.listener.speech_onset()
        try:
            self.begin(started.audio_start_ms, provisional=provisional)
            if provisional:
                self.provisional.add(self.turn_id)
            self.turn_audio.append(started.prefix)
            for chunk in self.chunker.push(started.prefix):
                self.link.send_audio(self.session, chunk)
            self.outbox.speech_started(started.audio_start_ms, self.turn_items[self.turn_id])
        finally:
            self.outbox.send_all(cut)

    def begin(
        self, audio_start_ms: int, item_id: str | None = None, provisional: bool = False
    ) -> None:
        """A new turn: the stages are told, and its user item named."""
        self.turn_id += 1
        self.turn_items[self.turn_id] = item_id or ev.new_id("item")
        self.spans.turn_begun(self.turn_id)
        self.link.speech_started(self.session, self.turn_id, audio_start_ms, provisional)
        self.chunker.reset()
        self.turn_audio.clear()
        self.turn_audio_start_ms = audio_start_ms
        self._voiced_ms = 0
        if self.judge is not None:
            self.judge.turn_began(self.turn_id)

    def begin_again(self) -> None:
        """The provisional turn in progress interrupts after all, and a cancel has purged it
        in the stages: begun again as an ordinary turn with the same item, its audio so far
        replayed to the encoder."""
        provisional = self.turn_id
        self.provisional.discard(provisional)
        audio, voiced = list(self.turn_audio), self._voiced_ms
        self.begin(self.turn_audio_start_ms, self.turn_items.pop(provisional))
        self._voiced_ms = voiced
        for frame in audio:
            self.turn_audio.append(frame)
            for chunk in self.chunker.push(frame):
                self.link.send_audio(self.session, chunk)

    def end(self, audio_end_ms: int, create_response: bool) -> None:
        """The turn ends: its last audio and its end go to the stages, its item is committed
        (a provisional turn's once its transcript says it counts)."""
        self.metrics.vad_events.labels("speech_stopped").inc()
        rest = self.chunker.flush()
        if rest is not None:
            self.link.send_audio(self.session, rest)
        provisional = self.turn_id in self.provisional
        if provisional:
            self.voiced_ms_of[self.turn_id] = self._voiced_ms
        self.speech_stopped_ns = self.link.speech_stopped(
            self.session,
            self.turn_id,
            audio_end_ms,
            create_response and not provisional,
            provisional=provisional,
        )
        silence_ms = max(0, audio_end_ms - self.detector.speech_end_ms)
        asks = create_response and not provisional
        self.spans.turn_ended(self.turn_id, self.speech_stopped_ns, silence_ms, asks)
        if not provisional:
            self.listener.turn_ended(create_response)
        item_id = self.turn_items[self.turn_id]
        if (td := self.config.turn_detection) is not None:
            self.outbox.speech_stopped(audio_end_ms, item_id)
            silence_s = max(0, audio_end_ms - self.detector.speech_end_ms) / 1000
            self.metrics.turn_end_silence.labels(td.type).observe(silence_s)
        self.transcribing.add(self.turn_id)
        if not provisional:
            self.commit_item(item_id)

    def commit_item(self, item_id: str, transcript: str | None = None) -> Item:
        """A user audio item into the conversation, announced as committed."""
        item = Item(
            item_id, "user", [{"type": "input_audio", "transcript": transcript}], "completed"
        )
        previous = self.items.add(item)
        self.outbox.committed(item_id, previous)
        self.outbox.item_added(item, previous)
        return item

    def take_speech_stopped_ns(self) -> int:
        """When the last turn's end went to the stages, once (0 after): for its first audio."""
        stopped, self.speech_stopped_ns = self.speech_stopped_ns, 0
        return stopped

    def commit(self) -> None:
        """input_audio_buffer.commit: the buffered audio is a user turn."""
        if self.config.turn_detection is not None:
            if not self.detector.in_speech:
                raise ProtocolError(
                    "the input audio buffer is empty: server_vad commits turns by itself",
                    code="input_audio_buffer_commit_empty",
                )
            end_ms = self.detector.audio_ms
            self.detector.reset()
            self.end(end_ms, self.create_response)
            return
        if self.manual_samples < CALLER_RATE // 10:
            held_ms = self.manual_samples * 1000 / CALLER_RATE
            raise ProtocolError(
                f"the input audio buffer holds {held_ms:.0f} ms of audio; "
                "a commit needs at least 100 ms",
                code="input_audio_buffer_commit_empty",
            )
        audio = np.concatenate(self.manual_audio)
        self.manual_audio, self.manual_samples = [], 0
        self.begin(0)
        for start in range(0, len(audio), CHUNK_SAMPLES):
            self.link.send_audio(self.session, audio[start : start + CHUNK_SAMPLES])
        self.end(len(audio) * 1000 // CALLER_RATE, False)

    def clear(self) -> None:
        """input_audio_buffer.clear."""
        self.manual_audio, self.manual_samples = [], 0
        self._partial_frame = np.zeros(0, np.int16)
        self.detector.reset()
        self.chunker.reset()
        self.outbox.buffer_cleared()

    def reconfigure(self, had_vad: bool) -> None:
        """session.update changed the turn detection (`had_vad`: whether it was on before)."""
        td = self.config.turn_detection
        if td is not None:
            self.detector.update(
                threshold=td.threshold,
                prefix_padding_ms=td.prefix_padding_ms,
                silence_duration_ms=td.silence_duration_ms,
            )
        if had_vad != (td is not None):
            self.detector.reset()
            self.manual_audio, self.manual_samples = [], 0

    # -- transcripts ---------------------------------------------------------------------------

    def transcript(self, turn_id: int, text: str, final: bool) -> None:
        item_id = self.turn_items.get(turn_id)
        if item_id is None:
            return
        if turn_id in self.provisional:
            if final:  # the session settles it (`settle`)
                self.transcribing.discard(turn_id)
                self.listener.transcribed(turn_id, text)
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

    def lost_transcripts(self) -> None:
        """The encoder was restarted: the turns it was transcribing end as heard empty."""
        for turn_id in sorted(self.transcribing):
            self.transcript(turn_id, "", final=True)

    def _transcription(self, name: str, item_id: str, **fields: str) -> None:
        if self.config.transcription is not None:
            self.outbox.transcription(name, item_id, **fields)

    def settle(self, turn_id: int, text: str, counts: bool) -> str | None:
        """A provisional turn's transcript is in: committed with it if it counts, else
        forgotten (nothing of it was committed). Its item's id."""
        self.provisional.discard(turn_id)
        self.voiced_ms_of.pop(turn_id, None)
        item_id = self.turn_items.pop(turn_id, None)
        if item_id is not None and counts:
            item = self.commit_item(item_id, text)
            self._transcription("completed", item_id, transcript=text)
            self.outbox.item_done(item)
        return item_id
