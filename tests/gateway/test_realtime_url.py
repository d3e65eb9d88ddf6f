"""A Realtime URL's query as clients build it: a base URL's own query survives a client that
appends `?model=...` to it (pipecat), and omni_events says on or off, or fails by name."""

from __future__ import annotations

import pytest
from multidict import MultiDict

from gateway.http_errors import OpenAIError
from gateway.realtime_url import omni_events, realtime_query


def query(text: str) -> dict[str, str]:
    from urllib.parse import parse_qsl

    return realtime_query(MultiDict(parse_qsl(text, keep_blank_values=True)))


def test_a_query_run_together_by_a_second_question_mark_is_read_whole() -> None:
    assert query("omni_events=on?model=gpt-realtime") == {
        "omni_events": "on",
        "model": "gpt-realtime",
    }
    assert query("model=x&intent=conversation") == {"model": "x", "intent": "conversation"}
    # the first value wins: the base URL's over what a client appended after it
    assert query("model=mine?model=theirs") == {"model": "mine"}


def test_omni_events_is_on_off_or_unsaid_and_anything_else_is_refused_by_name() -> None:
    assert omni_events(query("omni_events=on?model=x")) is True
    assert omni_events(query("omni_events=off")) is False
    assert omni_events(query("model=x")) is None
    with pytest.raises(OpenAIError) as refused:
        omni_events(query("omni_events=maybe"))
    assert "omni_events='maybe'" in refused.value.text
