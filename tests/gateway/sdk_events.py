"""What the Realtime tests share when they drive the gateway with the official `openai` SDK
over the WebSocket: the events a connection received, waited on by type, and audio and text
turns in the SDK's terms."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np

from stages.audio import resample


class Events:
    """What a connection received, as dicts, with waits that skip what they do not want."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.seen: list[dict[str, Any]] = []

    async def next(self, *types: str, timeout: float = 30) -> dict[str, Any]:
        """The next event of one of `types`; an unexpected `error` fails the test."""
        async with asyncio.timeout(timeout):
            while True:
                # (the SDK's models know no audio/opus: no warnings about it)
                event = (await self.conn.recv()).to_dict(warnings=False)
                self.seen.append(event)
                if event["type"] in types:
                    return event
                assert event["type"] != "error", f"server error: {event['error']}"

    def types(self) -> list[str]:
        return [e["type"] for e in self.seen]


def pcm24k_b64(pcm16k: np.ndarray, chunk_ms: int = 100) -> list[str]:
    pcm = resample(pcm16k, 16000, 24000).astype("<i2")
    step = 24 * chunk_ms
    return [
        base64.b64encode(pcm[i : i + step].tobytes()).decode() for i in range(0, len(pcm), step)
    ]


def decode_audio(deltas: list[dict[str, Any]]) -> np.ndarray:
    raw = b"".join(base64.b64decode(d["delta"]) for d in deltas)
    return np.frombuffer(raw, dtype="<i2")


async def text_turn(conn: Any, events: Events, text: str, **response: Any) -> dict[str, Any]:
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )
    added = await events.next("conversation.item.added")
    assert added["item"]["role"] == "user" and added["item"]["content"][0]["text"] == text
    await conn.response.create(response=response or None)
    return await events.next("response.created")
