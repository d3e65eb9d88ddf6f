"""OpenAI Realtime (GA) server events, as JSON-ready dicts."""

from __future__ import annotations

import itertools
import secrets
from typing import Any

_counter = itertools.count(1)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


def event(type_: str, **fields: Any) -> dict[str, Any]:
    """A server event with a fresh event_id."""
    return {"type": type_, "event_id": f"event_{next(_counter):08d}", **fields}


def error(
    message: str,
    *,
    code: str = "invalid_request_error",
    param: str | None = None,
    event_id: str | None = None,
    type_: str = "invalid_request_error",
) -> dict[str, Any]:
    """An `error` event; `event_id` names the client event that caused it."""
    return event(
        "error",
        error={
            "type": type_,
            "code": code,
            "message": message,
            "param": param,
            "event_id": event_id,
        },
    )


def response_obj(
    response_id: str,
    status: str,
    *,
    audio: bool = True,
    output: list[dict[str, Any]] | None = None,
    status_details: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The `response` object of response.created and response.done."""
    return {
        "object": "realtime.response",
        "id": response_id,
        "status": status,
        "status_details": status_details,
        "output": output or [],
        "output_modalities": ["audio"] if audio else ["text"],
        "metadata": metadata,
        "conversation_id": None,
        "usage": usage,
    }


def usage(
    input_tokens: int = 0, audio_tokens: int = 0, cached_tokens: int = 0, output_tokens: int = 0
) -> dict[str, Any]:
    """A response's `usage`, in OpenAI's shape: the prompt's positions (text tokens, and
    under speech-in audio rows), those the prefix cache held, the tokens generated. The
    agent's audio is made from its text by the vocoder: it counts no tokens of its own."""
    text = input_tokens - audio_tokens
    return {
        "total_tokens": input_tokens + output_tokens,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "input_token_details": {
            "text_tokens": text,
            "audio_tokens": audio_tokens,
            "image_tokens": 0,
            "cached_tokens": cached_tokens,
            "cached_tokens_details": {
                "text_tokens": min(cached_tokens, text),
                "audio_tokens": max(0, cached_tokens - text),
                "image_tokens": 0,
            },
        },
        "output_token_details": {"text_tokens": output_tokens, "audio_tokens": 0},
    }


def rate_limits() -> dict[str, Any]:
    """rate_limits.updated after each response: this gateway limits nothing per token or
    request (admission is per call, at connect), which it says by reporting no limits."""
    return event("rate_limits.updated", rate_limits=[])
