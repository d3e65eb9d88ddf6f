"""gateway.json_input and the limits on what clients send: every bad input is a ProtocolError
that names what was wrong."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.conversation import Conversation, Item, item_from_client
from gateway.fields import MAX_TEXT_BYTES, ProtocolError
from gateway.json_input import MAX_DEPTH, parse_json


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("[" * 100_000 + "]" * 100_000, "deeper than"),  # past the parser's own recursion
        ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "deeper than"),
        ('{"a":' * 40 + "1" + "}" * 40, "deeper than"),
        ('{"text": "\\ud800"}', "lone surrogate"),
        ('{"text": "\\udfff and more"}', "lone surrogate"),
        (b"\xff\xfe{\x00}\x00", "not UTF-8"),
        ('{"type": ', "not valid JSON"),
    ],
)
def test_bad_json_is_refused_by_what_is_wrong(raw: str | bytes, says: str) -> None:
    with pytest.raises(ProtocolError, match=says) as caught:
        parse_json(raw, "the event")
    assert caught.value.code == "invalid_json"


def test_what_clients_send_passes() -> None:
    nested = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert parse_json(nested) is not None
    assert parse_json('{"text": "\\ud83d\\ude00"}') == {"text": "\U0001f600"}  # a pair
    assert parse_json('{"a": "été"}'.encode()) == {"a": "été"}


@given(st.recursive(st.none() | st.booleans() | st.text(), lambda c: st.lists(c, max_size=3)))
def test_any_json_value_within_the_depth_round_trips(value) -> None:
    raw = json.dumps(value)
    try:
        assert parse_json(raw) == value
    except ProtocolError as exc:  # only for the depth or a surrogate hypothesis made
        assert "deeper" in str(exc) or "surrogate" in str(exc)


def test_item_text_over_the_limit_is_refused_by_name() -> None:
    text = "a" * (MAX_TEXT_BYTES + 1)
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    with pytest.raises(ProtocolError, match="longer than") as caught:
        item_from_client(item)
    assert caught.value.param == "item.content[0].text"
    # two parts each under the limit, over it together
    half = {"type": "input_text", "text": "é" * (MAX_TEXT_BYTES // 3)}
    with pytest.raises(ProtocolError, match="longer than"):
        item_from_client({"type": "message", "role": "user", "content": [half, half]})


def test_the_history_sent_to_reasoning_is_the_newest_that_fits_one_record() -> None:
    conversation = Conversation()
    for i in range(10):
        conversation.add(
            Item(f"item_{i}", "user", [{"type": "input_text", "text": f"{i} " + "x" * 50_000}])
        )
    history = conversation.history(max_bytes=200_000)
    assert [m.text.split()[0] for m in history] == ["7", "8", "9"]
    assert sum(len(m.text) for m in history) <= 200_000
