"""The session's way to its client: the transport, the events queued until one is bound, and
one method for each OpenAI Realtime (GA) server event the session sends, so that each event's
shape is written once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from gateway import events as ev
from gateway.conversation import Item
from gateway.protocol import SessionConfig
from gateway.session.reply import Reply


class Transport(Protocol):
    """How a session's audio and events reach the client (gateway.webrtc, gateway.websocket)."""

    kind: str  # "webrtc", "websocket" or "twilio"
    holds_audio: bool  # the agent's audio plays out from here: it can be paused, nothing lost
    played_rate: int  # the rate of what it places in `session.played` (the echo's far end)

    def send_event(self, event: dict[str, Any]) -> None: ...

    def play(self, reply: Reply, pcm: np.ndarray) -> None:
        """Agent audio at the vocoder's rate, as it is synthesized."""

    def audio_end(self, reply: Reply) -> None:
        """The reply's last audio came: pass on what a coder still holds of it now, before
        `response.output_audio.done` (nothing of a reply may follow its end)."""

    def finish(self, reply: Reply) -> None:
        """All of the reply's audio was handed over; call `session.playback_done(id)` once
        the client has (or will have) played it."""

    def clear(self) -> None:
        """Drop every queued sample now (barge-in)."""

    def hold(self, held: bool) -> None:
        """Pause (True) or go on with (False) the agent's audio, dropping nothing: the caller
        may be starting to talk over it."""

    def heard_samples(self, reply: Reply) -> int:
        """How much of the reply's audio (at the vocoder's rate) the caller has heard."""

    async def close(self) -> None: ...


def _where(reply: Reply) -> dict[str, Any]:
    """Where the reply's message is."""
    assert reply.item is not None
    return {
        "response_id": reply.response_id,
        "item_id": reply.item.id,
        "output_index": reply.output_index(reply.item),
        "content_index": 0,
    }


def _call(reply: Reply, item: Item) -> dict[str, Any]:
    """Where one of the reply's calls is."""
    return {
        "response_id": reply.response_id,
        "item_id": item.id,
        "output_index": reply.output_index(item),
    }


def _part(reply: Reply, text: str) -> dict[str, Any]:
    return {"type": "audio", "transcript": text} if reply.audio else {"type": "text", "text": text}


class Outbox:
    """Events to the client, in order; those sent before a transport is bound go out when it
    is, and none after the session closed."""

    def __init__(self, call_id: str, config: SessionConfig) -> None:
        self.call_id = call_id
        self.config = config  # the session's: whether omni.* events go out too
        self.transport: Transport | None = None
        self.closed = False
        self._pending: list[dict[str, Any]] = []
        self._held: list[dict[str, Any]] | None = None  # while `holding`

    def bind(self, transport: Transport) -> None:
        self.transport = transport
        pending, self._pending = self._pending, []
        for event in pending:
            transport.send_event(event)

    @contextlib.contextmanager
    def holding(self) -> Iterator[list[dict[str, Any]]]:
        """The events sent inside are kept in the list it gives, for `send_all` later: a
        barge-in's cut is decided before its turn's speech_started exists, and a client reads
        them in OpenAI's order, speech_started first."""
        held: list[dict[str, Any]] = []
        self._held = held
        try:
            yield held
        finally:
            self._held = None

    def send_all(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            self.send(event)

    def send(self, event: dict[str, Any]) -> None:
        if self.closed or (not self.config.omni_events and event["type"].startswith("omni.")):
            return
        if self._held is not None:
            self._held.append(event)
            return
        if self.transport is None:
            self._pending.append(event)
        else:
            self.transport.send_event(event)

    # -- session -----------------------------------------------------------------------------

    def session_created(self, config: SessionConfig) -> None:
        self.send(ev.event("session.created", session=config.to_json(self.call_id)))

    def session_updated(self, config: SessionConfig) -> None:
        self.send(ev.event("session.updated", session=config.to_json(self.call_id)))

    def error(
        self,
        message: str,
        *,
        code: str,
        param: str | None = None,
        event_id: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        self.send(ev.error(message, code=code, param=param, event_id=event_id, type_=type_))

    # -- the caller's audio and turns ----------------------------------------------------------

    def speech_started(self, audio_start_ms: int, item_id: str) -> None:
        self.send(
            ev.event(
                "input_audio_buffer.speech_started",
                audio_start_ms=audio_start_ms,
                item_id=item_id,
            )
        )

    def speech_stopped(self, audio_end_ms: int, item_id: str) -> None:
        self.send(
            ev.event(
                "input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms, item_id=item_id
            )
        )

    def committed(self, item_id: str, previous: str | None) -> None:
        self.send(
            ev.event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous)
        )

    def timeout_triggered(self, audio_start_ms: int, audio_end_ms: int, item_id: str) -> None:
        """input_audio_buffer.timeout_triggered: the caller said nothing for idle_timeout_ms
        after the agent's last reply was heard."""
        self.send(
            ev.event(
                "input_audio_buffer.timeout_triggered",
                audio_start_ms=audio_start_ms,
                audio_end_ms=audio_end_ms,
                item_id=item_id,
            )
        )

    def interruption_resumed(self, response_id: str, item_id: str, transcript: str) -> None:
        """omni.interruption.resumed: the caller's sound over the agent was no interruption
        (no words, or only backchannels); the agent plays on from where it paused."""
        self.send(
            ev.event(
                "omni.interruption.resumed",
                response_id=response_id,
                item_id=item_id,
                transcript=transcript,
            )
        )

    def buffer_cleared(self) -> None:
        self.send(ev.event("input_audio_buffer.cleared"))

    def transcription(self, name: str, item_id: str, **fields: str) -> None:
        """conversation.item.input_audio_transcription.delta or .completed."""
        self.send(
            ev.event(
                f"conversation.item.input_audio_transcription.{name}",
                item_id=item_id,
                content_index=0,
                **fields,
            )
        )

    # -- the conversation ----------------------------------------------------------------------

    def item_added(self, item: Item, previous: str | None) -> None:
        self.send(
            ev.event("conversation.item.added", previous_item_id=previous, item=item.to_json())
        )

    def item_done(self, item: Item) -> None:
        self.send(ev.event("conversation.item.done", item=item.to_json()))

    def item_retrieved(self, item: Item) -> None:
        self.send(ev.event("conversation.item.retrieved", item=item.to_json()))

    def item_deleted(self, item_id: str) -> None:
        self.send(ev.event("conversation.item.deleted", item_id=item_id))

    def item_truncated(self, item_id: str, audio_end_ms: int) -> None:
        self.send(
            ev.event(
                "conversation.item.truncated",
                item_id=item_id,
                content_index=0,
                audio_end_ms=audio_end_ms,
            )
        )

    # -- a reply --------------------------------------------------------------------------------

    def response_created(self, reply: Reply) -> None:
        assert reply.response_id is not None
        response = ev.response_obj(
            reply.response_id, "in_progress", audio=reply.audio, metadata=reply.metadata
        )
        self.send(ev.event("response.created", response=response))

    def output_item_added(self, reply: Reply, item: Item) -> None:
        self._output_item("added", reply, item)

    def content_part_added(self, reply: Reply) -> None:
        self.send(ev.event("response.content_part.added", **_where(reply), part=_part(reply, "")))

    def text_delta(self, reply: Reply, text: str) -> None:
        """response.output_audio_transcript.delta, or output_text.delta for a text reply."""
        name = "output_audio_transcript" if reply.audio else "output_text"
        self.send(ev.event(f"response.{name}.delta", **_where(reply), delta=text))

    def audio_transcript_done(self, reply: Reply) -> None:
        self.send(
            ev.event(
                "response.output_audio_transcript.done", **_where(reply), transcript=reply.text
            )
        )

    def output_text_done(self, reply: Reply) -> None:
        self.send(ev.event("response.output_text.done", **_where(reply), text=reply.text))

    def output_audio_delta(self, reply: Reply, payload: str) -> None:
        """One piece of audio over a WebSocket, base64."""
        self.send(ev.event("response.output_audio.delta", **_where(reply), delta=payload))

    def output_audio_done(self, reply: Reply) -> None:
        self.send(ev.event("response.output_audio.done", **_where(reply)))

    def content_part_done(self, reply: Reply) -> None:
        self.send(
            ev.event("response.content_part.done", **_where(reply), part=_part(reply, reply.text))
        )

    def output_item_done(self, reply: Reply, item: Item) -> None:
        self._output_item("done", reply, item)

    def _output_item(self, name: str, reply: Reply, item: Item) -> None:
        self.send(
            ev.event(
                f"response.output_item.{name}",
                response_id=reply.response_id,
                output_index=reply.output_index(item),
                item=item.to_json(),
            )
        )

    # -- a reply's calls -------------------------------------------------------------------

    def function_arguments_delta(self, reply: Reply, item: Item, delta: str) -> None:
        self.send(
            ev.event(
                "response.function_call_arguments.delta",
                **_call(reply, item),
                call_id=item.fields["call_id"],
                delta=delta,
            )
        )

    def function_arguments_done(self, reply: Reply, item: Item) -> None:
        self.send(
            ev.event(
                "response.function_call_arguments.done",
                **_call(reply, item),
                call_id=item.fields["call_id"],
                name=item.fields["name"],
                arguments=item.fields["arguments"],
            )
        )

    def mcp_arguments_delta(self, reply: Reply, item: Item, delta: str) -> None:
        self.send(ev.event("response.mcp_call_arguments.delta", **_call(reply, item), delta=delta))

    def mcp_arguments_done(self, reply: Reply, item: Item) -> None:
        self.send(
            ev.event(
                "response.mcp_call_arguments.done",
                **_call(reply, item),
                arguments=item.fields["arguments"],
            )
        )

    def mcp_call(self, name: str, reply: Reply, item: Item) -> None:
        """response.mcp_call.in_progress, .completed or .failed."""
        self.send(
            ev.event(
                f"response.mcp_call.{name}",
                item_id=item.id,
                output_index=reply.output_index(item),
            )
        )

    def mcp_list_tools(self, name: str, item_id: str) -> None:
        """mcp_list_tools.in_progress, .completed or .failed."""
        self.send(ev.event(f"mcp_list_tools.{name}", item_id=item_id))

    def response_done(
        self, reply: Reply, status: str, details: dict[str, Any] | None = None
    ) -> None:
        """response.done, and the rate_limits.updated that follows each."""
        assert reply.response_id is not None
        response = ev.response_obj(
            reply.response_id,
            status,
            audio=reply.audio,
            output=[item.to_json() for item in reply.outputs],
            status_details=details,
            metadata=reply.metadata,
            usage=reply.usage or ev.usage(),
        )
        self.send(ev.event("response.done", response=response))
        self.send(ev.rate_limits())

    def first_audio(self, reply: Reply, turn_ms: float | None, first_ms: float) -> None:
        """omni.response.first_audio: the reply's first audio went to the transport."""
        self.send(
            ev.event(
                "omni.response.first_audio",
                response_id=reply.response_id,
                turn_latency_ms=None if turn_ms is None else round(turn_ms, 1),
                time_to_first_audio_ms=round(first_ms, 1),
            )
        )

    def response_cancelled(
        self,
        response_id: str,
        latency_ms: float,
        stages_ms: dict[str, float],
        kv_usage: dict[str, float],
    ) -> None:
        """omni.response.cancelled: every stage acknowledged the reply's cancel. `kv_usage`:
        per stage with a vLLM engine, its KV usage after the abort; `kv_cache_usage` is the
        reasoning engine's."""
        self.send(
            ev.event(
                "omni.response.cancelled",
                response_id=response_id,
                cancel_latency_ms=latency_ms,
                stages_ms=stages_ms,
                kv_cache_usage=kv_usage.get("reasoning"),
                kv_cache_usage_by_stage=kv_usage,
            )
        )

    # -- the audio the client plays (WebRTC) ---------------------------------------------------

    def output_buffer_started(self, response_id: str) -> None:
        self.send(ev.event("output_audio_buffer.started", response_id=response_id))

    def output_buffer_stopped(self, response_id: str) -> None:
        self.send(ev.event("output_audio_buffer.stopped", response_id=response_id))

    def output_buffer_cleared(self, response_id: str) -> None:
        self.send(ev.event("output_audio_buffer.cleared", response_id=response_id))
