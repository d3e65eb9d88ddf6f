"""gateway.session.spans: the span tree of a session's turns, replies and cancels, driven by
hand (a recording link and transport, stage records as envelopes) into an in-memory
exporter."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from gateway.config import TracingConfig
from gateway.metrics import GatewayMetrics
from gateway.protocol import SessionConfig
from gateway.session import RealtimeSession
from gateway.tracing import Tracing
from gateway.turns.detector import VadStart
from stages.envelope import Envelope
from stages.messages import (
    AudioDone,
    CancelAck,
    Kind,
    Phrase,
    ResponseDone,
    ResponseStarted,
    TextDelta,
    Transcript,
)
from tests.gateway.test_session_events import TURNS, RecordingLink, RecordingTransport

pytestmark = pytest.mark.timeout(60)

HOPS = ["vad", "encoder", "reasoning.first_token", "vocoder.first_audio", "playout"]


class Traced:
    """A session with tracing on, bound to a recording link and transport."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracing = Tracing(TracingConfig(), exporter=self.exporter)
        self.link, self.transport = RecordingLink(), RecordingTransport()
        self.session = RealtimeSession(
            "sess_tr",
            self.link,
            7,
            22050,
            GatewayMetrics(),
            SessionConfig(voice="v"),
            lambda call: None,
            turns=TURNS,
            tracing=self.tracing,
        )
        self.session.bind(self.transport)

    def stage(self, src: str, kind: Kind, msg: Any) -> int:
        """Feed a stage record stamped now; its stamp."""
        t_ns = time.monotonic_ns()
        self.session.on_stage_event(Envelope(src, kind, 7, 0, 0, t_ns, msg))
        return t_ns

    def audio(self, samples: int) -> None:
        self.stage("vocoder", Kind.AUDIO_OUT, np.ones(samples, np.int16).tobytes())

    def speak(self, pcm: np.ndarray) -> None:
        for start in range(0, len(pcm) - 319, 320):
            self.session.feed_audio(pcm[start : start + 320])

    def spans(self) -> list[ReadableSpan]:
        assert self.tracing.flush(5)
        return list(self.exporter.get_finished_spans())

    def mono(self, wall_ns: int | None) -> int:
        assert wall_ns is not None
        return wall_ns - self.tracing.offset_ns


def tree(spans: list[ReadableSpan]) -> dict[str, Any]:
    """{root name: [(child name, {attributes}), ...]} keyed by the roots' span ids."""
    by_id = {s.context.span_id: s for s in spans}
    children: dict[int, list[ReadableSpan]] = {}
    for s in spans:
        if s.parent is not None:
            assert s.parent.span_id in by_id, f"{s.name}'s parent was not exported"
            assert s.context.trace_id == s.parent.trace_id
            children.setdefault(s.parent.span_id, []).append(s)
    return {sid: sorted(children.get(sid, []), key=lambda c: c.start_time) for sid in by_id}


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def spoken_turn(t: Traced, make_speech) -> dict[str, int]:
    """The caller asks, the agent answers and is played to its end; the stamps fed."""
    t.speak(np.concatenate([make_speech("what time is it").pcm16, np.zeros(16000, np.int16)]))
    assert t.session.turns.turn_id == 1 and not t.session.turns.detector.in_speech
    stamps = {"transcript": t.stage("encoder", Kind.TRANSCRIPT, Transcript(1, "what time", True))}
    stamps["started"] = t.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted("resp_1", 1))
    first = TextDelta("resp_1", "It is ", 0, since_submit_ns=4_500_000)
    stamps["first_token"] = t.stage("reasoning", Kind.TEXT_DELTA, first)
    t.stage("vocoder", Kind.PHRASE, Phrase("resp_1", "It is noon.", 22050, 0))
    t.audio(2205)
    t.audio(2205)
    t.stage("reasoning", Kind.TEXT_DELTA, TextDelta("resp_1", "noon.", 1))
    t.stage("reasoning", Kind.RESPONSE_DONE, ResponseDone("resp_1", "completed", "It is noon."))
    t.stage("vocoder", Kind.AUDIO_DONE, AudioDone("resp_1", "completed"))
    stamps["first_audio"] = t.session.reply.first_audio_ns
    return stamps


def test_a_spoken_turn_is_a_root_with_one_child_per_hop_in_order(make_speech) -> None:
    t = Traced()
    stamps = spoken_turn(t, make_speech)
    # the hops end as they go; the turn once its reply is heard
    assert [s.name for s in t.spans()] == HOPS[:-1]
    t.session.playback_done("resp_1")
    spans = t.spans()
    (root,) = named(spans, "turn")
    assert root.parent is None
    hops = tree(spans)[root.context.span_id]
    assert [h.name for h in hops] == HOPS
    assert len(spans) == 1 + len(HOPS)
    vad, encoder, reasoning, vocoder, playout = hops
    # each hop ends where the next begins, from the VAD's onset to the end of the playout
    assert root.start_time == vad.start_time and root.end_time == playout.end_time
    assert vad.end_time == encoder.start_time
    assert reasoning.end_time == vocoder.start_time and vocoder.end_time == playout.start_time
    assert encoder.end_time <= reasoning.start_time
    for span in spans:
        assert span.start_time <= span.end_time
    # the stages' own stamps, on the wall clock by one offset
    assert t.mono(encoder.end_time) == stamps["transcript"]
    assert t.mono(reasoning.start_time) == stamps["started"]
    assert t.mono(reasoning.end_time) == stamps["first_token"]
    assert t.mono(vocoder.end_time) == stamps["first_audio"]
    assert abs(root.start_time - time.time_ns()) < 60e9  # wall time, not the monotonic clock

    attrs = root.attributes
    assert attrs["session.id"] == "sess_tr" and attrs["omni.pipeline.session"] == 7
    assert attrs["omni.turn.id"] == 1 and attrs["omni.response.id"] == "resp_1"
    assert attrs["omni.transport"] == "websocket"
    assert attrs["omni.turn_detection"] == "server_vad"
    assert attrs["omni.turn.outcome"] == "played"
    assert attrs["omni.response.status"] == "completed"
    assert attrs["omni.turn_latency_ms"] > 0 and attrs["omni.time_to_first_audio_ms"] > 0
    assert vad.attributes["omni.vad.silence_ms"] >= 500  # server_vad's silence_duration_ms
    assert encoder.attributes["omni.transcript.chars"] == len("what time")
    assert reasoning.attributes["omni.reasoning.since_submit_ms"] == 4.5
    assert playout.attributes["omni.playout.outcome"] == "played"
    assert playout.attributes["omni.audio_ms"] == 200
    assert root.status.status_code is StatusCode.UNSET


def test_a_barge_in_cuts_the_turn_and_its_cancel_has_a_child_per_stage_ack(make_speech) -> None:
    t = Traced()
    spoken_turn(t, make_speech)
    t.session.turns.speech_started(VadStart(4000, 4300, np.zeros(0, np.int16)))
    # the recording link's cancel id: its place in the calls, from 1
    cancel_id = next(i for i, (name, _) in enumerate(t.link.calls, 1) if name == "cancel")
    acks = {}
    for stage, kv in (("encoder", None), ("vocoder", None), ("reasoning", 0.25)):
        acks[stage] = time.monotonic_ns()  # when the stage had stopped
        t.stage(stage, Kind.CANCEL_ACK, CancelAck(cancel_id, stage, acks[stage], kv))
    spans = t.spans()
    (cut,) = [s for s in named(spans, "turn") if s.attributes["omni.turn.id"] == 1]
    assert cut.attributes["omni.turn.outcome"] == "cut"
    assert cut.attributes["omni.cut.reason"] == "barge_in"
    (playout,) = named(spans, "playout")
    assert playout.attributes["omni.playout.outcome"] == "cut"
    assert playout.attributes["omni.heard_ms"] == 0  # the recording transport played nothing
    (cancel,) = named(spans, "cancel")
    assert cancel.parent.span_id == cut.context.span_id  # under the turn whose reply it cut
    assert cancel.attributes["omni.cancel.reason"] == "barge_in"
    assert cancel.attributes["omni.response.id"] == "resp_1"
    children = tree(spans)[cancel.context.span_id]
    assert [c.name for c in children] == ["cancel.encoder", "cancel.vocoder", "cancel.reasoning"]
    for child in children:
        assert child.start_time == cancel.start_time
        stage = child.name.removeprefix("cancel.")
        assert t.mono(child.end_time) == acks[stage]
    assert children[2].attributes["omni.kv_usage"] == 0.25
    assert "omni.kv_usage" not in children[0].attributes
    assert cancel.end_time == max(c.end_time for c in children)
    assert cancel.attributes["omni.cancel.latency_ms"] > 0
    # the caller's new turn is open until the session closes
    assert [s.attributes["omni.turn.id"] for s in named(spans, "turn")] == [1]


async def test_what_is_open_when_the_session_closes_ends_then() -> None:
    t = Traced()
    t.session.turns.begin(0)  # turn 1: speaking
    t.session.turns.end(800, create_response=True)
    t.session.turns.begin(800)  # turn 2 begins before turn 1's transcript
    t.session.cancels.send("resp_x", "", "client_cancel")  # acknowledged by no stage
    await t.session.close("done")
    spans = t.spans()
    roots = {s.attributes["omni.turn.id"]: s for s in named(spans, "turn")}
    assert {n: r.attributes["omni.turn.outcome"] for n, r in roots.items()} == {
        1: "closed",
        2: "closed",
    }
    incomplete = {
        (s.name, s.parent.span_id == roots[n].context.span_id)
        for n in roots
        for s in spans
        if s.attributes.get("omni.incomplete")
    }
    assert ("encoder", True) in incomplete and ("vad", True) in incomplete
    (cancel,) = named(spans, "cancel")
    assert cancel.parent is None  # it cut no reply of this session's
    assert list(cancel.attributes["omni.cancel.unacknowledged"]) == [
        "encoder",
        "reasoning",
        "vocoder",
    ]


def test_turns_no_reply_answers_end_at_their_transcript() -> None:
    t = Traced()
    t.session.turns.begin(0)
    t.session.turns.end(900, create_response=True)
    t.stage("encoder", Kind.TRANSCRIPT, Transcript(1, "", True))  # nothing was said
    t.session.turns.begin(900)
    t.session.turns.end(1800, create_response=False)
    t.stage("encoder", Kind.TRANSCRIPT, Transcript(2, "hello", False))  # a partial: no end
    t.stage("encoder", Kind.TRANSCRIPT, Transcript(2, "hello there", True))
    t.session.turns.begin(1800)
    t.session.turns.end(2700, create_response=True)
    t.stage("encoder", Kind.TRANSCRIPT, Transcript(3, "and you", True))
    t.session.turns.speech_started(VadStart(3000, 3300, np.zeros(0, np.int16)))
    cancel_id = next(i for i, (name, _) in enumerate(t.link.calls, 1) if name == "cancel")
    for stage in ("encoder", "reasoning", "vocoder"):
        ack = CancelAck(cancel_id, stage, time.monotonic_ns())
        t.stage(stage, Kind.CANCEL_ACK, ack)
    spans = t.spans()
    outcomes = {
        s.attributes["omni.turn.id"]: s.attributes["omni.turn.outcome"]
        for s in named(spans, "turn")
    }
    # turn 3's reply was cancelled before it started, as the caller spoke again
    assert outcomes == {1: "no_speech", 2: "no_reply", 3: "unanswered"}
    (cancel,) = named(spans, "cancel")
    assert cancel.parent is None and "omni.response.id" not in cancel.attributes
    assert len(named(spans, "encoder")) == 3 and len(named(spans, "vad")) == 3


def test_a_reply_asked_by_name_is_a_turn_of_its_own_and_a_failure_is_an_error() -> None:
    t = Traced()
    t.session.on_client_message(json.dumps({"type": "response.create"}))
    (created,) = [args for name, args in t.link.calls if name == "create_response"]
    response_id = created[1]
    asked = time.monotonic_ns()
    t.stage("reasoning", Kind.RESPONSE_STARTED, ResponseStarted(response_id, -1, audio=False))
    t.stage("reasoning", Kind.TEXT_DELTA, TextDelta(response_id, "Hel", 0, 1_000_000))
    t.stage("reasoning", Kind.RESPONSE_DONE, ResponseDone(response_id, "failed", "Hel"))
    spans = t.spans()
    (root,) = named(spans, "turn")
    assert root.attributes["omni.turn.source"] == "response.create"
    assert "omni.turn.id" not in root.attributes
    assert root.attributes["omni.turn.outcome"] == "sent"
    assert root.attributes["omni.response.status"] == "failed"
    assert root.status.status_code is StatusCode.ERROR
    assert t.mono(root.start_time) <= asked  # from the ask, before the stages started it
    assert [h.name for h in tree(spans)[root.context.span_id]] == ["reasoning.first_token"]


def test_tracing_off_the_session_marks_nothing() -> None:
    from gateway.session.spans import NO_SPANS

    session = RealtimeSession(
        "sess_off", RecordingLink(), 1, 22050, GatewayMetrics(), SessionConfig(voice="v"), print
    )
    assert session.spans is NO_SPANS
    assert session.turns.spans is session.replies.spans is session.cancels.spans is NO_SPANS
