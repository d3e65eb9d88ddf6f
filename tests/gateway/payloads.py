"""Malformed and oversized input for the gateway's every entry, made from valid input by
seeded mutations: values of the wrong type or size, fields dropped or invented, JSON cut
short, nested past any use, text that is not valid Unicode, bodies that are not UTF-8.
`events(n)` are client events (JSON text); `bodies(n)` are HTTP requests (path, content
type, body bytes)."""

from __future__ import annotations

import base64
import copy
import json
import random
from collections.abc import Iterator
from typing import Any

SILENCE_100MS = base64.b64encode(bytes(4800)).decode()  # PCM16 24 kHz

ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**63,
    -(2**70),
    1e308,
    -0.5,
    "",
    "x" * 70_000,
    "é" * 3000,
    "\ud800",  # json.dumps writes it as the escape a client can send
    "\udfff\ud800",
    "\u0000\u001f",
    [],
    {},
    [[[[]]]],
    {"type": {"type": {}}},
    ["a", 1, None],
    "NaN",
    "null",
    "<script>",
]

VALID_EVENTS: list[dict[str, Any]] = [
    {"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief."}},
    {
        "type": "session.update",
        "session": {
            "type": "realtime",
            "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 0.5}}},
        },
    },
    {"type": "input_audio_buffer.append", "audio": SILENCE_100MS},
    {"type": "input_audio_buffer.commit"},
    {"type": "input_audio_buffer.clear"},
    {
        "type": "conversation.item.create",
        "item": {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "hello"}],
        },
    },
    {"type": "conversation.item.retrieve", "item_id": "item_fuzz"},
    {"type": "conversation.item.delete", "item_id": "item_fuzz"},
    {
        "type": "conversation.item.truncate",
        "item_id": "item_fuzz",
        "content_index": 0,
        "audio_end_ms": 10,
    },
    {
        "type": "response.create",
        "response": {"output_modalities": ["text"], "max_output_tokens": 2, "metadata": {}},
    },
    {"type": "response.cancel"},
    {"type": "output_audio_buffer.clear"},
]

VALID_BODIES: list[tuple[str, str, Any]] = [
    ("/v1/realtime/client_secrets", "application/json", {"session": {"type": "realtime"}}),
    (
        "/v1/realtime/client_secrets",
        "application/json",
        {"expires_after": {"anchor": "created_at", "seconds": 60}},
    ),
    (
        "/v1/audio/speech",
        "application/json",
        {"model": "tts", "input": "hi", "voice": "VOICE", "response_format": "pcm"},
    ),
    ("/offer", "application/json", {"type": "offer", "sdp": "v=0\r\n"}),
    ("/v1/realtime/calls", "application/sdp", "v=0\r\no=- 0 0 IN IP4 127.0.0.1\r\n"),
    ("/v1/realtime/calls", "multipart/form-data", {"sdp": "v=0\r\n", "session": "{}"}),
]


def _paths(value: Any, at: tuple = ()) -> Iterator[tuple]:
    """Every place in a JSON value a mutation can touch."""
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*at, i))


def _set(value: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    node = value
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = new
    return value


def _drop(value: Any, path: tuple) -> Any:
    if not path:
        return {}
    node = value
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return value


def _nested(depth: int, inner: Any) -> str:
    return "[" * depth + json.dumps(inner) + "]" * depth


def mutate(value: Any, rng: random.Random, types: list[str]) -> str:
    """One malformed variant of `value`, as the text a client would send."""
    value = copy.deepcopy(value)
    path = rng.choice(list(_paths(value)))
    kind = rng.randrange(10)
    if kind <= 2:
        return json.dumps(_set(value, path, rng.choice(ODD_VALUES)))
    if kind == 3 and path:
        return json.dumps(_drop(value, path))
    if kind == 4 and isinstance(value, dict):
        value[rng.choice(["unknown", "typ", "session", "item", "", "type "])] = rng.choice(
            ODD_VALUES
        )
        return json.dumps(value)
    if kind == 5 and isinstance(value, dict):
        value["type"] = rng.choice([*types, "response.create ", "RESPONSE.CREATE", "x" * 300])
        return json.dumps(_set(value, path, rng.choice(ODD_VALUES)) if path else value)
    if kind == 6:
        text = json.dumps(value)
        return text[: rng.randrange(len(text))]
    if kind == 7:
        return _nested(rng.choice([33, 200, 1000, 50_000]), value)
    if kind == 8:
        return json.dumps(rng.choice([[value], [value, value], "text", 42, None]))
    return rng.choice(
        [
            "",
            " ",
            "null",
            "{}",
            "{" * 10_000,
            '{"type": "\\ud800"}',
            '{"type": "session.update", "session": {"instructions": "\\udc00"}}',
            "\u00ff\u00fe{",
            json.dumps(value) + "garbage",
        ]
    )


def events(n: int, seed: int = 30) -> list[str]:
    rng = random.Random(seed)
    types = [e["type"] for e in VALID_EVENTS]
    return [mutate(rng.choice(VALID_EVENTS), rng, types) for _ in range(n)]


def _multipart(fields: Any, rng: random.Random) -> tuple[str, bytes]:
    boundary = "fuzzboundary"
    if not isinstance(fields, dict):
        fields = {"sdp": fields}
    parts = []
    for name, text in fields.items():
        raw = text if isinstance(text, bytes) else str(text).encode("utf-8", "surrogatepass")
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'.encode()
            + raw
            + b"\r\n"
        )
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    cut = rng.random() < 0.2
    return f"multipart/form-data; boundary={boundary}", body[: len(body) // 2] if cut else body


def bodies(n: int, voice: str, seed: int = 30) -> list[tuple[str, str, bytes]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        path, ctype, template = rng.choice(VALID_BODIES)
        template = json.loads(json.dumps(template).replace("VOICE", voice))
        if ctype == "multipart/form-data":
            fields = copy.deepcopy(template)
            key = rng.choice(list(fields))
            fields[key] = mutate(fields[key], rng, []) if rng.random() < 0.7 else b"\xff\xfe"
            ctype, body = _multipart(fields, rng)
        elif ctype == "application/sdp":
            body = rng.choice(
                [
                    template.encode(),
                    b"\xff\xfe\x00",
                    template.encode() * 50,
                    b"v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF\r\n",
                    b"",
                ]
            )
        else:
            text = mutate(template, rng, [])
            body = text.encode("utf-8", "surrogatepass")
            if rng.random() < 0.1:
                body = text.encode("utf-16")
        out.append((path, ctype, body))
    return out
