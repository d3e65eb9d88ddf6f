"""gateway.session on its own, with a stand-in for the rings: the events a client sees."""

from __future__ import annotations

from typing import Any

import numpy as np

from gateway.metrics import GatewayMetrics
from gateway.protocol import SessionConfig
from gateway.session import ActiveResponse, RealtimeSession
from stages.link import StageEvent
from stages.messages import Kind, Transcript


class RecordingLink:
    """Takes what the session would push into the rings."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((name, args)) or 0


class RecordingTransport:
    kind = "websocket"

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.holds: list[bool] = []

    def send_event(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def play(self, response: ActiveResponse, pcm: np.ndarray) -> None: ...
    def finish(self, response: ActiveResponse) -> None: ...
    def clear(self) -> None: ...
    def hold(self, held: bool) -> None:
        self.holds.append(held)

    def heard_samples(self, response: ActiveResponse) -> int:
        return 0

    async def close(self) -> None: ...


def transcript(turn: int, text: str, final: bool) -> StageEvent:
    return StageEvent("encoder", 1, Kind.TRANSCRIPT, 0, 0, 0, Transcript(turn, text, final))


def test_partial_transcripts_become_additive_deltas() -> None:
    session = RealtimeSession(
        "sess_t", RecordingLink(), 1, 22050, GatewayMetrics(), SessionConfig(voice="v"), print
    )
    transport = RecordingTransport()
    session.bind(transport)
    session._begin_turn(0)
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

    session._begin_turn(0)
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
            hold_on_voice=hold_on_voice,
        )
        transport = RecordingTransport()
        session.bind(transport)
        session.response = object()  # the agent is speaking
        for start in range(0, len(speech), 320):
            session.feed_audio(speech[start : start + 320])
            if session.vad.voiced_run:
                break  # the first voiced frame, before any barge-in is decided
        if not hold_on_voice:
            assert not any(transport.holds)
            continue
        assert transport.holds[-1] and not session.vad.in_speech
        assert session.vad.voiced_run < session.vad._onset_frames
        session.feed_audio(np.zeros(320, np.int16))  # a false start: the agent plays on
        assert transport.holds[-1] is False


def test_a_reply_whose_audio_ends_before_its_text_arrives_is_finished_once_with_all_of_it() -> None:
    """AUDIO_DONE (the vocoder's ring) may be read before the last TEXT_DELTA and RESPONSE_DONE
    (reasoning's ring): response.done waits for the text, and comes once."""
    from stages.messages import AudioDone, ResponseDone, ResponseStarted, TextDelta

    session = RealtimeSession(
        "sess_t", RecordingLink(), 1, 22050, GatewayMetrics(), SessionConfig(voice="v"), print
    )
    transport = RecordingTransport()
    session.bind(transport)

    def stage(name: str, kind: Kind, msg: Any) -> None:
        session.on_stage_event(StageEvent(name, 1, kind, 0, 0, 0, msg))

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
