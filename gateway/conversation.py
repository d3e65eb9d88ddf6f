"""The conversation's items as the client sees them (conversation.item.* events): messages,
function calls and their outputs, MCP calls and MCP tool lists.

The reasoning stage keeps its own copy as chat messages (it appends the caller's transcripts
and its replies itself, without a round trip through the gateway). When the client edits the
conversation (create, delete, truncate, a function's output), the gateway sends the whole list
over (`History`), so both copies agree again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gateway.events import new_id
from gateway.fields import ProtocolError, text_field, unsupported
from stages.messages import HistoryMessage, ToolCall

ROLES = ("user", "assistant", "system")
# the history sent to the reasoning stage, in one ring record of 512 KiB with room to spare
HISTORY_BYTES = 384 * 1024
# the content part types a message of each role may carry, as created by a client
CLIENT_CONTENT = {
    "user": ("input_text",),
    "system": ("input_text",),
    "assistant": ("output_text", "output_audio"),
}


# the fields each kind of item other than a message carries, in the order the API lists them
CALL_FIELDS = {
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
    "mcp_call": ("server_label", "name", "arguments", "output", "error", "approval_request_id"),
    "mcp_list_tools": ("server_label", "tools"),
}


@dataclass
class Item:
    id: str
    role: str  # a message's; "assistant" for calls, "tool" for outputs and lists
    content: list[dict[str, Any]] = field(default_factory=list)
    status: str = "completed"
    type: str = "message"  # or one of CALL_FIELDS
    fields: dict[str, Any] = field(default_factory=dict)  # an item of CALL_FIELDS' own

    @property
    def text(self) -> str:
        """What a message says, for the model: typed text or the audio's transcript."""
        parts = [p.get("text") or p.get("transcript") or "" for p in self.content]
        return " ".join(p for p in parts if p)

    def to_json(self) -> dict[str, Any]:
        if self.type != "message":
            data = {"id": self.id, "object": "realtime.item", "type": self.type}
            if self.type != "mcp_list_tools":
                data["status"] = self.status
            for name in CALL_FIELDS[self.type]:
                data[name] = self.fields.get(name)
            return data
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "status": self.status,
            "role": self.role,
            "content": [dict(p) for p in self.content],
        }


def function_call(item_id: str, call_id: str, name: str, status: str = "in_progress") -> Item:
    """The model's call of a function tool, its arguments still to come."""
    fields = {"call_id": call_id, "name": name, "arguments": ""}
    return Item(item_id, "assistant", [], status, "function_call", fields)


def mcp_call(item_id: str, server_label: str, name: str) -> Item:
    fields = {"server_label": server_label, "name": name, "arguments": "", "output": None}
    return Item(item_id, "assistant", [], "in_progress", "mcp_call", fields)


def mcp_list_tools(item_id: str, server_label: str) -> Item:
    return Item(
        item_id,
        "tool",
        [],
        "in_progress",
        "mcp_list_tools",
        {"server_label": server_label, "tools": []},
    )


def item_from_client(value: Any, items: Conversation | None = None) -> Item:
    """An item of conversation.item.create: a message with text content, a function call,
    or a function's output (for a call in `items`)."""
    if not isinstance(value, dict):
        raise ProtocolError("item must be an object", param="item")
    kind = value.get("type", "message")
    if kind in ("function_call", "function_call_output"):
        return _call_item(value, kind, items)
    if kind in ("mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response"):
        raise unsupported(f"item.type={kind!r}", "MCP items are made by the gateway's MCP calls")
    if kind != "message":
        raise ProtocolError(
            f"item.type must be 'message', 'function_call' or 'function_call_output', not {kind!r}",
            param="item.type",
        )
    role = value.get("role")
    if role not in ROLES:
        raise ProtocolError(f"item.role must be one of {ROLES}, not {role!r}", param="item.role")
    content = value.get("content")
    if not isinstance(content, list) or not content:
        raise ProtocolError("item.content must be a non-empty list", param="item.content")
    parts = []
    for i, part in enumerate(content):
        where = f"item.content[{i}]"
        if not isinstance(part, dict):
            raise ProtocolError(f"{where} must be an object", param=where)
        ptype = part.get("type")
        if ptype == "input_audio":
            raise unsupported(
                f"{where}.type='input_audio'", "send audio with input_audio_buffer.append"
            )
        if ptype not in CLIENT_CONTENT[role]:
            raise ProtocolError(
                f"{where}.type must be one of {CLIENT_CONTENT[role]} for a {role} message, "
                f"not {ptype!r}",
                param=f"{where}.type",
            )
        key = "transcript" if ptype == "output_audio" else "text"
        parts.append({"type": ptype, key: text_field(part.get(key), f"{where}.{key}")})

    item = Item(_item_id(value), role, parts)
    text_field(item.text, "item.content")  # its parts together, as the model is given them
    return item


def _item_id(value: dict[str, Any]) -> str:
    item_id = value.get("id") or new_id("item")
    if not isinstance(item_id, str) or len(item_id) > 64:
        raise ProtocolError("item.id must be a string of at most 64 characters", param="item.id")
    return item_id


def _call_item(value: dict[str, Any], kind: str, items: Conversation | None) -> Item:
    allowed = {"id", "type", "object", "status", *CALL_FIELDS[kind]}
    for key in value:
        if key not in allowed:
            raise ProtocolError(f"unknown field item.{key}", param=f"item.{key}")
    call_id = value.get("call_id")
    if not isinstance(call_id, str) or not 1 <= len(call_id) <= 64:
        raise ProtocolError(
            "item.call_id must be a string of 1 to 64 characters", param="item.call_id"
        )
    if kind == "function_call_output":
        output = text_field(value.get("output"), "item.output")
        if items is not None and items.call(call_id) is None:
            raise ProtocolError(
                f"no function_call with call_id {call_id!r} in the conversation",
                param="item.call_id",
                code="not_found",
            )
        return Item(
            _item_id(value), "tool", [], "completed", kind, {"call_id": call_id, "output": output}
        )
    name = value.get("name")
    if not isinstance(name, str) or not 1 <= len(name) <= 64:
        raise ProtocolError("item.name must name the function", param="item.name")
    arguments = text_field(value.get("arguments", "{}"), "item.arguments")
    fields = {"call_id": call_id, "name": name, "arguments": arguments}
    return Item(_item_id(value), "assistant", [], "completed", kind, fields)


class Conversation:
    """Items in order; ids unique within the session."""

    def __init__(self) -> None:
        self._items: dict[str, Item] = {}

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Item]:
        return iter(list(self._items.values()))

    def last_id(self) -> str | None:
        return next(reversed(self._items), None)

    def get(self, item_id: Any, param: str = "item_id") -> Item:
        item = self._items.get(item_id) if isinstance(item_id, str) else None
        if item is None:
            raise ProtocolError(
                f"no item with id {item_id!r} in the conversation", param=param, code="not_found"
            )
        return item

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Append (or insert after `previous_item_id`, 'root' for the start); returns the id
        of the item now before it."""
        if item.id in self._items:
            raise ProtocolError(f"an item with id {item.id!r} exists", param="item.id")
        if previous_item_id is None:
            before = self.last_id()
            self._items[item.id] = item
            return before
        if previous_item_id != "root":
            self.get(previous_item_id, "previous_item_id")
        items = list(self._items.values())
        at = 0 if previous_item_id == "root" else 1 + [i.id for i in items].index(previous_item_id)
        items.insert(at, item)
        self._items = {i.id: i for i in items}
        return None if previous_item_id == "root" else previous_item_id

    def delete(self, item_id: Any) -> Item:
        item = self.get(item_id)
        del self._items[item.id]
        return item

    def call(self, call_id: str) -> Item | None:
        """The function call item with `call_id`, if the conversation holds one."""
        for item in reversed(self._items.values()):
            if item.type == "function_call" and item.fields.get("call_id") == call_id:
                return item
        return None

    def history(self, max_bytes: int = HISTORY_BYTES) -> list[HistoryMessage]:
        """The items as chat messages, for the reasoning stage: the newest that fit in
        `max_bytes` of UTF-8 (one ring record; the stage fits them to the model's context in
        tokens). A reply's calls join its message; outputs are "tool" messages."""
        kept: list[_Message] = []
        size = 0
        for item in reversed(self._items.values()):
            for message in reversed(_messages(item)):
                size += message.size
                if size > max_bytes:
                    return _joined(kept[::-1])
                kept.append(message)
        return _joined(kept[::-1])


@dataclass
class _Message:
    role: str
    text: str
    calls: list[ToolCall] = field(default_factory=list)
    call_id: str | None = None

    @property
    def size(self) -> int:  # its UTF-8 and the record's framing of it
        calls = sum(len(c.arguments.encode("utf-8")) + len(c.name) + 48 for c in self.calls)
        return len(self.text.encode("utf-8")) + 16 + calls


def _messages(item: Item) -> list[_Message]:
    """What an item says to the model: none for an empty message or a list of tools."""
    f = item.fields
    if item.type == "message":
        return [_Message(item.role, text)] if (text := item.text) else []
    if item.type == "function_call":
        return [_Message("assistant", "", [ToolCall(f["call_id"], f["name"], f["arguments"])])]
    if item.type == "function_call_output":
        return [_Message("tool", f["output"], call_id=f["call_id"])]
    if item.type == "mcp_call" and item.status != "in_progress":
        call = ToolCall(item.id, f["name"], f["arguments"] or "{}")
        error = f.get("error")
        output = f["output"] if error is None else f"error: {error.get('message', '')}"
        return [_Message("assistant", "", [call]), _Message("tool", output or "", call_id=item.id)]
    return []


def _joined(messages: list[_Message]) -> list[HistoryMessage]:
    """Calls joined to the assistant message before them (a reply's words, then its calls);
    an output kept only with its call."""
    out: list[_Message] = []
    calls_seen: set[str] = set()
    for m in messages:
        if m.role == "assistant" and not m.text and out and out[-1].role == "assistant":
            out[-1].calls += m.calls
        elif m.role == "tool" and m.call_id not in calls_seen:
            continue  # its call fell out of the history
        else:
            out.append(m)
        calls_seen.update(c.call_id for c in m.calls)
    return [HistoryMessage(m.role, m.text, m.calls, m.call_id) for m in out]
