"""The aiohttp application: WebRTC signaling, health, metrics, and the sessions it owns."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from aiohttp import web
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import events as ev
from gateway.config import OmniConfig
from gateway.metrics import GatewayMetrics
from gateway.session import CallSession, TurnSettings
from stages.link import PipelineLink, SessionsFull, StageEvent
from stages.rings import RingNames

logger = logging.getLogger(__name__)

MAX_SDP_BYTES = 64 * 1024
GATEWAY_KEY = web.AppKey("gateway", "Gateway")


def openai_error(
    status: int,
    message: str,
    *,
    code: str,
    type_: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "code": code, "param": None}}
    return web.json_response(body, status=status, headers=headers)


class Gateway:
    """Calls in progress and the pipeline link they share."""

    def __init__(
        self, config: OmniConfig, names: RingNames, vocoder_rate: int, is_ready: Callable[[], bool]
    ) -> None:
        self.config = config
        self.names = names
        self.vocoder_rate = vocoder_rate
        self.is_ready = is_ready
        self.metrics = GatewayMetrics()
        self.calls: dict[str, CallSession] = {}
        self.by_session: dict[int, CallSession] = {}
        self.link: PipelineLink | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    # reader thread -> loop
    def _on_stage_event(self, event: StageEvent) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._route, event)

    def _route(self, event: StageEvent) -> None:
        call = self.by_session.get(event.session)
        if call is not None:
            call.on_stage_event(event)

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """cleanup_ctx: attach to the rings before serving; close every call, then the link."""
        self.loop = asyncio.get_running_loop()
        self.link = PipelineLink(self.names, self._on_stage_event)
        try:
            yield
        finally:
            for call in list(self.calls.values()):
                await call.close("gateway shutting down")
            self.link.close()

    def _ice_config(self) -> RTCConfiguration:
        return RTCConfiguration(
            iceServers=[RTCIceServer(urls=u) for u in self.config.gateway.ice_servers]
        )

    async def answer(self, offer_sdp: str) -> tuple[str, str]:
        """Create a call from an SDP offer; (call_id, answer SDP). Raises SessionsFull, or
        ValueError for an offer that is not usable."""
        assert self.link is not None
        if len(self.calls) >= self.config.gateway.max_calls:
            raise SessionsFull(f"{len(self.calls)} calls in progress, the configured maximum")
        session = self.link.open_session()
        call_id = ev.new_id("rtc")
        pc = RTCPeerConnection(self._ice_config())
        call = CallSession(
            call_id,
            pc,
            self.link,
            session,
            self.vocoder_rate,
            self.metrics,
            TurnSettings(**self.config.gateway.turn_detection.model_dump()),
            on_closed=self._forget,
        )
        self.calls[call_id] = call
        self.by_session[session] = call
        self.metrics.sessions.set(len(self.calls))
        pc.addTrack(call.playout)
        pc.on("track", call.attach_track)
        pc.on("datachannel", call.attach_channel)

        @pc.on("connectionstatechange")
        async def _state() -> None:
            if pc.connectionState in ("failed", "closed"):
                await call.close(f"connection {pc.connectionState}")

        try:
            await pc.setRemoteDescription(RTCSessionDescription(offer_sdp, "offer"))
            if not any(t.kind == "audio" for t in pc.getTransceivers()):
                raise ValueError("the offer has no audio media section")
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as exc:
            await call.close("bad offer")
            raise ValueError(f"unusable SDP offer: {exc}") from exc
        call.send(
            ev.event(
                "session.created",
                session={
                    "id": call_id,
                    "object": "realtime.session",
                    "type": "realtime",
                    "audio": {
                        "input": {"turn_detection": {"type": "server_vad", **vars(call.settings)}}
                    },
                },
            )
        )
        return call_id, pc.localDescription.sdp

    def _forget(self, call: CallSession) -> None:
        self.calls.pop(call.call_id, None)
        self.by_session.pop(call.session, None)
        self.metrics.sessions.set(len(self.calls))

    def update_ring_metrics(self) -> None:
        if self.link is None:
            return
        for name, ring in self.link.rings().items():
            stats = ring.stats()
            self.metrics.ring_bytes_used.labels(name).set(stats["bytes_used"])
            self.metrics.ring_full.labels(name).set(stats["full"])
            self.metrics.ring_skipped.labels(name).set(stats["skipped"])


async def _read_body(request: web.Request) -> bytes:
    if request.content_length is not None and request.content_length > MAX_SDP_BYTES:
        raise web.HTTPRequestEntityTooLarge(
            max_size=MAX_SDP_BYTES, actual_size=request.content_length
        )
    body = await request.content.read(MAX_SDP_BYTES + 1)
    if len(body) > MAX_SDP_BYTES:
        raise web.HTTPRequestEntityTooLarge(max_size=MAX_SDP_BYTES, actual_size=len(body))
    return body


async def _answer(request: web.Request, sdp: str) -> tuple[str, str] | web.Response:
    gateway = request.app[GATEWAY_KEY]
    if not gateway.is_ready():
        return openai_error(
            503,
            "the stage workers are not ready",
            code="not_ready",
            type_="server_error",
            headers={"Retry-After": "5"},
        )
    try:
        return await gateway.answer(sdp)
    except SessionsFull as exc:
        gateway.metrics.sessions_refused.inc()
        return openai_error(
            503,
            f"too many calls: {exc}",
            code="capacity",
            type_="server_error",
            headers={"Retry-After": "2"},
        )
    except ValueError as exc:
        return openai_error(400, str(exc), code="invalid_sdp")


async def realtime_calls(request: web.Request) -> web.Response:
    """POST /v1/realtime/calls: SDP offer in, 201 with the SDP answer and Location out."""
    if request.content_type != "application/sdp":
        return openai_error(
            415,
            f"Content-Type must be application/sdp, not {request.content_type!r}",
            code="unsupported_media_type",
        )
    body = await _read_body(request)
    try:
        sdp = body.decode()
    except UnicodeDecodeError:
        return openai_error(400, "the SDP offer is not UTF-8 text", code="invalid_sdp")
    result = await _answer(request, sdp)
    if isinstance(result, web.Response):
        return result
    call_id, answer = result
    return web.Response(
        status=201,
        text=answer,
        content_type="application/sdp",
        headers={"Location": f"/v1/realtime/calls/{call_id}"},
    )


async def offer(request: web.Request) -> web.Response:
    """POST /offer: aiortc-style JSON {sdp, type} in, JSON {sdp, type, call_id} out."""
    if request.content_type != "application/json":
        return openai_error(
            415, "Content-Type must be application/json", code="unsupported_media_type"
        )
    body = await _read_body(request)
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return openai_error(400, f"invalid JSON: {exc}", code="invalid_json")
    if (
        not isinstance(data, dict)
        or data.get("type") != "offer"
        or not isinstance(data.get("sdp"), str)
    ):
        return openai_error(400, 'expected {"type": "offer", "sdp": "..."}', code="invalid_offer")
    result = await _answer(request, data["sdp"])
    if isinstance(result, web.Response):
        return result
    call_id, answer = result
    return web.json_response({"type": "answer", "sdp": answer, "call_id": call_id})


async def hang_up(request: web.Request) -> web.Response:
    """DELETE /v1/realtime/calls/{call_id}."""
    gateway = request.app[GATEWAY_KEY]
    call = gateway.calls.get(request.match_info["call_id"])
    if call is None:
        return openai_error(404, "no such call", code="not_found")
    await call.close("hung up by the client")
    return web.Response(status=204)


async def health(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY_KEY]
    ready = gateway.is_ready()
    return web.json_response(
        {"status": "ready" if ready else "starting", "calls": len(gateway.calls)},
        status=200 if ready else 503,
    )


async def metrics(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY_KEY]
    gateway.update_ring_metrics()
    body = generate_latest(gateway.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(
    config: OmniConfig, names: RingNames, vocoder_rate: int, is_ready: Callable[[], bool]
) -> web.Application:
    app = web.Application(client_max_size=MAX_SDP_BYTES)
    gateway = Gateway(config, names, vocoder_rate, is_ready)
    app[GATEWAY_KEY] = gateway
    app.cleanup_ctx.append(gateway.lifecycle)
    app.router.add_post("/v1/realtime/calls", realtime_calls)
    app.router.add_delete("/v1/realtime/calls/{call_id}", hang_up)
    app.router.add_post("/offer", offer)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def gateway_of(app: web.Application) -> Gateway:
    return app[GATEWAY_KEY]
