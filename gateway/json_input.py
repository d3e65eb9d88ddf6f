"""JSON from clients, checked where it enters: UTF-8 only, nested no deeper than a client
ever needs, and text that can be encoded again (JSON's escapes can spell a lone surrogate,
which is valid JSON and fails the moment it is written to a ring or a socket). Every failure
is a ProtocolError naming what was wrong, so a bad body or event is a 400 or an `error`
event, never a 500 or a dropped connection."""

from __future__ import annotations

import json
import re
from typing import Any

from gateway.protocol import ProtocolError

MAX_DEPTH = 32  # the deepest Realtime event (a response's input items) nests 6 levels
# a JSON escape of a UTF-16 surrogate: only then can the parsed text hold a lone one
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json(raw: str | bytes, what: str = "the body") -> Any:
    """`raw` parsed; ProtocolError (code invalid_json) when it is not UTF-8 JSON that fits
    the limits."""
    if isinstance(raw, bytes | bytearray):
        try:
            raw = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(
                f"{what} is not UTF-8 text (byte {exc.start})", code="invalid_json"
            ) from None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ProtocolError(f"{what} is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise _too_deep(what) from None
    _check_depth(value, what)
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ProtocolError(
                f"{what} holds text that is not valid Unicode: a lone surrogate "
                f"({exc.object[exc.start : exc.end]!r}); escape pairs must be complete",
                code="invalid_json",
            ) from None
    return value


def _check_depth(value: Any, what: str) -> None:
    """Iteratively: a recursive walk would itself overflow on what it means to refuse."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > MAX_DEPTH:
            raise _too_deep(what)
        stack.extend((child, depth + 1) for child in children)


def _too_deep(what: str) -> ProtocolError:
    return ProtocolError(
        f"{what} nests objects and arrays deeper than {MAX_DEPTH} levels", code="invalid_json"
    )
