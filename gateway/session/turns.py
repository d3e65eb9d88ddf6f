"""The caller's side of a session: audio in 20 ms frames through the VAD, speech to the encoder
in 200 ms chunks, turns begun and committed, and their transcripts.

It tells the stages about turns (down the link) and the client (its outbox); what a turn
means for the agent's reply (a barge-in, a reply asked for) it leaves to the session, through
a `TurnListener`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, ClassVar, Protocol

import numpy as np

from gateway import events as ev
from gateway.chunker import Chunker
from gateway.conversation import Conversation, Item
from gateway.end_of_turn import WINDOW_SAMPLES, EndOfTurn
from gateway.metrics import GatewayMetrics
from gateway.protocol import ProtocolError, SessionConfig, TurnDetection
from gateway.resample import CALLER_RATE
from gateway.session.outbox import Outbox
from gateway.session.spans import NO_SPANS, Spans
from gateway.vad import (
    FRAME_MS,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    SpeechStopped,
    TurnDetector,
    Voice,
)
from stages.link import PipelineLink

logger = logging.getLogger(__name__)

FRAME_SAMPLES_16K = 320  # 20 ms at 16 kHz
MANUAL_BUFFER_S = 120  # audio held for a manual commit, at most
CHUNK_SAMPLES = 3200  # 200 ms at 16 kHz, what a commit sends at a time
TURN_AUDIO_FRAMES = 12 * 1000 // FRAME_MS  # a turn's audio kept: the end-of-turn model reads
# the last 8 s, a provisional turn is replayed from its start once it interrupts (confirm_ms
# of voice, at most 5 s)


WORDS_CUT_OFF = 0.05  # the encoder's words model below this: the sentence stops mid-way
WORDS_FINISHED = 0.2  # from this, the words end a sentence (stages.backends.words_end_turn)


class Eagerness:
    """semantic_vad: the end-of-turn probability from which a pause ends the turn at once
    (`complete`), below which the turn sounds cut off and may wait `max_wait_ms` of silence,
    and between the two, the silence window. The maximum waits are OpenAI's."""

    LEVELS: ClassVar[dict[str, tuple[float, float, int]]] = {
        "low": (0.9, 0.3, 8000),
        "medium": (0.7, 0.2, 4000),
        "high": (0.5, 0.1, 2000),
    }

    def __init__(self, eagerness: str) -> None:
        level = "medium" if eagerness == "auto" else eagerness
        self.complete, self.unsure, self.max_wait_ms = self.LEVELS[level]


def decide(sound: float | None, words: float | None, words_late: bool, eagerness: Eagerness) -> str:
    """semantic_vad's decision at a pause, from the probability that the turn sounds complete
    (`sound`; None: not asked, the words having decided) and that its words end a sentence
    (`words`; None: not judged, or `words_late`): "ended" (the turn ends now), "window" (it
    ends after the silence window unless the caller speaks) or "held" (it waits for the caller
    up to the eagerness's maximum).

    The words are the surer signal: a cut-off half ("How many legs") scores near 0 and a whole
    question from 0.2, where the sound model calls cut-off halves finished and some finished
    questions in synthetic voices cut off. So words that end a sentence end the turn, and
    words that stop mid-sentence never end it before the window. A turn is held past the
    window only when it sounds cut off and nothing says otherwise: words that were asked for
    and came late leave it to the window, since a wrong hold costs the caller seconds."""
    if words is not None and words >= WORDS_FINISHED:
        return "ended"
    if sound is None:
        raise ValueError("without words that end a sentence, the sound decides: it is needed")
    if words is not None and words < WORDS_CUT_OFF:
        return "window" if sound >= eagerness.unsure else "held"
    if sound >= eagerness.complete:
        return "ended"
    if sound >= eagerness.unsure or words is not None or words_late:
        return "window"
    return "held"


class TurnListener(Protocol):
    """What the session does about the caller's turns."""

    def speech_onset(self) -> bool:
        """The VAD heard the caller start, before their turn begins (so that a barge-in's
        cancel goes first: it would purge the new turn's speech). True: the turn is
        provisional (gateway.session.interruption)."""

    def turn_ended(self, create_response: bool) -> None:
        """The caller's turn ended; the stages answer it when `create_response`."""

    def transcribed(self, turn_id: int, text: str) -> None:
        """A turn's final transcript came (empty: nothing was said); a provisional turn's
        before anything of it is committed."""

    def spoke_on(self, turn_id: int) -> None:
        """The provisional turn `turn_id` has gone on for the confirming time."""

    def maybe_speaking(self, unsure: bool) -> None:
        """After each frame: whether the caller has started a voiced run that the VAD has
        not yet called speech."""


class CallerTurns:
    """One session's caller audio and turns. `pause_ms`: silence inside a turn after which the
    stages start on the reply (gateway.prepare_reply_ms; 0: off). `end_of_turn`: the model
    semantic_vad asks, after `end_of_turn_pause_ms` of silence; from `end_of_turn_sure` its
    answer does not wait for the words; `spawn` runs its question as one of the session's
    tasks. `confirm_ms`: voiced time that makes a provisional turn
    an interruption. `spans`: the session's trace (gateway.session.spans)."""

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
        *,
        voice: Voice | None = None,
        end_of_turn: EndOfTurn | None = None,
        end_of_turn_pause_ms: int = 200,
        end_of_turn_sure: float = 0.95,
        spawn: Callable[[Coroutine[Any, Any, None], str], Any] | None = None,
        confirm_ms: int = 1000,
        spans: Spans = NO_SPANS,
    ) -> None:
        self.link, self.session, self.config = link, session, config
        self.outbox, self.items, self.listener, self.metrics = outbox, items, listener, metrics
        self.end_of_turn, self.end_of_turn_pause_ms = end_of_turn, end_of_turn_pause_ms
        self.end_of_turn_sure = end_of_turn_sure
        self.spawn, self.confirm_ms, self.spans = spawn, confirm_ms, spans
        td = config.turn_detection or TurnDetection()
        self.vad = TurnDetector(
            td.threshold,
            td.prefix_padding_ms,
            self._silence_limit_ms(td),
            pause_ms=pause_ms,
            voice=voice,
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
        self._asked_at = -1  # the pause (its speech end) the end-of-turn model was asked about
        # semantic_vad: the encoder's judgement of the words at each pause sent to it, keyed by
        # (turn, the pause's speech end); the encoder answers TURN_PAUSEDs in order
        self._words: dict[tuple[int, int], asyncio.Future[float | None]] = {}
        self._words_asked: collections.deque[tuple[int, int]] = collections.deque(maxlen=16)

    @staticmethod
    def _silence_limit_ms(td: TurnDetection) -> int:
        """The VAD's own limit: the silence window, for semantic_vad too. Its decision at a
        pause ends the turn sooner or holds it longer; a decision that has not come by the
        window (a sound model queued behind other calls) never makes the caller wait more."""
        return td.silence_duration_ms

    @property
    def semantic(self) -> bool:
        td = self.config.turn_detection
        return td is not None and td.semantic and self.end_of_turn is not None

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
                if self.turn_id in self.provisional:
                    continue  # nothing is prepared for a turn that may not count
                # the encoder transcribes what it has: everything the caller said, up to now
                if (rest := self.chunker.flush()) is not None:
                    self.link.send_audio(self.session, rest)
                self.link.turn_paused(self.session, self.turn_id, self.create_response)
                self._expect_words(vad_event.speech_end_ms)
            elif isinstance(vad_event, SpeechResumed):
                self.link.turn_resumed(self.session, self.turn_id)
        self.listener.maybe_speaking(not self.vad.in_speech and self.vad.voiced_run > 0)
        if not self.vad.in_speech:
            return
        self.turn_audio.append(frame)
        for chunk in self.chunker.push(frame):
            self.link.send_audio(self.session, chunk)
        if self.vad.voiced_run:
            self._voiced_ms += FRAME_MS
            if self.turn_id in self.provisional and self._voiced_ms >= self.confirm_ms:
                self.listener.spoke_on(self.turn_id)
        if (
            self.semantic
            and self.vad.silence_ms >= self.end_of_turn_pause_ms
            and not self.vad.voiced_run  # a voice onset may be the caller going on
        ):
            self._ask_end_of_turn()

    # -- semantic_vad --------------------------------------------------------------------------

    def _ask_end_of_turn(self) -> None:
        """Once a pause: does the turn so far sound finished? Answered off the loop.

        Not for a provisional turn (a sound over the agent): nothing is answered before its
        transcript settles it, so ending it sooner gains little, and it would cut an
        interruption with pauses in it ("Wait, stop. What time is it?") into pieces, each
        too short to count, between which the agent would play on."""
        pause = self.vad.speech_end_ms
        if pause == self._asked_at or self.spawn is None or self.turn_id in self.provisional:
            return
        self._asked_at = pause
        audio = np.concatenate(list(self.turn_audio)[-(WINDOW_SAMPLES // FRAME_SAMPLES_16K) :])
        self.spawn(self._end_of_turn(self.turn_id, pause, audio), f"end-of-turn-{self.turn_id}")

    async def _end_of_turn(self, turn_id: int, pause: int, audio: np.ndarray) -> None:
        """Weigh how the turn sounds (the end-of-turn model) with how its words read (the
        encoder's judgement at the pause, when it has a words model): words that end a
        sentence end the turn as soon as they are in, without waiting for the sound; words
        that stop mid-sentence never end it before the silence window. A sound that is sure
        (`end_of_turn_sure`) does not wait for words still to come: on a voice like those
        the model was trained on, a finished question scores 0.96-0.98 and the halves cut at a
        pause at most 0.43, where the words come 100-350 ms later under load."""
        assert self.end_of_turn is not None
        asked = time.monotonic()
        sound: asyncio.Future[tuple[float, float]] | None = None
        try:
            words_first = self._finished_words(turn_id, pause, asked)
            if words_first is None:  # the sound model is asked only where the words fall short
                sound = asyncio.ensure_future(self.end_of_turn.probability(audio))
                words = self._words.get((turn_id, pause))
                if words is not None and not words.done():
                    await asyncio.wait({sound, words}, return_when=asyncio.FIRST_COMPLETED)
                    words_first = self._finished_words(turn_id, pause, asked)
            if words_first is not None:
                self._decide(turn_id, pause, None, words_first, False)
                return
            assert sound is not None
            p, took_s = await sound
        finally:
            if sound is not None:
                sound.cancel()  # decided on the words, or the session's task cancelled
        self.metrics.end_of_turn.observe(took_s)
        td = self.config.turn_detection
        if td is None or not td.semantic:
            return
        sure, pending = self.end_of_turn_sure, self._words.get((turn_id, pause))
        if sure < 1.0 and p >= sure and pending is not None and not pending.done():
            self._decide(turn_id, pause, p, None, False)  # sure: the words are not waited for
            return
        words, late = await self._words_at(turn_id, pause, td.silence_duration_ms)
        self._decide(turn_id, pause, p, words, late)

    def _finished_words(self, turn_id: int, pause: int, asked: float) -> float | None:
        """The words' judgement at this pause if it is in and ends a sentence (taken: the pause
        is decided on it alone); None otherwise."""
        future = self._words.get((turn_id, pause))
        if future is None or not future.done() or future.cancelled():
            return None
        words = future.result()
        if words is None or words < WORDS_FINISHED:
            return None  # not enough alone: the sound is weighed with it (_words_at)
        self._words.pop((turn_id, pause), None)
        self.metrics.end_of_turn_words.labels("judged").observe(time.monotonic() - asked)
        return words

    def _decide(
        self, turn_id: int, pause: int, p: float | None, words: float | None, late: bool
    ) -> None:
        """Act on semantic_vad's decision at the pause `pause` of `turn_id`, if the caller is
        still silent in it."""
        td = self.config.turn_detection
        decisions = self.metrics.end_of_turn_decisions
        if td is None or not td.semantic:
            return
        if turn_id != self.turn_id or (self.vad.in_speech and self.vad.speech_end_ms != pause):
            decisions.labels("spoke_again").inc()  # the pause was not the turn's end
            return
        if self.vad.in_speech and self.vad.voiced_run:
            # the caller's voice is back, not yet long enough for the VAD to call it speech
            # (onset_ms): ending the turn now would cut them off mid-sentence. Asked again
            # at the next silent frame, should the voice turn out not to be speech.
            decisions.labels("spoke_again").inc()
            self._asked_at = -1
            return
        if not self.vad.in_speech:
            decisions.labels("after_the_turn").inc()  # the silence window ended it first
            return
        eagerness = Eagerness(td.eagerness)
        decision = decide(p, words, late, eagerness)
        decisions.labels(decision).inc()
        self.metrics.end_of_turn_decided_after.labels(decision).observe(self.vad.silence_ms / 1000)
        if p is not None:
            self.metrics.end_of_turn_probability.labels("sound", decision).observe(p)
        if words is not None:
            self.metrics.end_of_turn_probability.labels("words", decision).observe(words)
        logger.debug(
            "turn %d at %d ms: end-of-turn probability %s, words %s: %s after %d ms",
            turn_id,
            pause,
            "-" if p is None else f"{p:.3f}",
            "late" if late else "-" if words is None else f"{words:.3f}",
            decision,
            self.vad.silence_ms,
        )
        if decision == "ended":
            stopped = self.vad.end_turn()
            assert stopped is not None
            self.end(stopped.audio_end_ms, self.create_response)
        elif decision == "window":
            self.vad.limit_pause(td.silence_duration_ms)
        else:  # held: the caller gets up to the eagerness's maximum
            self.vad.limit_pause(eagerness.max_wait_ms)

    def _expect_words(self, pause: int) -> None:
        """A TURN_PAUSED went to the encoder: semantic_vad will want its judgement of the
        words."""
        if not self.semantic or self.spawn is None:
            return
        key = (self.turn_id, pause)
        self._words[key] = asyncio.get_running_loop().create_future()
        self._words_asked.append(key)

    def words_judged(self, turn_id: int, finished: float) -> None:
        """The encoder's answer to the oldest pause of `turn_id` it has not answered: how
        likely its words end the turn (-1: not judged)."""
        asked = self._words_asked
        while asked and asked[0][0] < turn_id:
            asked.popleft()  # an earlier turn's pause the encoder never answered (dropped)
        if asked and asked[0][0] == turn_id:
            future = self._words.get(asked.popleft())
            if future is not None and not future.done():
                future.set_result(finished if finished >= 0 else None)

    async def _words_at(
        self, turn_id: int, pause: int, window_ms: int
    ) -> tuple[float | None, bool]:
        """The words' judgement at this pause, waited for until the silence window would
        have ended the turn anyway (None without one), and whether it came too late."""
        future = self._words.get((turn_id, pause))
        if future is None:
            return None, False
        silent_ms = self.vad.silence_ms if self.vad.speech_end_ms == pause else window_ms
        budget = max(window_ms - silent_ms, 0) / 1000
        asked = time.monotonic()
        waited = self.metrics.end_of_turn_words
        try:
            words = await asyncio.wait_for(asyncio.shield(future), budget)
            waited.labels("judged").observe(time.monotonic() - asked)
            return words, False
        except TimeoutError:
            waited.labels("late").observe(time.monotonic() - asked)
            return None, True  # no answer in time
        except asyncio.CancelledError:
            if future.cancelled():
                return None, False  # a new turn began meanwhile
            raise  # the session's task itself is cancelled
        finally:
            self._words.pop((turn_id, pause), None)

    # -- turns ---------------------------------------------------------------------------------

    def speech_started(self, started: SpeechStarted) -> None:
        self.metrics.vad_events.labels("speech_started").inc()
        provisional = self.listener.speech_onset()
        self.begin(started.audio_start_ms)
        if provisional:
            self.provisional.add(self.turn_id)
        self.turn_audio.append(started.prefix)
        for chunk in self.chunker.push(started.prefix):
            self.link.send_audio(self.session, chunk)
        self.outbox.speech_started(started.audio_start_ms, self.turn_items[self.turn_id])

    def begin(self, audio_start_ms: int, item_id: str | None = None) -> None:
        """A new turn: the stages are told, and its user item named."""
        self.turn_id += 1
        self.turn_items[self.turn_id] = item_id or ev.new_id("item")
        self.spans.turn_begun(self.turn_id)
        self.link.speech_started(self.session, self.turn_id, audio_start_ms)
        self.chunker.reset()
        self.turn_audio.clear()
        self.turn_audio_start_ms = audio_start_ms
        self._voiced_ms = 0
        for future in self._words.values():
            future.cancel()
        self._words.clear()  # the queue of asked pauses keeps order for the encoder's answers

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
        silence_ms = max(0, audio_end_ms - self.vad.speech_end_ms)
        asks = create_response and not provisional
        self.spans.turn_ended(self.turn_id, self.speech_stopped_ns, silence_ms, asks)
        if not provisional:
            self.listener.turn_ended(create_response)
        item_id = self.turn_items[self.turn_id]
        if (td := self.config.turn_detection) is not None:
            self.outbox.speech_stopped(audio_end_ms, item_id)
            silence_s = max(0, audio_end_ms - self.vad.speech_end_ms) / 1000
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
                silence_duration_ms=self._silence_limit_ms(td),
            )
        if had_vad != (td is not None):
            self.vad.reset()
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
