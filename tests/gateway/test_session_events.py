"""gateway.session on its own, with a stand-in for the rings: the events a client sees."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import numpy as np
import pytest

from gateway.config import TurnsConfig
from gateway.metrics import GatewayMetrics
from gateway.protocol import ProtocolError, SessionConfig
from gateway.session import RealtimeSession, Reply, stop
from stages.envelope import Envelope
from stages.messages import Kind, Transcript

# What these sessions change from the recommended turn-taking (gateway.turns): the reply is
# made once a turn ends, not from the caller's pause, and any sound over the agent cuts it.
TURNS = TurnsConfig(prepare_reply_ms=0, interruptions={"policy": "immediate"})


class RecordingLink:
    """Takes what the session would push into the rings (stages.link.PipelineLink's
    methods that a session calls), in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def _note(self, name: str, *args: Any) -> None:
        self.calls.append((name, args))

    def send_audio(self, session: int, pcm16: Any) -> bool:
        self._note("send_audio", session, pcm16)
        return True

    def speech_started(
        self, session: int, turn_id: int, audio_start_ms: int = 0, provisional: bool = False
    ) -> None:
        self._note("speech_started", session, turn_id, audio_start_ms)

    def speech_stopped(
        self,
        session: int,
        turn_id: int,
        audio_end_ms: int = 0,
        create_response: bool = True,
        provisional: bool = False,
    ) -> int:
        self._note("speech_stopped", session, turn_id, audio_end_ms, create_response)
        return 0

    def turn_paused(
        self, session: int, turn_id: int, create_response: bool = True, silence_to_come_ms=0
    ) -> None:
        self._note("turn_paused", session, turn_id, create_response)

    def turn_resumed(self, session: int, turn_id: int) -> None:
        self._note("turn_resumed", session, turn_id)

    def create_response(self, session: int, response_id: str, **fields: Any) -> None:
        self._note("create_response", session, response_id)

    def set_history(self, session: int, messages: Any) -> None:
        self._note("set_history", session, messages)

    def apply_settings(self, session: int, settings: Any) -> None:
        self._note("apply_settings", session, settings)

    def stop_response(self, session: int, response_id: str) -> None:
        self._note("stop_response", session, response_id)

    def close_session(self, session: int, reason: str = "closed") -> None:
        self._note("close_session", session, reason)

    def cancel(self, *args: Any) -> tuple[int, int]:
        self._note("cancel", *args)
        return len(self.calls), 0  # (cancel id, when it was sent)


class RecordingTransport:
    kind = "websocket"
    holds_audio = False

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.holds: list[bool] = []
        self.played: list[tuple[str, int]] = []  # (response id, samples)

    def send_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def play(self, reply: Reply, pcm: np.ndarray) -> None:
        self.played.append((reply.response_id, len(pcm)))

    def audio_end(self, reply: Reply) -> None: ...
    def finish(self, reply: Reply) -> None: ...
    def clear(self) -> None: ...
    def hold(self, held: bool) -> None:
        self.holds.append(held)

    def heard_samples(self, reply: Reply) -> int:
        return 0

    async def close(self) -> None: ...


def transcript(turn: int, text: str, final: bool) -> Envelope:
    return Envelope("encoder", Kind.TRANSCRIPT, 1, 0, 0, 0, Transcript(turn, text, final))


def test_partial_transcripts_become_additive_deltas() -> None:
    link, config = RecordingLink(), SessionConfig(voice="v")
    session = RealtimeSession("sess_t", link, 1, 22050, GatewayMetrics(), config, print, TURNS)
    transport = RecordingTransport()
    session.bind(transport)
    session.turns.begin(0)
    for guess in ["so", "stop", "stop the", "stop please", "stop please now"]:
        session.on_stage_event(transcript(1, guess, final=False))
    session.on_stage_event(transcript(1, "stop please now", final=True))
    deltas = [
        e["delta"]
        for e in transport.events
        if e["type"] == "conversation.item.input_audio_transcription.delta"
    ]
    # "stop" revises "so" and "stop please" revises "stop the": those wait for the final
    assert deltas == ["so"]
    completed = [
        e for e in transport.events if e["type"].endswith("input_audio_transcription.completed")
    ]
    assert [e["transcript"] for e in completed] == ["stop please now"]

    session.turns.begin(0)
    for guess in ["what", "what is", "what is the time"]:
        session.on_stage_event(transcript(2, guess, final=False))
    deltas = [
        e["delta"]
        for e in transport.events
        if e["type"] == "conversation.item.input_audio_transcription.delta"
    ]
    assert "".join(deltas[1:]) == "what is the time"


def test_the_agent_is_held_from_the_first_voiced_frame_until_the_vad_decides(
    make_speech,
) -> None:
    speech = make_speech("wait a moment").pcm16
    for hold_on_voice in (True, False):
        session = RealtimeSession(
            "sess_h",
            RecordingLink(),
            1,
            22050,
            GatewayMetrics(),
            SessionConfig(voice="v"),
            print,
            turns=TurnsConfig(
                prepare_reply_ms=0,
                interruptions={"policy": "immediate", "hold_on_voice": hold_on_voice},
            ),
        )
        transport = RecordingTransport()
        session.bind(transport)
        session.replies.current = object()  # the agent is speaking
        for start in range(0, len(speech), 320):
            session.feed_audio(speech[start : start + 320])
            if session.turns.detector.voiced_run:
                break  # the first voiced frame, before any barge-in is decided
        if not hold_on_voice:
            assert not any(transport.holds)
            continue
        assert transport.holds[-1] and not session.turns.detector.in_speech
        assert session.turns.detector.voiced_run < session.turns.detector._onset_frames
        session.feed_audio(np.zeros(320, np.int16))  # a false start: the agent plays on
        assert transport.holds[-1] is False


def test_a_reply_whose_audio_ends_before_its_text_arrives_is_finished_once_with_all_of_it() -> None:
    """AUDIO_DONE (the vocoder's ring) may be read before the last TEXT_DELTA and RESPONSE_DONE
    (reasoning's ring): response.done waits for the text, and comes once."""
    from stages.messages import AudioDone, ResponseDone, ResponseStarted, TextDelta

    link, config = RecordingLink(), SessionConfig(voice="v")
    session = RealtimeSession("sess_t", link, 1, 22050, GatewayMetrics(), config, print, TURNS)
    transport = RecordingTransport()
    session.bind(transport)

    def stage(name: str, kind: Kind, msg: Any) -> None:
        session.on_stage_event(Envelope(name, kind, 1, 0, 0, 0, msg))

    stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_1", 1))
    stage("reasoning", Kind.TEXT_DELTA, TextDelta("resp_1", "Sunny ", 0))
    stage("vocoder", Kind.AUDIO_DONE, AudioDone("resp_1", "completed"))
    assert not [e for e in transport.events if e["type"] == "response.done"]
    stage("reasoning", Kind.TEXT_DELTA, TextDelta("resp_1", "today.", 1))
    stage("reasoning", Kind.RESPONSE_DONE, ResponseDone("resp_1", "completed", "Sunny today."))
    (done,) = [e for e in transport.events if e["type"] == "response.done"]
    assert done["response"]["status"] == "completed"
    (content,) = done["response"]["output"][0]["content"]
    assert content["transcript"] == "Sunny today."


class Bound:
    """A session bound to a recording transport and link, fed stage events by `stage`."""

    def __init__(self, omni_events: bool = True) -> None:
        self.link, self.transport = RecordingLink(), RecordingTransport()
        self.metrics = GatewayMetrics()
        config = SessionConfig(voice="v", omni_events=omni_events)
        self.session = RealtimeSession(
            "sess_b", self.link, 1, 22050, self.metrics, config, print, TURNS
        )
        self.session.bind(self.transport)

    def stage(self, name: str, kind: Kind, msg: Any) -> None:
        self.session.on_stage_event(Envelope(name, kind, 1, 0, 0, 0, msg))

    def audio(self, samples: int) -> None:
        self.stage("vocoder", Kind.AUDIO_OUT, np.ones(samples, np.int16).tobytes())


def test_the_gateways_own_events_go_only_to_a_client_that_asked() -> None:
    from stages.messages import Phrase, ResponseStarted

    def events_of_a_reply(b: Bound) -> list[str]:
        b.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_1", 1))
        b.stage("vocoder", Kind.PHRASE, Phrase("resp_1", "Sure", 22050, 0))
        b.audio(2205)
        return [e["type"] for e in b.transport.events]

    assert "omni.response.first_audio" in events_of_a_reply(Bound(omni_events=True))
    quiet = events_of_a_reply(Bound(omni_events=False))  # the default
    assert "response.created" in quiet and not any(t.startswith("omni.") for t in quiet)
    assert SessionConfig(voice="v").omni_events is False
    asked = SessionConfig(voice="v").updated({"omni_events": True})
    assert asked.omni_events is True and "omni_events" not in asked.to_json("s")
    with pytest.raises(ProtocolError, match="omni_events must be true or false"):
        SessionConfig(voice="v").updated({"omni_events": "yes"})


def test_a_replys_voice_that_comes_before_its_start_is_kept_for_it() -> None:
    """The vocoder's ring and reasoning's race to the loop: a reply released at the end of the
    turn sends its start and its first audio at once, and the audio may be read first."""
    from stages.messages import AudioDone, Phrase, ResponseDone, ResponseStarted

    b = Bound()
    b.stage("vocoder", Kind.PHRASE, Phrase("resp_1", "Sure, it", 22050, 0))
    b.audio(2205)
    b.audio(1000)
    assert b.transport.played == [] and not b.transport.events[1:]  # nothing before its start
    b.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_1", 1))
    assert b.transport.played == [("resp_1", 2205), ("resp_1", 1000)]
    assert b.session.reply.tracker.heard(3205) == "Sure, it"
    assert b.metrics.voice_ahead._value.get() == 3
    types = [e["type"] for e in b.transport.events]
    assert types.index("response.created") < types.index("omni.response.first_audio")

    # the next reply's voice comes first too
    b.stage("vocoder", Kind.AUDIO_DONE, AudioDone("resp_1", "completed"))
    b.stage("reasoning", Kind.RESPONSE_DONE, ResponseDone("resp_1", "completed", "Sure, it"))
    b.session.playback_done("resp_1")
    b.stage("vocoder", Kind.PHRASE, Phrase("resp_2", "Yes.", 22050, 0))
    b.audio(500)
    b.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_2", 2))
    assert b.transport.played[-1] == ("resp_2", 500)


def test_the_heard_text_is_a_prefix_of_the_transcript_when_phrases_split_a_word() -> None:
    """Text without spaces is cut into phrases inside a word: what was heard still spells the
    transcript's own words, not the phrases joined with spaces."""
    from gateway.session.reply import SpokenTracker

    transcript = "pos\ufffdname cal, then more"
    tracker = SpokenTracker()
    for phrase, samples in (("pos\ufffdna", 100), ("me cal,", 100), ("then more", 100)):
        tracker.phrase(phrase)
        tracker.audio(samples)
    assert tracker.heard(100, transcript) == "pos\ufffdna"
    assert tracker.heard(200, transcript) == "pos\ufffdname cal,"
    assert tracker.heard(250, transcript) == "pos\ufffdname cal, then"
    assert tracker.heard(300, transcript) == transcript
    assert tracker.heard(200) == "pos\ufffdna me cal,"  # without the transcript, as spoken
    # a transcript the phrases do not spell (edited since): the phrases' words
    assert tracker.heard(200, "something else") == "pos\ufffdna me cal,"


def test_a_cancel_lets_go_of_voice_kept_for_a_reply_not_yet_started() -> None:
    from stages.messages import Phrase, ResponseStarted

    b = Bound()
    b.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_1", 1))
    b.stage("vocoder", Kind.PHRASE, Phrase("resp_2", "Next", 22050, 0))
    b.audio(800)
    assert b.session.replies.voice_ahead.records
    stop.cut(b.session.replies, b.session.cancels, "barge_in", b.session.log)
    assert b.session.replies.voice_ahead.records == []


def test_a_reply_the_stages_start_over_one_still_playing_is_not_cancelled() -> None:
    """The reasoning stage stops the old reply itself when it starts the next (a turn taken
    while the agent still spoke, with interrupt_response off): the gateway stops playing the old
    one but cancels nothing, which would purge the new reply too (same epoch)."""
    from stages.messages import Phrase, ResponseStarted

    b = Bound()
    b.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_1", 1))
    b.stage("vocoder", Kind.PHRASE, Phrase("resp_1", "One two", 22050, 0))
    b.audio(800)
    b.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_2", 2))
    assert b.link.calls == []
    assert b.session.reply.response_id == "resp_2"
    done = [e for e in b.transport.events if e["type"] == "response.done"]
    assert [d["response"]["status"] for d in done] == ["cancelled"]  # resp_1, cut short
    # by the caller's newer turn, not by the client
    assert done[0]["response"]["status_details"]["reason"] == "turn_detected"
    b.audio(800)  # what the vocoder still had of resp_1 is not played as resp_2's
    assert b.transport.played == [("resp_1", 800)]


def test_a_response_create_over_a_reply_still_playing_cancels_it_first() -> None:
    from stages.messages import AudioDone, ResponseDone, ResponseStarted

    b = Bound()
    b.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_1", 1))
    b.stage("reasoning", Kind.RESPONSE_DONE, ResponseDone("resp_1", "completed", "Hello."))
    b.stage("vocoder", Kind.AUDIO_DONE, AudioDone("resp_1", "completed"))
    assert b.session.reply is not None  # generated, still playing
    b.session.on_client_message('{"type": "response.create"}')
    # the cancel goes first: the new reply is stamped with the epoch after it
    assert [name for name, _ in b.link.calls] == ["cancel", "create_response"]
    assert b.link.calls[0][1][1] == "resp_1"


def test_speech_before_the_turns_reply_started_cancels_that_reply_first() -> None:
    """The caller speaks again before the reply to their last turn has started: it must not
    start over them. The cancel goes before the new turn, whose speech it would purge."""
    from gateway.turns.detector import VadStart
    from stages.messages import ResponseStarted

    def turn(b: Bound, said: str | None, create_response: bool = True) -> None:
        b.session.turns.end(1000 * b.session.turns.turn_id, create_response)
        if said is not None:  # the turn's final transcript is here
            b.session.on_stage_event(transcript(b.session.turns.turn_id, said, final=True))

    def speak_again(b: Bound) -> list[str]:
        b.link.calls.clear()
        b.session.turns.speech_started(VadStart(1500, 1800, np.zeros(0, np.int16)))
        return [name for name, _ in b.link.calls]

    b = Bound()
    b.session.turns.begin(0)
    turn(b, "what is the time")
    assert speak_again(b) == ["cancel", "speech_started"]
    assert b.link.calls[0][1][1:] == (None, "", "barge_in")  # no reply, nothing heard
    assert not [e for e in b.transport.events if e["type"].startswith("response.")]
    turn(b, "and in Paris")
    b.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_2", 1))
    assert speak_again(b) == ["cancel", "speech_started"]  # a barge-in, as ever
    turn(b, "", create_response=True)  # nothing was said: reasoning answers nothing
    assert speak_again(b) == ["speech_started"]
    turn(b, "hmm", create_response=False)
    assert speak_again(b) == ["speech_started"]

    # while the encoder still transcribes the turn, a cancel would purge what it has of it,
    # so none is sent (the reply may still start over the caller: a gap left open)
    b = Bound()
    b.session.turns.begin(0)
    turn(b, None)
    assert speak_again(b) == ["speech_started"]


def test_a_reply_that_starts_while_the_caller_speaks_again_is_stopped_unheard(
    make_speech,
) -> None:
    """The caller spoke again while their last turn was still being transcribed (too soon to
    cancel its reply): the reply is stopped as it starts, and nothing is purged."""
    from stages.messages import Phrase, ResponseStarted

    b = Bound()
    b.session.turns.begin(0)
    b.session.turns.end(1000, create_response=True)
    speech = make_speech("and in Paris").pcm16
    for start in range(0, len(speech), 320):  # the caller speaks again
        b.session.feed_audio(speech[start : start + 320])
        if b.session.turns.detector.in_speech:
            break
    assert b.session.turns.detector.in_speech
    assert "cancel" not in [name for name, _ in b.link.calls]  # turn 1 still transcribing
    b.session.on_stage_event(transcript(1, "what is the time", final=True))
    b.link.calls.clear()
    b.stage("vocoder", Kind.PHRASE, Phrase("resp_1", "It is", 22050, 0))
    b.audio(800)  # its first audio, read before its start
    b.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_1", 1))
    assert b.link.calls == [("stop_response", (1, "resp_1"))]
    assert b.session.reply is None
    done = [e for e in b.transport.events if e["type"] == "response.done"]
    assert [d["response"]["status_details"]["reason"] for d in done] == ["turn_detected"]
    b.audio(800)
    assert b.transport.played == []

    # a reply the client asked for is not the turn's: it plays
    b.link.calls.clear()
    b.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_2", -1))
    assert b.link.calls == [] and b.session.reply.response_id == "resp_2"


class Overlapping(Bound):
    """A WebRTC-like session under the provisional policy whose agent is speaking."""

    def __init__(
        self, min_speech_ms: int = 0, turn_models: Any = None, policy: str = "provisional"
    ) -> None:
        from gateway.protocol import TurnDetection
        from stages.messages import ResponseStarted

        self.link, self.transport = RecordingLink(), RecordingTransport()
        self.transport.kind, self.transport.holds_audio = "webrtc", True
        self.metrics = GatewayMetrics()
        turns = TurnsConfig(
            prepare_reply_ms=0,
            interruptions={"policy": policy, "min_speech_ms": min_speech_ms},
            end_of_turn={"ask_after_ms": 120},
        )
        td = TurnDetection(type="semantic_vad" if turn_models else "server_vad")
        self.session = RealtimeSession(
            "sess_p",
            self.link,
            1,
            22050,
            self.metrics,
            SessionConfig(voice="v", turn_detection=td, omni_events=True),
            print,
            turns=turns,
            turn_models=turn_models,
        )
        self.session.bind(self.transport)
        self.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_1", -1))
        self.audio(2205)

    def speak(self, pcm: np.ndarray) -> None:
        for start in range(0, len(pcm) - 319, 320):
            self.session.feed_audio(pcm[start : start + 320])

    def called(self, name: str) -> list[tuple[Any, ...]]:
        return [args for called, args in self.link.calls if called == name]

    def types(self) -> list[str]:
        return [e["type"] for e in self.transport.events]


def test_a_provisional_turn_pauses_the_agent_and_a_backchannel_resumes_it(make_speech) -> None:
    o = Overlapping()
    o.speak(np.concatenate([make_speech("mm hmm").pcm16, np.zeros(16000, np.int16)]))
    turn = o.session.turns.turn_id
    assert o.transport.holds[-1] is True and o.called("cancel") == []
    # its end goes to the stages as provisional, not to be answered, and is not committed
    (stopped,) = o.called("speech_stopped")
    assert stopped[1] == turn and stopped[3] is False
    assert "input_audio_buffer.committed" not in o.types()
    o.session.on_stage_event(transcript(turn, "Mm-hmm.", final=True))
    assert o.transport.holds[-1] is False  # the agent plays on
    assert o.called("cancel") == [] and o.session.reply.response_id == "resp_1"
    assert "omni.interruption.resumed" in o.types()
    assert "input_audio_buffer.committed" not in o.types()
    assert [item.role for item in o.session.items] == ["assistant"]


def test_words_that_count_cut_the_paused_reply_and_are_answered(make_speech) -> None:
    o = Overlapping()
    o.speak(np.concatenate([make_speech("what time is it").pcm16, np.zeros(16000, np.int16)]))
    turn = o.session.turns.turn_id
    o.session.on_stage_event(transcript(turn, "What time is it?", final=True))
    (cancel,) = o.called("cancel")
    assert cancel[1] == "resp_1"  # the paused reply, with what the caller heard of it
    assert o.session.reply is None
    (created,) = o.called("create_response")
    assert "input_audio_buffer.committed" in o.types()
    assert [item.role for item in o.session.items] == ["assistant", "user"]
    assert o.session.replies.created.keys() == {created[1]}


def test_words_too_short_to_count_do_not_interrupt(make_speech) -> None:
    o = Overlapping(min_speech_ms=5000)
    o.speak(np.concatenate([make_speech("what time is it").pcm16, np.zeros(16000, np.int16)]))
    o.session.on_stage_event(transcript(o.session.turns.turn_id, "What time is it?", final=True))
    assert o.called("cancel") == [] and "omni.interruption.resumed" in o.types()


def test_speech_that_goes_on_interrupts_and_its_turn_is_begun_again(make_speech) -> None:
    o = Overlapping()
    o.session.turns.confirm_ms = 400
    o.speak(make_speech("please stop talking I have a much longer question for you").pcm16)
    assert len(o.called("cancel")) == 1
    starts = o.called("speech_started")
    assert len(starts) == 2 and starts[1][1] == starts[0][1] + 1  # the turn again, anew
    assert o.session.turns.provisional == set()
    # its audio so far went to the encoder again after the cancel
    order = [c[0] for c in o.link.calls]
    assert order.index("cancel") < len(order) - 1 - order[::-1].index("speech_started")


def test_a_barge_in_tells_the_client_of_the_speech_before_what_it_did_to_the_reply(
    make_speech,
) -> None:
    """OpenAI's order: input_audio_buffer.speech_started, then the cut reply's events (LiveKit's
    interrupt() sends nothing otherwise), though the cut is decided first."""
    o = Overlapping(policy="immediate")
    o.speak(make_speech("stop please").pcm16)
    assert len(o.called("cancel")) == 1
    types = o.types()
    started = types.index("input_audio_buffer.speech_started")
    assert started < types.index("conversation.item.truncated")
    assert started < types.index("response.done")


def test_a_websocket_client_gets_no_truncation_it_did_not_ask_for() -> None:
    """Over a WebSocket the client played the audio and truncates the item itself (pipecat,
    LiveKit): a barge-in cancels the reply and leaves the truncation to it, so its own
    truncate is answered by the one conversation.item.truncated."""
    from stages.messages import Phrase, ResponseStarted

    b = Bound()  # a WebSocket transport
    b.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_1", 1))
    b.stage("vocoder", Kind.PHRASE, Phrase("resp_1", "One two three", 22050, 0))
    b.audio(22050)
    stop.cut(b.session.replies, b.session.cancels, "barge_in", b.session.log)
    types = [e["type"] for e in b.transport.events]
    assert "response.done" in types and "conversation.item.truncated" not in types
    (done,) = [e for e in b.transport.events if e["type"] == "response.done"]
    item_id = done["response"]["output"][0]["id"]
    truncate = {"type": "conversation.item.truncate", "item_id": item_id, "audio_end_ms": 400}
    b.session.on_client_message(json.dumps(truncate))
    truncated = [e for e in b.transport.events if e["type"] == "conversation.item.truncated"]
    assert [t["audio_end_ms"] for t in truncated] == [400]


def test_a_clients_truncate_after_the_gateways_own_is_answered_once_and_cuts_no_further() -> None:
    """Over WebRTC the gateway played the audio and truncates the item itself at a barge-in,
    as OpenAI does. A client that truncates too (at what it estimates it heard, often later)
    gets its truncate answered with the truncation that stands, not a second, longer one; one
    that truncates earlier cuts the item further."""
    from stages.messages import Phrase, ResponseStarted

    b = Bound()
    b.transport.kind = "webrtc"
    b.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_1", 1))
    b.stage("vocoder", Kind.PHRASE, Phrase("resp_1", "One two three four", 22050, 0))
    b.audio(22050)  # a second made; the caller heard what the transport played
    stop.cut(b.session.replies, b.session.cancels, "barge_in", b.session.log, 11025)

    def truncated() -> list[int]:
        return [
            e["audio_end_ms"]
            for e in b.transport.events
            if e["type"] == "conversation.item.truncated"
        ]

    assert truncated() == [500]
    (done,) = [e for e in b.transport.events if e["type"] == "response.done"]
    item_id = done["response"]["output"][0]["id"]

    def truncate(end_ms: int) -> None:
        event = {"type": "conversation.item.truncate", "item_id": item_id, "audio_end_ms": end_ms}
        b.session.on_client_message(json.dumps(event))

    truncate(900)  # later than the gateway's: the audio past 500 ms was never played
    assert truncated() == [500, 500]
    assert not [e for e in b.transport.events if e["type"] == "error"]
    truncate(300)  # earlier: the item is cut there
    assert truncated() == [500, 500, 300]
    item = b.session.items.get(item_id)
    assert item.content[0]["transcript"] == "One"  # 0.3 of its four words


BIG_APPENDS = """
import asyncio, base64, gc, json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_session_events import RecordingLink, RecordingTransport
from gateway.metrics import GatewayMetrics
from gateway.protocol import SessionConfig
from gateway.session import RealtimeSession

class Link(RecordingLink):
    def send_audio(self, session, pcm16):
        return True

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) // 1024

async def main():
    gc.disable()  # as in a gateway, where a full collection is rare: nothing waits for one
    pcm = (np.random.default_rng(0).standard_normal(24_000 * 150) * 3000).astype("<i2")
    event = json.dumps({"type": "input_audio_buffer.append",
                        "audio": base64.b64encode(pcm.tobytes()).decode()})
    metrics, kept = GatewayMetrics(), []
    for i in range(5):
        session = RealtimeSession(f"c{i}", Link(), i, 16_000, metrics,
                                  SessionConfig(voice="v"), on_closed=lambda c: None)
        session.bind(RecordingTransport())
        session.start()
        session.on_client_message(event)
        while session.intake.taking_in:  # a second of audio a turn of the loop
            await asyncio.sleep(0)
        await session.close("done")
        kept.append(session)  # held, as a closed session in a reference cycle would be
        if i == 0:
            first = rss_mb()
    print(rss_mb() - first)

asyncio.run(main())
"""


def test_closed_sessions_that_took_big_appends_hold_little_memory() -> None:
    """Five sessions each sent one 10 MB append (150 s of audio) and closed, and are not
    collected yet: the memory they hold grows by little (the resampler's buffers were sized
    to the whole append, ~100 MB a session)."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run(
        [sys.executable, "-c", BIG_APPENDS, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    grown_mb = int(out.stdout.split()[-1])
    assert grown_mb < 60, f"four more closed sessions hold {grown_mb} MB"


def test_a_stage_restart_fails_the_reply_being_made_and_frees_the_next_create() -> None:
    """stage_restarted: the reply being made ends failed, a response.create asked and not
    started is forgotten, and the next response.create is taken."""
    from stages.messages import Error, ResponseStarted

    link, transport = RecordingLink(), RecordingTransport()
    session = RealtimeSession(
        "c", link, 1, 16000, GatewayMetrics(), SessionConfig(voice="v"), lambda c: None, TURNS
    )
    session.bind(transport)
    session.on_client_message('{"type": "response.create"}')
    response_id = next(args[1] for name, args in link.calls if name == "create_response")
    started = ResponseStarted(response_id, -1, True, True)
    session.on_stage_event(Envelope("reasoning", Kind.RESPONSE_STARTED, 1, 0, 0, 0, started))
    session.on_client_message('{"type": "response.create"}')  # refused: one is being made
    lost = Error("vocoder", "stage_restarted", "the vocoder stage died")
    session.on_stage_event(Envelope("vocoder", Kind.ERROR, 1, 0, 0, 0, lost))
    types = [e["type"] for e in transport.events]
    done = [e for e in transport.events if e["type"] == "response.done"]
    assert [d["response"]["status"] for d in done] == ["failed"]
    assert done[0]["response"]["status_details"]["error"]["code"] == "stage_restarted"
    assert types.index("error") < types.index("response.done")
    session.on_client_message('{"type": "response.create"}')
    creates = [args for name, args in link.calls if name == "create_response"]
    assert len(creates) == 2  # the refused one never reached the stages; this one did


def _tool_session() -> tuple[RealtimeSession, RecordingTransport, RecordingLink]:
    config = SessionConfig(voice="v")
    config.apply({"tools": [{"type": "function", "name": "get_weather"}]})
    link = RecordingLink()
    session = RealtimeSession("sess_f", link, 1, 22050, GatewayMetrics(), config, print, TURNS)
    transport = RecordingTransport()
    session.bind(transport)
    return session, transport, link


async def test_a_reply_that_calls_functions_says_its_words_then_makes_its_calls() -> None:
    """Words before a call are the reply's message; each call is an output item of its own
    with its arguments streamed; a call the model got wrong is an error, not a call."""
    from stages.messages import (
        AudioDone,
        BadToolCall,
        ResponseDone,
        ResponseStarted,
        TextDelta,
        ToolArguments,
        ToolCall,
        ToolCallStarted,
    )

    session, transport, _ = _tool_session()

    def stage(kind: Kind, msg: Any) -> None:
        name = "vocoder" if kind is Kind.AUDIO_DONE else "reasoning"
        session.on_stage_event(Envelope(name, kind, 1, 0, 0, 0, msg))

    stage(Kind.RESPONSE_STARTED, ResponseStarted("resp_1", -1, tools=True))
    assert not [e for e in transport.events if e["type"] == "response.output_item.added"]
    stage(Kind.TEXT_DELTA, TextDelta("resp_1", "Let me check.", 0))
    stage(Kind.TOOL_CALL, ToolCallStarted("resp_1", 0, "call_a", "get_weather"))
    for delta in ('{"city": ', '"Paris"}'):
        stage(Kind.TOOL_ARGUMENTS, ToolArguments("resp_1", 0, delta))
    made = ToolCall("call_a", "get_weather", '{"city": "Paris"}')
    wrong = BadToolCall(1, "launch_rockets", "{}", "not one of the tools")
    stage(
        Kind.RESPONSE_DONE,
        ResponseDone("resp_1", "completed", "Let me check.", tool_calls=[made], bad_calls=[wrong]),
    )
    assert not [e for e in transport.events if e["type"] == "response.done"]  # audio to come
    stage(Kind.AUDIO_DONE, AudioDone("resp_1", "completed"))

    added = [e for e in transport.events if e["type"] == "response.output_item.added"]
    assert [(e["item"]["type"], e["output_index"]) for e in added] == [
        ("message", 0),
        ("function_call", 1),
    ]
    deltas = [e for e in transport.events if e["type"] == "response.function_call_arguments.delta"]
    assert "".join(e["delta"] for e in deltas) == made.arguments
    assert all(e["output_index"] == 1 and e["call_id"] == "call_a" for e in deltas)
    [done] = [e for e in transport.events if e["type"] == "response.function_call_arguments.done"]
    assert done["arguments"] == made.arguments and done["name"] == "get_weather"
    errors = [e["error"] for e in transport.events if e["type"] == "error"]
    assert [e["code"] for e in errors] == ["invalid_tool_call"]
    assert "launch_rockets" in errors[0]["message"]
    [response] = [e["response"] for e in transport.events if e["type"] == "response.done"]
    assert [(o["type"], o["status"]) for o in response["output"]] == [
        ("message", "completed"),
        ("function_call", "completed"),
    ]
    # the history the reasoning stage gets keeps the words and the call together
    [history] = [m for m in session.items.history() if m.role == "assistant"]
    assert history.text == "Let me check." and history.tool_calls == [made]


async def test_the_reply_after_the_calls_plays_after_their_words_and_a_barge_in_stops_both() -> (
    None
):
    from stages.messages import (
        AudioDone,
        ResponseDone,
        ResponseStarted,
        TextDelta,
        ToolCall,
        ToolCallStarted,
    )

    session, _, link = _tool_session()
    kinds = {ResponseStarted: Kind.RESPONSE_STARTED, TextDelta: Kind.TEXT_DELTA}
    kinds |= {ToolCallStarted: Kind.TOOL_CALL, ResponseDone: Kind.RESPONSE_DONE}

    def stage(msg: Any) -> None:
        kind = kinds.get(type(msg), Kind.AUDIO_DONE)
        session.on_stage_event(Envelope("reasoning", kind, 1, 0, 0, 0, msg))

    stage(ResponseStarted("resp_1", -1, tools=True))
    stage(TextDelta("resp_1", "Let me check.", 0))
    stage(ToolCallStarted("resp_1", 0, "call_a", "get_weather"))
    call = ToolCall("call_a", "get_weather", "{}")
    stage(ResponseDone("resp_1", "completed", "Let me check.", tool_calls=[call]))
    stage(AudioDone("resp_1", "completed"))
    first = session.replies.current  # made whole; its words still playing
    assert first is not None and first.state.value == "generated"
    session.on_client_message(
        '{"type": "conversation.item.create", "item": {"type": "function_call_output",'
        ' "call_id": "call_a", "output": "sunny"}}'
    )
    session.on_client_message('{"type": "response.create"}')
    assert session.replies.finishing is first and session.replies.current is None
    assert not [c for c in link.calls if c[0] == "cancel"]  # its words were not cut
    stop.cut(session.replies, session.cancels, "barge_in", session.log)
    assert session.replies.finishing is None and first.state.value == "cut"
    assert [c for c in link.calls if c[0] == "cancel"]
    assert not session.replies.created  # the follow-up the cancel purged is forgotten
    assert not session.replies.active()


class HeldEndOfTurn:
    """An end-of-turn model whose answers the test gives, when it chooses."""

    def __init__(self) -> None:
        self.asked: list[asyncio.Future[tuple[float, float]]] = []

    async def probability(self, audio: np.ndarray) -> tuple[float, float]:
        answer = asyncio.get_running_loop().create_future()
        self.asked.append(answer)
        return await answer


class SemanticModels:
    """gateway.turns.models.TurnModels with webrtcvad and `end_of_turn`."""

    def __init__(self, end_of_turn: HeldEndOfTurn) -> None:
        self.end_of_turn = end_of_turn

    def classifier(self, threshold: float) -> Any:
        from gateway.turns.classifiers import WebrtcClassifier

        return WebrtcClassifier(threshold)


def _spoken_part(make_speech, text: str) -> np.ndarray:
    pcm = make_speech(text).pcm16
    voiced = np.flatnonzero(np.abs(pcm) > 500)
    return pcm[voiced[0] : voiced[-1] + 1]


class SemanticCall:
    """A session under semantic_vad whose end-of-turn model the test answers."""

    def __init__(self, prepare_reply_ms: int = 0) -> None:
        from gateway.protocol import TurnDetection

        self.model, self.metrics = HeldEndOfTurn(), GatewayMetrics()
        self.link = RecordingLink()
        self.session = RealtimeSession(
            "sess_s",
            self.link,
            1,
            22050,
            self.metrics,
            SessionConfig(voice="v", turn_detection=TurnDetection(type="semantic_vad")),
            print,
            turns=TurnsConfig(
                prepare_reply_ms=prepare_reply_ms,
                interruptions={"policy": "immediate"},
                end_of_turn={"ask_after_ms": 120},
            ),
            turn_models=SemanticModels(self.model),
        )
        self.session.bind(RecordingTransport())
        self.detector = self.session.turns.detector

    async def feed(self, pcm: np.ndarray, until_voiced: bool = False) -> int:
        """Feed 20 ms frames, the session's tasks taking their turn after each, as on the
        loop; with `until_voiced`, stop after the first voiced one. Samples fed."""
        for start in range(0, len(pcm) - 319, 320):
            self.session.feed_audio(pcm[start : start + 320])
            await asyncio.sleep(0)
            if until_voiced and self.detector.voiced_run:
                return start + 320
        return len(pcm)

    def _decisions(self) -> dict[str, float]:
        samples = self.metrics.end_of_turn_decisions.collect()[0].samples
        return {s.labels["decision"]: s.value for s in samples if s.name.endswith("_total")}

    async def decision(self, answer: Any = None) -> str | None:
        """Give the pending question `answer` (p, or a callable that answers otherwise); the
        decision that followed, None if none did."""
        before = self._decisions()
        if callable(answer):
            answer()
        elif answer is not None:
            self.model.asked[-1].set_result((answer, 0.01))
        for _ in range(100):  # bounded: a decision is a few steps of the loop away
            await asyncio.sleep(0)
            after = self._decisions()
            if after != before:
                (decided,) = (d for d in after if after[d] != before.get(d, 0))
                return decided
        return None

    def stopped(self) -> int:
        return [name for name, _ in self.link.calls].count("speech_stopped")


async def test_semantic_vad_does_not_end_a_turn_when_the_caller_speaks_again(make_speech) -> None:
    """An end-of-turn answer that comes as the caller's voice returns, before the VAD has
    called it speech (onset_ms), does not end the turn: it would cut the caller off in the
    middle of their sentence. The next pause can end it."""
    c = SemanticCall()
    lead, gap = np.zeros(8000, np.int16), np.zeros(3200, np.int16)  # 0.5 s, then 200 ms
    first, second = _spoken_part(make_speech, "wait"), _spoken_part(make_speech, "stop now")
    await c.feed(np.concatenate([lead, first, gap]))
    assert c.detector.in_speech and len(c.model.asked) == 1  # asked once, 120 ms into the pause
    # the caller goes on: their voice is back for a frame, not yet speech to the VAD
    fed = await c.feed(second, until_voiced=True)
    assert c.detector.voiced_run > 0 and c.detector.silence_ms >= 200
    assert await c.decision(0.99) == "spoke_again"  # "finished", as the voice came back
    assert c.stopped() == 0 and c.detector.in_speech
    # the rest of the sentence, and a pause after it, which the next answer ends at once
    await c.feed(np.concatenate([second[fed:], np.zeros(4000, np.int16)]))
    assert len(c.model.asked) == 2 and c.detector.in_speech
    assert await c.decision(0.99) == "ended"
    assert c.stopped() == 1
    await c.session.close("done")


async def test_a_sure_sound_does_not_wait_for_the_words(make_speech) -> None:
    """With the words still to come (the encoder judges them on the transcript made at the
    prepare pause), a sound model sure of the end (end_of_turn_sure, 0.95) ends the turn at
    once; a less sure one waits for the words."""
    speech = np.concatenate([np.zeros(8000, np.int16), _spoken_part(make_speech, "wait")])
    for p, then in ((0.97, "ended"), (0.9, None)):
        c = SemanticCall(prepare_reply_ms=80)
        await c.feed(np.concatenate([speech, np.zeros(2800, np.int16)]))  # 175 ms of pause
        assert [name for name, _ in c.link.calls].count("turn_paused") == 1  # words asked for
        assert await c.decision(p) == then
        assert c.stopped() == (then == "ended")
        if then is None:  # the words come: a sentence's end, and the turn ends on both
            words = functools.partial(c.session.turns.words_judged, c.session.turns.turn_id, 0.5)
            assert await c.decision(words) == "ended"
            assert c.stopped() == 1
        await c.session.close("done")


async def test_semantic_vad_leaves_a_sound_over_the_agent_to_the_silence_window(
    make_speech,
) -> None:
    """A provisional turn is not put to the end-of-turn model: ended at a short pause, an
    interruption with pauses in it ("Wait, stop. What time is it?") would be cut into
    pieces, each too short to count, and the agent would play on between them."""
    model = HeldEndOfTurn()
    o = Overlapping(turn_models=SemanticModels(model))
    gap = np.zeros(6400, np.int16)  # 400 ms: past the model's pause, inside the window
    o.speak(np.concatenate([np.zeros(8000, np.int16), _spoken_part(make_speech, "wait"), gap]))
    for _ in range(10):  # a question the session asked would be put to the model by now
        await asyncio.sleep(0)
    turn = o.session.turns.turn_id
    assert turn in o.session.turns.provisional and o.session.turns.detector.in_speech
    assert model.asked == [] and o.called("speech_stopped") == []
    o.speak(np.zeros(3200, np.int16))  # the window, 500 ms, ends it
    ((_, stopped, *_),) = o.called("speech_stopped")
    assert stopped == turn and model.asked == []
    await o.session.close("done")


def test_a_failed_reply_ends_in_openais_shape_without_an_error_event() -> None:
    """The failure is the reply's: response.done says it (status_details.error), and no
    `error` event makes a client (pipecat) drop the session; nothing of the stage's exception
    reaches the client."""
    from stages.messages import Error, ResponseDone, ResponseStarted

    b = Bound(omni_events=False)
    b.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_1", 1))
    b.stage(
        "reasoning", Kind.RESPONSE_DONE, ResponseDone("resp_1", "failed", "", error="engine_dead")
    )
    (done,) = [e for e in b.transport.events if e["type"] == "response.done"]
    assert done["response"]["status"] == "failed"
    error = done["response"]["status_details"]["error"]
    assert error == {
        "type": "server_error",
        "code": "engine_dead",
        "message": "the reasoning engine stopped; it is restarting",
    }
    assert "error" not in [e["type"] for e in b.transport.events]
    # a stage's own error (not a reply's) is an `error` event, its exception text kept back
    b.stage("vocoder", Kind.ERROR, Error("vocoder", "synthesis_failed", "RuntimeError: CUDA oops"))
    (event,) = [e for e in b.transport.events if e["type"] == "error"]
    assert event["error"]["code"] == "synthesis_failed" and "oops" not in event["error"]["message"]
