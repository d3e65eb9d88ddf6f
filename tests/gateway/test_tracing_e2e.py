"""Traces end to end: the real gateway and stages (pocketsphinx, vLLM on the tiny model,
espeak-ng) with gateway.tracing pointed at an OTLP/HTTP receiver this module runs on
127.0.0.1; a spoken turn over WebRTC and a cancelled reply arrive as their span trees."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from gateway.app import gateway_of
from gateway.client import RealtimeCall
from gateway.config import load_config
from tests.gateway.test_call_e2e import speech48k
from tests.serving import serving

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"
HEADERS_ENV = "OMNI_TEST_OTLP_HEADERS"
AUTH = "Basic b21uaTp0ZXN0"  # Langfuse's shape: base64 of public key:secret key


@dataclass
class Span:
    name: str
    span_id: bytes
    parent_id: bytes
    trace_id: bytes
    start: int
    end: int
    attributes: dict[str, Any]
    error: bool
    service: str


class Receiver:
    """OTLP/HTTP's traces endpoint: ExportTraceServiceRequest in protobuf, spans kept."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.auth: set[str] = set()
        self.url = ""

    async def export(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        self.auth.add(request.headers.get("Authorization", ""))
        sent = ExportTraceServiceRequest.FromString(await request.read())
        for resource_spans in sent.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.spans.append(
                        Span(
                            s.name,
                            s.span_id,
                            s.parent_span_id,
                            s.trace_id,
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            _attributes(s.attributes),
                            s.status.code == s.status.STATUS_CODE_ERROR,
                            resource["service.name"],
                        )
                    )
        reply = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    def children(self, parent: Span) -> list[Span]:
        kids = [s for s in self.spans if s.parent_id == parent.span_id]
        assert all(k.trace_id == parent.trace_id for k in kids)
        return sorted(kids, key=lambda s: s.start)


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in pairs}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def receiver() -> AsyncIterator[Receiver]:
    """Up before the gateway and after it, which sends what is left as it shuts down."""
    received = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", received.export)
    async with serving(app) as base:
        received.url = f"{base}/v1/traces"
        yield received


@pytest.fixture(scope="module")
def config(receiver: Receiver) -> Iterator[Any]:
    os.environ[HEADERS_ENV] = f"Authorization={AUTH.replace(' ', '%20')}"
    try:
        yield load_config(
            TINY,
            {
                "gateway.port": 0,
                "reasoning.sampling": {"max_tokens": 16},  # a short reply, heard to its end
                "gateway.tracing": {"otlp_endpoint": receiver.url, "headers_env": HEADERS_ENV},
                "max_sessions": 4,
            },
        )
    finally:
        os.environ.pop(HEADERS_ENV, None)


async def test_a_spoken_turn_and_a_cancelled_reply_arrive_as_span_trees(
    server, receiver: Receiver, make_speech
) -> None:
    base, app = server
    tracing = gateway_of(app).tracing
    assert tracing is not None
    call = await RealtimeCall.connect(base)
    try:
        await call.next_event("session.created")
        call.microphone.play(speech48k(make_speech("what is the weather like today in paris")))
        await call.next_event("input_audio_buffer.speech_stopped", timeout=20)
        spoken = await call.next_event("response.created", timeout=60)
        await call.next_event("output_audio_buffer.stopped", timeout=120)
        # a reply asked for by name, cancelled while it is being made
        call.send({"type": "response.create"})
        asked = await call.next_event("response.created", timeout=60)
        call.cancel()
        cancelled = await call.next_event("omni.response.cancelled", timeout=30)
    finally:
        await call.close()
    assert await asyncio.to_thread(tracing.flush, 10)
    assert receiver.auth == {AUTH}

    turns = {s.attributes.get("omni.response.id"): s for s in receiver.spans if s.name == "turn"}
    turn = turns[spoken["response"]["id"]]
    assert turn.parent_id == b"" and turn.service == "omni-gateway"
    assert turn.attributes["session.id"] == call.call_id
    assert turn.attributes["omni.transport"] == "webrtc"
    assert turn.attributes["omni.turn_detection"] == "server_vad"
    assert turn.attributes["omni.turn.outcome"] == "played"
    assert turn.attributes["omni.turn_latency_ms"] > 0
    hops = receiver.children(turn)
    assert [h.name for h in hops] == [
        "vad",
        "encoder",
        "reasoning.first_token",
        "vocoder.first_audio",
        "playout",
    ]
    vad, encoder, reasoning, vocoder, playout = hops
    assert turn.start == vad.start and vad.end == encoder.start
    assert reasoning.end == vocoder.start and vocoder.end == playout.start
    assert playout.end == turn.end and playout.attributes["omni.audio_ms"] > 0
    assert all(h.start <= h.end for h in hops) and not turn.error

    cut = turns[asked["response"]["id"]]
    assert cut.attributes["omni.turn.source"] == "response.create"
    assert cut.attributes["omni.turn.outcome"] == "cut"
    assert cut.attributes["omni.cut.reason"] == "client_cancel"
    (cancel,) = [s for s in receiver.children(cut) if s.name == "cancel"]
    assert cancel.attributes["omni.cancel.reason"] == "client_cancel"
    acks = receiver.children(cancel)
    assert {a.name for a in acks} == {"cancel.encoder", "cancel.reasoning", "cancel.vocoder"}
    assert all(a.start == cancel.start and a.end <= cancel.end for a in acks)
    assert max(a.end for a in acks) == cancel.end
    # the latency the client was told is the one traced
    assert cancel.attributes["omni.cancel.latency_ms"] == pytest.approx(
        cancelled["cancel_latency_ms"], abs=0.01
    )
    (reasoning_ack,) = [a for a in acks if a.name == "cancel.reasoning"]
    assert reasoning_ack.attributes.get("omni.kv_usage") == cancelled["kv_cache_usage"]
