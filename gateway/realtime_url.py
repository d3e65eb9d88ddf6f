"""The query of a Realtime URL as clients build it.

Some clients append `?model=...` to the base URL they are given, whatever it holds (pipecat:
`f"{base_url}?model={model}"`), so a base URL with a query of its own arrives as
`/v1/realtime?omni_events=on?model=gpt-realtime`. The parameters after such a second `?` are
read as if it were `&`, so that a setting in the base URL survives."""

from __future__ import annotations

from collections.abc import Mapping
from urllib.parse import parse_qsl

from gateway.http_errors import OpenAIError

ON, OFF = ("on", "true", "1"), ("off", "false", "0")


def realtime_query(query: Mapping[str, str]) -> dict[str, str]:
    """`query` (a request's) with the parameters run together by a second `?` apart; a
    parameter's first value wins."""
    merged: dict[str, str] = {}
    for key, value in query.items():
        head, joined, tail = value.partition("?")
        merged.setdefault(key, head)
        if joined:
            for k, v in parse_qsl(tail, keep_blank_values=True):
                merged.setdefault(k, v)
    return merged


def omni_events(query: Mapping[str, str]) -> bool | None:
    """`omni_events=on|off` of a realtime query: whether the gateway's own events (omni.*)
    go out beside OpenAI's; None when the query does not say."""
    value = query.get("omni_events")
    if value is None:
        return None
    if value.lower() in ON:
        return True
    if value.lower() in OFF:
        return False
    raise OpenAIError(
        400, f"omni_events={value!r}: 'on' or 'off'", code="invalid_value", param="omni_events"
    )
