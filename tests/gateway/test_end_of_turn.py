"""gateway.turns.end_of_turn: semantic_vad's rule over the sound and the words, and its judge of
one session's pauses, on a real turn detector whose classifier calls loud frames speech and a
sound model the test answers."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from gateway.metrics import GatewayMetrics
from gateway.protocol import TurnDetection
from gateway.turns.detector import TurnDetector
from gateway.turns.end_of_turn import Decision, Eagerness, EndOfTurnJudge, decide
from stages.messages import FRAME_SAMPLES
from tests.gateway.test_session_events import HeldEndOfTurn


def test_eagerness_orders_its_thresholds_and_waits() -> None:
    low, medium, high = (Eagerness(e) for e in ("low", "medium", "high"))
    assert low.complete > medium.complete > high.complete
    assert (low.max_wait_ms, medium.max_wait_ms, high.max_wait_ms) == (8000, 4000, 2000)
    assert vars(Eagerness("auto")) == vars(medium)


@pytest.mark.parametrize(
    ("sound", "words", "late", "decision"),
    [
        (0.95, None, False, "ended"),  # sure from the sound alone
        (0.5, 0.6, False, "ended"),  # the words end a sentence
        (0.1, 0.6, False, "ended"),  # ... even where the sound hears it cut off
        (None, 0.25, False, "ended"),  # the words came first: the sound was not waited for
        (0.5, 0.1, False, "window"),  # the words are not sure
        (0.5, None, False, "window"),  # no words model: the sound is not sure
        (0.95, 0.01, False, "window"),  # words stop mid-sentence: never before the window
        (0.1, 0.01, False, "held"),  # both say cut off: the caller gets time
        (0.1, None, False, "held"),  # no words model, and it sounds cut off
        (0.1, None, True, "window"),  # words asked for but late: no hold on the sound alone
        (0.95, None, True, "ended"),
    ],
)
def test_semantic_vad_decides_on_the_sound_and_the_words(
    sound: float | None, words: float | None, late: bool, decision: str
) -> None:
    assert decide(sound, words, late, Eagerness("medium")) == decision


def test_without_finished_words_the_sound_is_needed() -> None:
    with pytest.raises(ValueError, match="the sound decides"):
        decide(None, 0.1, False, Eagerness("medium"))


SPEECH = (np.sin(np.arange(FRAME_SAMPLES) / 3) * 8000).astype(np.int16)
SILENCE = np.zeros(FRAME_SAMPLES, np.int16)


class LoudIsSpeech:
    """A speech classifier for the test: a loud frame is speech."""

    def set_threshold(self, threshold: float) -> None: ...

    def is_speech(self, frame: np.ndarray) -> bool:
        return bool(np.abs(frame).mean() > 1000)


class Judged:
    """A judge over a detector, and what it decided."""

    def __init__(self, eagerness: str = "auto") -> None:
        self.detector = TurnDetector(silence_duration_ms=500, classifier=LoudIsSpeech())
        self.sound, self.metrics = HeldEndOfTurn(), GatewayMetrics()
        self.settings = TurnDetection(type="semantic_vad", eagerness=eagerness)
        self.decisions: list[tuple[Decision, int]] = []
        self.tasks: list[asyncio.Task[Any]] = []
        self.judge = EndOfTurnJudge(
            self.detector,
            self.sound,  # type: ignore[arg-type]
            lambda: self.settings,
            self.metrics,
            lambda coro, name: self.tasks.append(asyncio.ensure_future(coro)),
            lambda decision, wait_ms: self.decisions.append((decision, wait_ms)),
            ask_after_ms=100,
        )
        self.frames: list[np.ndarray] = []

    async def feed(self, frame: np.ndarray, count: int) -> None:
        """Frames through the detector, the judge listening while a turn is on, and its
        questions given their turn of the loop after each."""
        for _ in range(count):
            self.detector.feed(frame)
            if self.detector.in_speech:
                self.frames.append(frame)
                self.judge.listen(self.frames)
            await asyncio.sleep(0)

    async def spoken(self) -> None:
        """A turn begun and spoken, the caller now silent."""
        await self.feed(SILENCE, 10)
        await self.feed(SPEECH, 20)
        assert self.detector.in_speech
        self.judge.turn_began(1)

    async def answer(self, p: float) -> None:
        self.sound.asked[-1].set_result((p, 0.01))
        await asyncio.gather(*self.tasks)


async def test_a_pause_is_asked_about_once_and_a_sure_sound_ends_the_turn() -> None:
    j = Judged()
    await j.spoken()
    await j.feed(SILENCE, 4)  # 80 ms of pause: not yet
    assert not j.sound.asked
    await j.feed(SILENCE, 10)
    assert len(j.sound.asked) == 1  # asked at 100 ms, and not again in the same pause
    await j.answer(0.97)
    assert j.decisions == [("ended", 4000)]


async def test_words_that_end_a_sentence_decide_without_the_sound() -> None:
    j = Judged()
    await j.spoken()
    j.judge.expect_words(j.detector.speech_end_ms)  # the pause went to the encoder
    j.judge.words_judged(1, 0.6)
    await j.feed(SILENCE, 6)
    await asyncio.gather(*j.tasks)
    assert not j.sound.asked and j.decisions == [("ended", 4000)]


async def test_a_turn_that_sounds_and_reads_cut_off_is_held_for_the_eagerness() -> None:
    j = Judged(eagerness="low")
    await j.spoken()
    j.judge.expect_words(j.detector.speech_end_ms)
    await j.feed(SILENCE, 6)
    j.judge.words_judged(1, 0.01)  # "How many legs"
    await j.answer(0.1)
    assert j.decisions == [("held", 8000)]


async def test_late_words_leave_an_unsure_turn_to_the_silence_window() -> None:
    j = Judged()
    await j.spoken()
    j.judge.expect_words(j.detector.speech_end_ms)
    await j.feed(SILENCE, 6)
    # no words come: they are waited for until the window would have ended the turn
    await j.answer(0.1)
    assert j.decisions == [("window", 500)]


async def test_a_caller_who_speaks_again_before_the_answer_gets_no_decision() -> None:
    j = Judged()
    await j.spoken()
    await j.feed(SILENCE, 6)
    await j.feed(SPEECH, 5)  # back to speaking in the same turn
    await j.answer(0.97)
    assert j.decisions == []
    samples = j.metrics.end_of_turn_decisions.collect()[0].samples
    assert any(s.labels["decision"] == "spoke_again" and s.value == 1 for s in samples)


async def test_server_vad_asks_nothing() -> None:
    j = Judged()
    j.settings = TurnDetection(type="server_vad")
    await j.spoken()
    j.judge.expect_words(j.detector.speech_end_ms)
    await j.feed(SILENCE, 10)
    assert not j.sound.asked and not j.tasks and not j.decisions
