"""The conversation's items as the client sees them (conversation.item.* events).

The reasoning stage keeps its own copy as chat messages (it appends the caller's transcripts
and its replies itself, without a round trip through the gateway). When the client edits the
conversation (create, delete, truncate), the gateway sends the whole list over (`History`),
so both copies agree again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gateway.events import new_id
from gateway.protocol import ProtocolError, text_field, unsupported

ROLES = ("user", "assistant", "system")
# the history sent to the reasoning stage, in one ring record of 512 KiB with room to spare
HISTORY_BYTES = 384 * 1024
# the content part types a message of each role may carry, as created by a client
CLIENT_CONTENT = {
    "user": ("input_text",),
    "system": ("input_text",),
    "assistant": ("output_text", "output_audio"),
}


@dataclass
class Item:
    id: str
    role: str
    content: list[dict[str, Any]] = field(default_factory=list)
    status: str = "completed"

    @property
    def text(self) -> str:
        """What the item says, for the model: typed text or the audio's transcript."""
        parts = [p.get("text") or p.get("transcript") or "" for p in self.content]
        return " ".join(p for p in parts if p)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "realtime.item",
            "type": "message",
            "status": self.status,
            "role": self.role,
            "content": [dict(p) for p in self.content],
        }


def item_from_client(value: Any) -> Item:
    """An item of conversation.item.create; a message with text content only."""
    if not isinstance(value, dict):
        raise ProtocolError("item must be an object", param="item")
    kind = value.get("type", "message")
    if kind != "message":
        raise unsupported(f"item.type={kind!r}", "only message items (no tools are built)")
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

    item_id = value.get("id") or new_id("item")
    if not isinstance(item_id, str) or len(item_id) > 64:
        raise ProtocolError("item.id must be a string of at most 64 characters", param="item.id")
    item = Item(item_id, role, parts)
    text_field(item.text, "item.content")  # its parts together, as the model is given them
    return item


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

    def history(self, max_bytes: int = HISTORY_BYTES) -> list[tuple[str, str]]:
        """(role, text) of the items that say something, for the reasoning stage: the newest
        that fit in `max_bytes` of UTF-8 (one ring record; the stage fits them to the
        model's context in tokens)."""
        kept: list[tuple[str, str]] = []
        size = 0
        for item in reversed(self._items.values()):
            if not (text := item.text):
                continue
            size += len(text.encode("utf-8")) + 16  # and the record's framing of a message
            if size > max_bytes:
                break
            kept.append((item.role, text))
        return kept[::-1]
