"""OpenTelemetry traces of one gateway process, exported over OTLP/HTTP (`gateway.tracing`).

Not to be confused with gateway.trace, which writes every stage record to a file for offline
latency analysis: this makes a few spans per turn and per cancel (gateway.session.spans) for
a tracing backend (an OpenTelemetry Collector, Langfuse, Arize Phoenix) to show.

Spans are made from the CLOCK_MONOTONIC stamps the gateway and the stages take anyway, with
explicit start and end times; one offset, taken at start, turns them into wall time. The
event loop only queues ended spans: a BatchSpanProcessor's thread encodes and sends them.
Nothing here imports OpenTelemetry until a `Tracing` is made, so a gateway with tracing off
never loads it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

    from gateway.config import TracingConfig

EXPORT_TIMEOUT_S = 5.0  # one export request; a collector that is down delays shutdown this long
TRACER_NAME = "omni-gateway"


def export_headers(
    config: TracingConfig, environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """The headers every export sends, from the variable `headers_env` names (none unnamed).
    ValueError when it is named but unset or holds no header."""
    if config.headers_env is None:
        return {}
    value = environ.get(config.headers_env, "").strip()
    if not value:
        raise ValueError(
            f"gateway.tracing.headers_env names ${config.headers_env}, which is not set: set it "
            "to the export's headers (k=v,k=v) or drop headers_env"
        )
    from opentelemetry.util.re import parse_env_headers

    headers = dict(parse_env_headers(value, liberal=True))
    if not headers:
        raise ValueError(
            f"${config.headers_env} (gateway.tracing.headers_env) holds no header: write "
            "k=v,k=v, values URL-encoded (Authorization=Basic%20...)"
        )
    return headers


class Tracing:
    """One process's tracer, its sampler and its exporter. `exporter`: where ended spans go
    (default: OTLP/HTTP to `config.otlp_endpoint`); `instance` names the gateway process."""

    def __init__(
        self,
        config: TracingConfig,
        instance: str = "gateway",
        exporter: SpanExporter | None = None,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        from opentelemetry import context, trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(
                endpoint=config.otlp_endpoint,
                headers=export_headers(config, environ) or None,
                timeout=EXPORT_TIMEOUT_S,
            )
        # OTEL_RESOURCE_ATTRIBUTES adds to these (Phoenix's openinference.project.name, say)
        resource = Resource.create(
            {"service.name": config.service_name, "service.instance.id": instance}
        )
        self.provider = TracerProvider(
            resource=resource, sampler=ParentBasedTraceIdRatio(config.sample_ratio)
        )
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self.provider.get_tracer(TRACER_NAME)
        self._in = trace.set_span_in_context
        self._no_parent = context.Context()  # never the caller's current span: none is set here
        self._error = trace.StatusCode.ERROR
        self._status = trace.Status
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    def start(
        self,
        name: str,
        start_ns: int,
        parent: Span | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> Span:
        """A span begun at `start_ns` (CLOCK_MONOTONIC), a root unless `parent` is given."""
        ctx = self._no_parent if parent is None else self._in(parent)
        return self._tracer.start_span(
            name, context=ctx, attributes=attributes, start_time=start_ns + self.offset_ns
        )

    def end(self, span: Span, end_ns: int) -> None:
        span.end(end_time=end_ns + self.offset_ns)

    def span(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        parent: Span | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> Span:
        """A span whose both ends are known already."""
        span = self.start(name, start_ns, parent, attributes)
        self.end(span, end_ns)
        return span

    def fail(self, span: Span, description: str) -> None:
        span.set_status(self._status(self._error, description))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Export every span ended so far; blocks (call it off the event loop)."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Export what is left and stop the exporter's thread; blocks up to an export's time."""
        self.provider.shutdown()
