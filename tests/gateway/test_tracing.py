"""gateway.tracing: the process's tracer (clock, sampling, export headers), and a gateway with
tracing off that never loads OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.config import ConfigError, TracingConfig, parse_config
from gateway.tracing import Tracing, export_headers

pytestmark = pytest.mark.timeout(60)


def test_spans_take_monotonic_stamps_onto_the_wall_clock() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(TracingConfig(service_name="omni-test"), "gateway-2", exporter)
    start = time.monotonic_ns()
    root = tracing.start("turn", start, attributes={"omni.turn.id": 3})
    tracing.span("vad", start, start + 5_000_000, root)
    tracing.fail(root, "a stage was lost")
    tracing.end(root, start + 9_000_000)
    assert tracing.flush(5)
    vad, turn = exporter.get_finished_spans()
    assert abs(turn.start_time - time.time_ns()) < 10e9
    assert vad.end_time - vad.start_time == 5_000_000
    assert turn.end_time - turn.start_time == 9_000_000
    assert vad.parent.span_id == turn.context.span_id and turn.parent is None
    assert turn.status.description == "a stage was lost"
    assert turn.resource.attributes["service.name"] == "omni-test"
    assert turn.resource.attributes["service.instance.id"] == "gateway-2"
    tracing.shutdown()


def test_a_sample_ratio_of_zero_exports_nothing() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing(TracingConfig(sample_ratio=0.0), exporter=exporter)
    now = time.monotonic_ns()
    root = tracing.start("turn", now)
    tracing.span("vad", now, now + 1, root)
    tracing.end(root, now + 2)
    assert tracing.flush(5) and exporter.get_finished_spans() == ()
    tracing.shutdown()


def test_export_headers_come_from_the_variable_named() -> None:
    config = TracingConfig(otlp_endpoint="http://127.0.0.1:4318/v1/traces", headers_env="OTLP_H")
    # Langfuse's shape: Basic auth of public:secret key, the space URL-encoded
    environ = {"OTLP_H": "Authorization=Basic%20cGstbGY6c2stbGY=, x-langfuse-ingestion-version=4"}
    assert export_headers(config, environ) == {
        "authorization": "Basic cGstbGY6c2stbGY=",
        "x-langfuse-ingestion-version": "4",
    }
    assert export_headers(TracingConfig(), environ) == {}
    with pytest.raises(ValueError, match=r"\$OTLP_H, which is not set"):
        export_headers(config, {})
    with pytest.raises(ValueError, match="holds no header"):
        export_headers(config, {"OTLP_H": ","})


def test_the_endpoint_must_be_an_otlp_http_url() -> None:
    assert parse_config({}).gateway.tracing.otlp_endpoint is None  # off by default
    with pytest.raises(ConfigError, match="not an OTLP/HTTP URL"):
        parse_config({"gateway": {"tracing": {"otlp_endpoint": "127.0.0.1:4317"}}})
    with pytest.raises(ConfigError, match="sample_ratio"):
        parse_config({"gateway": {"tracing": {"sample_ratio": 2}}})


OFF = """
import asyncio, json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from gateway.calls import Gateway
from gateway.cli import main
from gateway.metrics import GatewayMetrics
from gateway.protocol import SessionConfig
from gateway.session import RealtimeSession
from stages.envelope import Envelope
from stages.messages import CancelAck, Kind, ResponseStarted, TextDelta, Transcript
from test_session_events import RecordingLink, RecordingTransport

async def main():
    s = RealtimeSession("c", RecordingLink(), 1, 22050, GatewayMetrics(),
                        SessionConfig(voice="v"), lambda c: None)
    s.bind(RecordingTransport())
    s.start()
    s.turns.begin(0)
    s.turns.end(900, True)
    for kind, msg in [(Kind.TRANSCRIPT, Transcript(1, "hi", True)),
                      (Kind.RESPONSE_STARTED, ResponseStarted("r", 1)),
                      (Kind.TEXT_DELTA, TextDelta("r", "Hello", 0)),
                      (Kind.AUDIO_OUT, np.ones(441, np.int16).tobytes())]:
        s.on_stage_event(Envelope("x", kind, 1, 0, 0, 1, msg))
    s.on_client_message(json.dumps({"type": "response.cancel"}))
    s.on_stage_event(Envelope("x", Kind.CANCEL_ACK, 1, 0, 0, 1, CancelAck(1, "encoder", 2)))
    await s.close("done")

asyncio.run(main())
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""


def test_with_tracing_off_nothing_of_opentelemetry_is_imported() -> None:
    out = subprocess.run(
        [sys.executable, "-c", OFF, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "[]"
