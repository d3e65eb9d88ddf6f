"""The client events a session takes, one handler each: `HANDLERS` is the table, `dispatch`
parses one message and turns every failure into an `error` event, so that one bad event never
takes the session down."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from gateway.conversation import item_from_client
from gateway.json_input import parse_json
from gateway.protocol import ProtocolError, parse_response_create
from gateway.session import stop

if TYPE_CHECKING:
    from gateway.conversation import Conversation
    from gateway.prompt_limit import PromptLimit
    from gateway.protocol import ResponseParams, SessionConfig
    from gateway.session.intake import Intake
    from gateway.session.outbox import Outbox, Transport
    from gateway.session.replies import Replies
    from gateway.session.reply import Reply
    from gateway.session.stop import Cancels
    from gateway.session.tool_use import SessionTools
    from gateway.session.turns import CallerTurns
    from gateway.turns.models import TurnModels

MAX_EVENT_BYTES = 16 * 1024 * 1024  # input_audio_buffer.append carries up to 15 MiB of base64


class Session(Protocol):
    """What the handlers reach of a session (gateway.session.call.RealtimeSession)."""

    config: SessionConfig
    outbox: Outbox
    items: Conversation
    turns: CallerTurns
    intake: Intake
    replies: Replies
    cancels: Cancels
    tools: SessionTools
    turn_models: TurnModels | None
    prompt_limit: PromptLimit | None
    log: logging.LoggerAdapter[Any]
    vocoder_rate: int
    deferred_create: tuple[ResponseParams, str | None] | None

    @property
    def transport(self) -> Transport | None: ...

    @property
    def reply(self) -> Reply | None: ...

    def apply_settings(self) -> None: ...

    def sync_history(self) -> None: ...

    def create_response(self, params: ResponseParams, event_id: str | None) -> None: ...


Handler = Callable[[Session, dict[str, Any], "str | None"], None]


def dispatch(session: Session, message: Any) -> None:
    """One client event as received (JSON text)."""
    out = session.outbox
    if isinstance(message, bytes) or len(message) > MAX_EVENT_BYTES:
        out.error("events must be JSON text of at most 16 MiB", code="invalid_event")
        return
    try:
        data = parse_json(message, "the event")
    except ProtocolError as exc:
        out.error(str(exc), code=exc.code)
        return
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        out.error("an event is a JSON object with a string 'type'", code="invalid_event")
        return
    event_id = data.get("event_id") if isinstance(data.get("event_id"), str) else None
    handler = HANDLERS.get(data["type"])
    try:
        if handler is None:
            raise ProtocolError(
                f"unknown or unsupported event type {data['type']!r}",
                param="type",
                code="unknown_event",
            )
        handler(session, data, event_id)
    except ProtocolError as exc:
        out.error(str(exc), code=exc.code, param=exc.param, event_id=event_id)
    except Exception as exc:  # one bad event must never take the session down
        session.log.exception("handling %s failed", data["type"])
        out.error(
            f"{type(exc).__name__}: {exc}",
            code="internal_error",
            type_="server_error",
            event_id=event_id,
        )


def session_update(session: Session, data: dict[str, Any], event_id: str | None) -> None:
    had_vad = session.config.turn_detection is not None
    new = session.config.updated(data.get("session"))
    if session.turn_models is not None:  # semantic_vad needs the end-of-turn model
        session.turn_models.check(new)
    session.tools.check(new.tools)  # MCP servers the gateway may reach
    if session.prompt_limit is not None:  # instructions and tools that leave room for replies
        session.prompt_limit.check(new)
    session.config.apply(data.get("session"))
    session.turns.reconfigure(had_vad)
    session.configure_audio()  # noise_reduction
    session.apply_settings()
    session.outbox.session_updated(session.config)
    session.tools.sync(session.config.tools)  # then mcp_list_tools.* for new MCP servers


def buffer_append(session: Session, data: dict[str, Any], event_id: str | None) -> None:
    if session.transport is not None and session.transport.kind == "webrtc":
        raise ProtocolError(
            "on a WebRTC call the caller's audio comes over its media track",
            param="type",
            code="unsupported",
        )
    session.intake.append(data.get("audio"))


def buffer_commit(session: Session, data: dict[str, Any], event_id: str | None) -> None:
    session.turns.commit()


def buffer_clear(session: Session, data: dict[str, Any], event_id: str | None) -> None:
    session.turns.clear()


def item_create(session: Session, data: dict[str, Any], event_id: str | None) -> None:
    item = item_from_client(data.get("item"), session.items)
    previous = data.get("previous_item_id")
    if previous is not None and not isinstance(previous, str):
        raise ProtocolError("previous_item_id must be a string", param="previous_item_id")
    before = session.items.add(item, previous)
    session.sync_history()
    if item.type == "function_call_output":
        session.tools.output_came(item.fields["call_id"])
    session.outbox.item_added(item, before)
    session.outbox.item_done(item)


def item_retrieve(session: Session, data: dict[str, Any], event_id: str | None) -> None:
    session.outbox.item_retrieved(session.items.get(data.get("item_id")))


def item_delete(session: Session, data: dict[str, Any], event_id: str | None) -> None:
    item = session.items.get(data.get("item_id"))
    reply = session.reply
    if reply is not None and item in reply.outputs:
        raise ProtocolError(
            "the item is being generated: cancel the response first", param="item_id"
        )
    session.items.delete(item.id)
    session.sync_history()
    session.outbox.item_deleted(item.id)


def item_truncate(session: Session, data: dict[str, Any], event_id: str | None) -> None:
    """Cut an assistant audio item to what the client played (`audio_end_ms`)."""
    item = session.items.get(data.get("item_id"))
    audio = item.type == "message" and item.content and item.content[0].get("type")
    if item.role != "assistant" or audio != "output_audio":
        raise ProtocolError("only an assistant audio item can be truncated", param="item_id")
    if data.get("content_index", 0) != 0:
        raise ProtocolError("content_index must be 0", param="content_index")
    end_ms = data.get("audio_end_ms")
    if isinstance(end_ms, bool) or not isinstance(end_ms, int) or end_ms < 0:
        raise ProtocolError("audio_end_ms must be an integer >= 0", param="audio_end_ms")
    reply = session.reply if session.reply and session.reply.item is item else None
    tracker = reply.tracker if reply else session.replies.trackers.get(item.id)
    if tracker is None:
        raise ProtocolError("the item has no audio to truncate", param="item_id")
    rate = session.vocoder_rate
    length_ms = tracker.samples * 1000 // rate
    if end_ms > length_ms and (reply is None or not reply.in_progress):
        raise ProtocolError(
            f"audio_end_ms {end_ms} is beyond the item's audio ({length_ms} ms)",
            param="audio_end_ms",
        )
    played = end_ms * rate // 1000
    if reply is not None:
        # a reply still being made or played: stop it there; the cut announces the
        # truncation and its cancel carries the heard text to the reasoning stage
        stop.cut(session.replies, session.cancels, "client_truncate", session.log, played)
        return
    if tracker.truncated_at is not None and played >= tracker.truncated_at:
        # cut already, where the gateway stopped playing it (WebRTC), or by an earlier
        # truncate: the truncation that stands answers this one
        session.outbox.item_truncated(item.id, tracker.truncated_at * 1000 // rate)
        return
    tracker.truncated_at = played
    content = item.content[0]
    content["transcript"] = tracker.heard(played, content.get("transcript"))
    session.sync_history()
    session.outbox.item_truncated(item.id, end_ms)


def response_create(session: Session, data: dict[str, Any], event_id: str | None) -> None:
    params = parse_response_create(data.get("response"), session.config)
    if session.replies.active() or session.deferred_create is not None:
        raise ProtocolError(
            "a response is in progress: cancel it first, or wait for response.done",
            code="conversation_already_has_active_response",
        )
    if session.turns.transcribing:
        session.deferred_create = (params, event_id)  # sent once the turn's text is known
        return
    session.create_response(params, event_id)


def response_cancel(session: Session, data: dict[str, Any], event_id: str | None) -> None:
    wanted = data.get("response_id")
    reply = session.reply
    if reply is None or not reply.in_progress:
        # OpenAI's words: clients match them (LiveKit Agents ignores "Cancellation failed"
        # errors, which a cancel racing a reply's end gets)
        raise ProtocolError(
            "Cancellation failed: no active response found", code="response_cancel_not_active"
        )
    if wanted is not None and wanted != reply.response_id:
        raise ProtocolError(
            f"response {wanted!r} is not in progress", param="response_id", code="not_found"
        )
    stop.cut(session.replies, session.cancels, "client_cancel", session.log)


def output_clear(session: Session, data: dict[str, Any], event_id: str | None) -> None:
    if session.transport is not None and session.transport.kind != "webrtc":
        raise ProtocolError(
            "output_audio_buffer.clear is for WebRTC calls; over a WebSocket the client "
            "holds the audio (use response.cancel and conversation.item.truncate)",
            param="type",
            code="unsupported",
        )
    stop.cut(session.replies, session.cancels, "client_clear", session.log)


HANDLERS: dict[str, Handler] = {
    "session.update": session_update,
    "input_audio_buffer.append": buffer_append,
    "input_audio_buffer.commit": buffer_commit,
    "input_audio_buffer.clear": buffer_clear,
    "conversation.item.create": item_create,
    "conversation.item.retrieve": item_retrieve,
    "conversation.item.delete": item_delete,
    "conversation.item.truncate": item_truncate,
    "response.create": response_create,
    "response.cancel": response_cancel,
    "output_audio_buffer.clear": output_clear,
}
