"""semantic_vad: whether a pause ends the caller's turn, from how it sounds (the Smart Turn model,
gateway.turns.smart_turn) and how its words read (the encoder's judgement at the pause,
stages.backends.words_end_turn).

`decide` is the rule over the two probabilities; `EndOfTurnJudge` is one session's judge: it
asks at each pause of the turn in progress, gathers the answers off the event loop, and tells
its owner what the pause means through a callback: "ended" (the turn ends now), "window" (it
ends after the silence window unless the caller speaks) or "held" (it waits up to the
eagerness's maximum). It reads the turn detector and never changes it, nor anything of the
session: the owner carries the decision out.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, ClassVar, Literal

import numpy as np

from gateway.metrics import GatewayMetrics
from gateway.protocol import TurnDetection
from gateway.turns.detector import TurnDetector
from gateway.turns.smart_turn import WINDOW_SAMPLES, SmartTurn
from stages.messages import FRAME_SAMPLES

logger = logging.getLogger(__name__)

Decision = Literal["ended", "window", "held"]

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


def decide(
    sound: float | None, words: float | None, words_late: bool, eagerness: Eagerness
) -> Decision:
    """semantic_vad's decision at a pause, from the probability that the turn sounds complete
    (`sound`; None: not asked, the words having decided) and that its words end a sentence
    (`words`; None: not judged, or `words_late`).

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


# what the owner does with a decision: "ended" now, or the pause's silence limit in ms
Decided = Callable[[Decision, int], None]
Spawn = Callable[[Coroutine[Any, Any, None], str], Any]


class EndOfTurnJudge:
    """semantic_vad for one session. `detector` is the session's turn detector (read only);
    `sound` the process's Smart Turn; `settings` gives the session's turn detection now (it
    may change mid-turn); `spawn` runs a question as one of the session's tasks; `decided`
    hears each decision. The model is asked once the caller has been silent `ask_after_ms`;
    from `sure` its answer does not wait for the words."""

    def __init__(
        self,
        detector: TurnDetector,
        sound: SmartTurn,
        settings: Callable[[], TurnDetection | None],
        metrics: GatewayMetrics,
        spawn: Spawn,
        decided: Decided,
        *,
        ask_after_ms: int = 200,
        sure: float = 0.95,
    ) -> None:
        self.detector, self.sound, self.settings = detector, sound, settings
        self.metrics, self.spawn, self.decided = metrics, spawn, decided
        self.ask_after_ms, self.sure = ask_after_ms, sure
        self.turn_id = 0
        self._asked_at = -1  # the pause (its speech end) the sound model was asked about
        # the encoder's judgement of the words at each pause sent to it, keyed by (turn, the
        # pause's speech end); the encoder answers TURN_PAUSEDs in order
        self._words: dict[tuple[int, int], asyncio.Future[float | None]] = {}
        self._words_asked: collections.deque[tuple[int, int]] = collections.deque(maxlen=16)

    @property
    def on(self) -> bool:
        td = self.settings()
        return td is not None and td.type == "semantic_vad"

    def turn_began(self, turn_id: int) -> None:
        """A new turn: the answers still to come about the last one's pauses are dropped (the
        queue of asked pauses keeps order for the encoder's answers)."""
        self.turn_id = turn_id
        for future in self._words.values():
            future.cancel()
        self._words.clear()

    def listen(self, audio: Sequence[np.ndarray]) -> None:
        """After each frame of the turn in progress (`audio`: its frames so far): once the
        caller has paused long enough, does the turn so far sound finished? Asked once a
        pause, and answered off the loop.

        The owner does not call it for a provisional turn (a sound over the agent): nothing is
        answered before its transcript settles it, so ending it sooner gains little, and it
        would cut an interruption with pauses in it ("Wait, stop. What time is it?") into
        pieces, each too short to count, between which the agent would play on."""
        detector = self.detector
        if (
            not self.on
            or detector.silence_ms < self.ask_after_ms
            or detector.voiced_run  # a voice onset may be the caller going on
            or detector.speech_end_ms == self._asked_at
        ):
            return
        pause = self._asked_at = detector.speech_end_ms
        window = list(audio)[-(WINDOW_SAMPLES // FRAME_SAMPLES) :]
        turn_id = self.turn_id
        self.spawn(self._judge(turn_id, pause, np.concatenate(window)), f"end-of-turn-{turn_id}")

    def expect_words(self, pause: int) -> None:
        """A TURN_PAUSED went to the encoder for the pause that began at `pause`: its
        judgement of the words will come."""
        if not self.on:
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

    async def _judge(self, turn_id: int, pause: int, audio: np.ndarray) -> None:
        """Weigh how the turn sounds with how its words read: words that end a sentence end
        the turn as soon as they are in, without waiting for the sound; words that stop
        mid-sentence never end it before the silence window. A sound that is sure (`sure`)
        does not wait for words still to come: on a voice like those the model was trained
        on, a finished question scores 0.96-0.98 and the halves cut at a pause at most 0.43,
        where the words come 100-350 ms later under load."""
        asked = time.monotonic()
        sound: asyncio.Future[tuple[float, float]] | None = None
        try:
            words_first = self._finished_words(turn_id, pause, asked)
            if words_first is None:  # the sound model is asked only where the words fall short
                sound = asyncio.ensure_future(self.sound.probability(audio))
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
        td = self.settings()
        if td is None or td.type != "semantic_vad":
            return
        pending = self._words.get((turn_id, pause))
        if self.sure < 1.0 and p >= self.sure and pending is not None and not pending.done():
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

    async def _words_at(
        self, turn_id: int, pause: int, window_ms: int
    ) -> tuple[float | None, bool]:
        """The words' judgement at this pause, waited for until the silence window would
        have ended the turn anyway (None without one), and whether it came too late."""
        future = self._words.get((turn_id, pause))
        if future is None:
            return None, False
        detector = self.detector
        silent_ms = detector.silence_ms if detector.speech_end_ms == pause else window_ms
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

    def _decide(
        self, turn_id: int, pause: int, p: float | None, words: float | None, late: bool
    ) -> None:
        """semantic_vad's decision at the pause `pause` of `turn_id`, told to the owner if the
        caller is still silent in it."""
        td = self.settings()
        decisions = self.metrics.end_of_turn_decisions
        if td is None or td.type != "semantic_vad":
            return
        detector = self.detector
        if turn_id != self.turn_id or (detector.in_speech and detector.speech_end_ms != pause):
            decisions.labels("spoke_again").inc()  # the pause was not the turn's end
            return
        if detector.in_speech and detector.voiced_run:
            # the caller's voice is back, not yet long enough for the VAD to call it speech
            # (onset_ms): ending the turn now would cut them off mid-sentence. Asked again
            # at the next silent frame, should the voice turn out not to be speech.
            decisions.labels("spoke_again").inc()
            self._asked_at = -1
            return
        if not detector.in_speech:
            decisions.labels("after_the_turn").inc()  # the silence window ended it first
            return
        eagerness = Eagerness(td.eagerness)
        decision = decide(p, words, late, eagerness)
        decisions.labels(decision).inc()
        self.metrics.end_of_turn_decided_after.labels(decision).observe(detector.silence_ms / 1000)
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
            detector.silence_ms,
        )
        wait_ms = td.silence_duration_ms if decision == "window" else eagerness.max_wait_ms
        self.decided(decision, wait_ms)
