"""The vocoder stage's model loop with the stage's rings left out: replies made at the caller's
pause (held), and the order of a session's records across rings. The real espeak voice speaks;
what would go to the gateway is noted."""

from __future__ import annotations

import logging
import re
import threading
import time

import pytest

from stages.config import PipelineConfig
from stages.envelope import Envelope
from stages.messages import (
    AudioDone,
    Cancel,
    CancelAck,
    Kind,
    Phrase,
    ResponseDone,
    ResponseRelease,
    ResponseStarted,
    ResponseStop,
    SessionClose,
    SessionOpen,
    TextDelta,
)
from stages.vocoder import VocoderStage
from tests.stages.stage_events import Epochs, recording_ends

SESSION, EPOCH, REPLY = 3, 1, "resp_3_1"


class Noted(VocoderStage):
    """Notes its records for the gateway (ring ends stand-ins: stage_events.recording_ends)."""

    def __init__(self, max_lead_ms: int = 2000, early_phrase_ms: int = 600) -> None:
        # espeak: the voice in its wheel, quick to load
        vocoder = {"backend": "espeak", "max_lead_ms": max_lead_ms}
        config = PipelineConfig.model_validate(
            {"vocoder": vocoder | {"early_phrase_ms": early_phrase_ms}}
        )
        super().__init__(config, recording_ends("vocoder", Epochs(EPOCH)), threading.Event())
        self.gateway = self.ends.outputs["gateway"]
        self.load()

    @property
    def sent(self) -> list[object]:
        """What went to the gateway, messages and audio, in order."""
        assert all((s, e) == (SESSION, EPOCH) for s, _, e in self.gateway.sent)
        return [record for _, record, _ in self.gateway.sent]

    def inbound(self, msg, epoch: int = EPOCH) -> Envelope:
        kinds = {
            ResponseStarted: Kind.RESPONSE_STARTED,
            TextDelta: Kind.TEXT_DELTA,
            ResponseDone: Kind.RESPONSE_DONE,
            ResponseRelease: Kind.RESPONSE_RELEASE,
            ResponseStop: Kind.RESPONSE_STOP,
            SessionOpen: Kind.SESSION_OPEN,
            SessionClose: Kind.SESSION_CLOSE,
            Cancel: Kind.CANCEL,
        }
        from_gateway = SessionOpen | SessionClose | Cancel | ResponseStop
        src = "gateway" if isinstance(msg, from_gateway) else "reasoning"
        return Envelope(src, kinds[type(msg)], SESSION, epoch, 0, 0, msg)

    def give(self, msg, epoch: int = EPOCH) -> None:
        """Handled by the model loop."""
        self.route(self.inbound(msg, epoch))

    def read(self, msg, epoch: int = EPOCH) -> None:
        """Read by a reader thread: `deliver`, then the model loop handles what it queued."""
        self.deliver(self.inbound(msg, epoch))

    def pump_until_idle(self) -> None:
        """Until nothing is left to make now (a playing reply may wait for its next words)."""
        for _ in range(1000):  # a short reply: a few chunks
            wait = self.pump()
            if wait is None or wait > 0:
                return
        raise AssertionError("the vocoder never ran out of work")


@pytest.fixture
def vocoder() -> Noted:
    stage = Noted()
    stage.give(ResponseStarted(REPLY, 1, held=True))
    stage.give(TextDelta(REPLY, "Sure, it is sunny today.", 0))
    stage.give(ResponseDone(REPLY, "completed", "Sure, it is sunny today."))
    stage.pump_until_idle()
    return stage


def test_a_held_reply_is_spoken_but_nothing_leaves_until_it_is_released(vocoder) -> None:
    assert vocoder.sent == []
    made = vocoder.replies[SESSION].held.kept
    assert isinstance(made[0], Phrase) and sum(isinstance(r, bytes) for r in made) >= 2

    vocoder.give(ResponseRelease(REPLY, keep=True))
    vocoder.pump_until_idle()

    assert vocoder.sent[: len(made)] == made  # what was made, in the order it was made
    assert vocoder.sent[-1] == AudioDone(REPLY, "completed")
    phrases = [r.text for r in vocoder.sent if isinstance(r, Phrase)]
    assert " ".join(phrases) == "Sure, it is sunny today."
    assert SESSION not in vocoder.replies


def test_a_release_is_sent_by_the_reader_not_after_the_loops_decoder_pass(vocoder) -> None:
    made = vocoder.replies[SESSION].held.kept
    vocoder.read(ResponseRelease(REPLY, keep=True))
    assert vocoder.sent == made  # out before the model loop runs again

    while not vocoder.inbox.empty():  # then the model loop's turn
        vocoder.route(vocoder.inbox.get_nowait()[2])
    vocoder.pump_until_idle()
    assert vocoder.sent[: len(made)] == made and vocoder.sent.count(made[0]) == 1
    assert vocoder.sent[-1] == AudioDone(REPLY, "completed")


def test_a_talkers_cancel_is_acked_once_its_abort_is_applied_without_holding_the_reader(
    vocoder,
) -> None:
    """A talker voice frees its KV blocks at the end of its engine's step in flight: the ack
    waits for that, the reader that read the CANCEL does not (a release behind it goes out
    first). A voice with nothing to abort is acked at once."""
    confirm = []
    vocoder.voice.abort_stopped = confirm.append  # the talker's: calls back once applied
    made = vocoder.replies[SESSION].held.kept
    records = lambda: [record for _, record, _ in vocoder.gateway.sent]  # noqa: E731
    vocoder.read(Cancel(7, "resp_3_0"))  # an earlier reply's: this one stays held
    assert len(confirm) == 1 and records() == []

    vocoder.read(ResponseRelease(REPLY, keep=True))
    assert records() == made  # out while the abort is still being applied

    confirm[0](0.25)  # the engine applied it: the ack carries the KV usage
    ack = records()[-1]
    assert isinstance(ack, CancelAck) and (ack.cancel_id, ack.kv_usage) == (7, 0.25)

    del vocoder.voice.abort_stopped  # espeak's own: no engine to wait for
    vocoder.read(Cancel(8, "resp_3_0"))
    ack = records()[-1]
    assert isinstance(ack, CancelAck) and (ack.cancel_id, ack.kv_usage) == (8, None)


def test_a_reader_releasing_while_the_loop_speaks_loses_and_reorders_nothing() -> None:
    class Releasing(Noted):
        """Notes every record in the order the model loop makes it, held or not."""

        def __init__(self, max_lead_ms: int) -> None:
            super().__init__(max_lead_ms)
            self.made: list[object] = []
            self.some_made = threading.Event()

        def _to_gateway(self, session, reply, record) -> bool:
            self.made.append(record)
            if len(self.made) == 3:
                self.some_made.set()
            return super()._to_gateway(session, reply, record)

    text = "one two three four five six seven eight nine ten eleven twelve thirteen. " * 3
    stage = Releasing(max_lead_ms=600_000)
    stage.give(ResponseStarted(REPLY, 1, held=True))
    stage.give(TextDelta(REPLY, text, 0))
    stage.give(ResponseDone(REPLY, "completed", text))
    loop = threading.Thread(target=stage.pump_until_idle)
    loop.start()
    assert stage.some_made.wait(30)
    stage.read(ResponseRelease(REPLY, keep=True))  # while the loop goes on speaking
    loop.join(60)
    assert not loop.is_alive()
    stage.route(stage.inbox.get_nowait()[2])
    stage.pump_until_idle()

    assert stage.sent == stage.made and len(stage.made) > 10
    assert stage.sent[-1] == AudioDone(REPLY, "completed")
    phrases = [r.text for r in stage.sent if isinstance(r, Phrase)]
    assert " ".join(phrases) == text.strip()


def test_a_held_reply_the_caller_talked_over_is_dropped_unheard(vocoder) -> None:
    vocoder.give(ResponseRelease("resp_3_0", keep=True))  # another reply's: not this one
    assert vocoder.sent == []
    vocoder.give(ResponseRelease(REPLY, keep=False))
    vocoder.pump_until_idle()
    assert vocoder.sent == [] and SESSION not in vocoder.replies


def test_a_held_reply_makes_no_more_than_may_run_ahead_of_playback() -> None:
    stage = Noted(max_lead_ms=300)
    stage.give(ResponseStarted(REPLY, 1, held=True))
    stage.give(TextDelta(REPLY, "one two three four five six seven eight nine ten " * 4, 0))
    stage.pump_until_idle()  # returns: the held reply waits, it does not spin
    made = sum(len(r) for r in stage.replies[SESSION].held.kept if isinstance(r, bytes)) // 2
    rate = stage.voice.sample_rate
    assert 0.3 * rate <= made < 0.3 * rate + 0.1 * rate  # up to the lead, one 100 ms piece over
    assert stage.replies[SESSION].pending  # the rest waits for the release


def test_a_cancelled_session_loses_what_a_release_would_have_sent(vocoder) -> None:
    vocoder.control.current = EPOCH + 1  # the gateway's CANCEL bumped the epoch
    vocoder.give(ResponseRelease(REPLY, keep=True))
    assert vocoder.sent == []


def test_a_reply_handled_before_its_sessions_open_is_spoken() -> None:
    """The reply comes on reasoning's ring, the SESSION_OPEN on the gateway's: when the reply's
    start is handled first, the open (same epoch: the same holder) must not drop it."""
    stage = Noted()
    stage.give(ResponseStarted(REPLY, 1))
    stage.give(SessionOpen())
    stage.give(TextDelta(REPLY, "Sure.", 0))
    stage.give(ResponseDone(REPLY, "completed", "Sure."))
    stage.pump_until_idle()
    assert any(isinstance(r, bytes) for r in stage.sent)
    assert stage.sent[-1] == AudioDone(REPLY, "completed")


def test_the_next_holders_open_and_a_close_drop_the_reply() -> None:
    stage = Noted()
    stage.give(ResponseStarted(REPLY, 1))
    stage.give(SessionClose())
    assert SESSION not in stage.replies

    stage.give(ResponseStarted(REPLY, 1))
    # the id was released and claimed again: two bumps
    stage.control.current = EPOCH + 2
    stage.give(SessionOpen(), epoch=EPOCH + 2)
    assert SESSION not in stage.replies
    stage.pump_until_idle()
    assert stage.sent == []


def test_a_cancel_drops_the_reply_before_it_not_the_one_asked_for_after() -> None:
    stage = Noted()
    stage.give(ResponseStarted(REPLY, 1))
    stage.give(Cancel(1, REPLY), epoch=EPOCH + 1)
    assert SESSION not in stage.replies

    # response.cancel, then response.create at once: the new reply's start (epoch after the
    # cancel) is handled before the CANCEL, which must not drop it
    stage = Noted()
    stage.give(ResponseStarted("resp_next", 1))
    stage.give(Cancel(1, REPLY))
    assert stage.replies[SESSION].response_id == "resp_next"


def test_a_reply_stopped_by_the_gateway_is_dropped_and_only_that_one() -> None:
    stage = Noted()
    stage.give(ResponseStarted(REPLY, 1))
    stage.give(ResponseStop("resp_3_0"))  # an older reply's: not this one
    assert stage.replies[SESSION].response_id == REPLY
    stage.give(ResponseStop(REPLY))
    assert SESSION not in stage.replies
    stage.give(TextDelta(REPLY, "Sure, it is sunny today.", 0))
    stage.pump_until_idle()
    assert stage.sent == []


def test_each_replys_first_audio_is_timed_from_its_first_phrase(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Logged apart for replies made at the caller's pause, which must have it before the turn
    ends, and the others; a reply released before its first audio is still one of the first."""
    stage = Noted()
    for log in stage.first_audio.values():
        log.every_s = 0  # a line for every reply
    kinds = set()
    for held in (True, False):
        started = time.monotonic_ns()
        stage.give(ResponseStarted(REPLY, 1, held=held))
        if held:
            stage.give(ResponseRelease(REPLY, keep=True))  # released before anything was made
        text = TextDelta(REPLY, "Sure, it is sunny today.", 0)
        stage.route(Envelope("reasoning", Kind.TEXT_DELTA, SESSION, EPOCH, 0, started, text))
        with caplog.at_level(logging.INFO, logger="stages.passlog"):
            stage.pump_until_idle()
        took_ms = (time.monotonic_ns() - started) / 1e6
        (record,) = caplog.records
        caplog.clear()
        found = re.fullmatch(
            r"vocoder: first audio after the first phrase, (.+): 1 in 0 s, "
            r"p50 ([0-9.]+) ms, p95 \2 ms, p99 \2 ms, max \2 ms",
            record.getMessage(),
        )
        assert found, record.getMessage()
        kinds.add(found[1])
        assert 0 < float(found[2]) <= took_ms
    assert kinds == {"replies made at the pause", "other replies"}


@pytest.mark.parametrize("early_phrase_ms", [600, 0])
def test_a_playing_reply_about_to_fall_silent_speaks_the_words_so_far(early_phrase_ms) -> None:
    """The clause after the first phrase is long and still being written: once the audio
    ahead of playback is under the low water, its words so far go to the voice rather than
    the caller hearing the agent stop mid-sentence (unless early phrases are off)."""
    stage = Noted(early_phrase_ms=early_phrase_ms)
    stage.give(ResponseStarted(REPLY, 1))
    stage.give(TextDelta(REPLY, "The sky is blue because of a process that ", 0))
    stage.pump_until_idle()  # the first phrase, made
    reply = stage.replies[SESSION]
    assert [r.text for r in stage.sent if isinstance(r, Phrase)] == ["The sky is blue"]
    # played until under the low water: its start moved back by what has played
    made_s = reply.samples / stage.voice.sample_rate
    reply.started = time.monotonic() - made_s + 0.3
    assert stage.pump() is None or not reply.pending
    phrases = [r.text for r in stage.sent if isinstance(r, Phrase)]
    if early_phrase_ms:
        assert phrases == ["The sky is blue", "because of a process that"]
    else:
        assert phrases == ["The sky is blue"] and reply.splitter.take_words(1)
