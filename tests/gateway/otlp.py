"""An OTLP/HTTP traces endpoint for tests, on 127.0.0.1: what the gateway exports
(ExportTraceServiceRequest in protobuf) decoded into spans, to assert on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest_asyncio
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.serving import serving


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
async def otlp_receiver() -> AsyncIterator[Receiver]:
    """Up before the gateway and after it, which sends what is left as it shuts down."""
    received = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", received.export)
    async with serving(app) as base:
        received.url = f"{base}/v1/traces"
        yield received
