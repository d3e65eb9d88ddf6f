"""The aiohttp application: the OpenAI-shaped HTTP and WebSocket endpoints, health, metrics,
and the sessions it owns."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from gateway import aiortc_tuning, speech
from gateway import events as ev
from gateway.auth import Authenticator, AuthError, Grant
from gateway.config import OmniConfig
from gateway.loopwatch import LoopWatch, freeze_startup_objects
from gateway.metrics import GatewayMetrics
from gateway.opus import opus_rate_for
from gateway.playout import PLAYOUT_RATE
from gateway.protocol import ProtocolError, SessionConfig, TurnDetection
from gateway.resample import CALLER_RATE
from gateway.session import RealtimeSession
from gateway.siblings import Siblings, call_id
from gateway.speech import Utterance
from gateway.trace import StageTrace
from gateway.webrtc import WebRTCTransport
from gateway.websocket import serve_websocket, websocket_response
from stages.link import PipelineLink, SessionsFull, StageEvent
from stages.messages import Kind
from stages.rings import GATEWAY, RingNames, made_stale

logger = logging.getLogger(__name__)

MAX_SDP_BYTES = 64 * 1024
# several gateway processes: their metrics meet in files (prometheus_client's multiprocess mode,
# which `omni-gateway start` turns on before anything imports prometheus_client)
MULTIPROCESS = "PROMETHEUS_MULTIPROC_DIR" in os.environ
GATEWAY_KEY = web.AppKey("gateway", "Gateway")


def openai_error(
    status: int,
    message: str,
    *,
    code: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "code": code, "param": param}}
    return web.json_response(body, status=status, headers=headers)


class Gateway:
    """Sessions in progress (WebRTC calls, WebSockets, speech requests) and the pipeline link
    they share: one gateway process's.

    `instance` names the process among the service's (`gateway.processes`); with more than
    one, `socket_dir` holds their sockets for the requests they pass each other
    (gateway.siblings) and `signing_key` is the one their client secrets share.
    """

    def __init__(
        self,
        config: OmniConfig,
        names: RingNames,
        vocoder_rate: int,
        is_ready: Callable[[], bool],
        *,
        instance: str = GATEWAY,
        socket_dir: str | Path | None = None,
        signing_key: bytes | None = None,
    ) -> None:
        self.config = config
        self.names = names
        self.instance = instance
        self.index = names.gateways.index(instance)
        self.socket_dir = socket_dir
        self.vocoder_rate = vocoder_rate
        self.is_ready = is_ready
        self.auth = Authenticator(config.gateway.auth, signing_key=signing_key)
        self.metrics = GatewayMetrics()
        self.calls: dict[str, RealtimeSession] = {}
        self.by_session: dict[int, RealtimeSession | Utterance] = {}
        self.link: PipelineLink | None = None
        self.siblings: Siblings | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.trace: StageTrace | None = None
        self.watch: LoopWatch | None = None

    # reader thread -> loop
    def _on_stage_event(self, event: StageEvent) -> None:
        assert self.loop is not None
        if self.trace is not None:
            self.trace.record(event, *self.whose(event))
        self.loop.call_soon_threadsafe(self._route, event)

    def whose(self, event: StageEvent) -> tuple[str | None, int | None]:
        """The call an event is for, and for a CANCEL_ACK when its CANCEL was sent (read on a
        reader thread: a dict lookup, no state changed)."""
        call = self.by_session.get(event.session)
        sent = None
        if event.kind is Kind.CANCEL_ACK:
            sent = getattr(call, "cancels", {}).get(event.msg.cancel_id)
        return getattr(call, "call_id", None), sent

    def _route(self, event: StageEvent) -> None:
        owner = self.by_session.get(event.session)
        if owner is None or self.link is None:
            return
        # the ring drops what a cancel made stale; this drops what was on its way to the loop
        current = self.link.control.epoch(event.session)
        if made_stale(event.kind, event.msg, event.epoch, current):
            return
        owner.on_stage_event(event)

    async def lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        """cleanup_ctx: attach to the rings before serving; close every call, then the link."""
        self.loop = asyncio.get_running_loop()
        if self.config.gateway.trace_dir is not None:
            self.trace = StageTrace(Path(self.config.gateway.trace_dir) / f"{self.instance}.trace")
        self.link = PipelineLink(self.names, self._on_stage_event, self.instance)
        if self.socket_dir is not None and len(self.names.gateways) > 1:
            self.siblings = Siblings(self.names, self.instance, self.link.control, self.socket_dir)
        rings = asyncio.create_task(self._update_ring_metrics()) if MULTIPROCESS else None
        if self.config.gateway.gc_freeze:
            frozen = freeze_startup_objects()
            logger.info("%d objects of the start-up exempt from garbage collection", frozen)
        stall_ms = self.config.gateway.stall_report_ms
        watch = self.watch = LoopWatch(
            self.metrics.loop_lag,
            self.metrics.gc_pause,
            stall_ms / 1000 if stall_ms else None,
            busy=lambda: bool(self.calls),
        )
        watch.start()
        try:
            yield
        finally:
            await watch.stop()
            if rings is not None:
                rings.cancel()
            for call in list(self.calls.values()):
                await call.close("gateway shutting down")
            if self.siblings is not None:
                await self.siblings.close()
            self.link.close()
            if self.trace is not None:
                self.trace.close()

    async def _update_ring_metrics(self) -> None:
        """With several processes a scrape reaches one of them: each keeps its rings'
        figures current."""
        while True:
            self.update_ring_metrics()
            await asyncio.sleep(1.0)

    def session_config(self) -> SessionConfig:
        """A new session's settings: the configuration's defaults."""
        td = self.config.gateway.turn_detection
        return SessionConfig(
            voice=self.config.vocoder.voice,
            model=self.config.reasoning.model,
            instructions=self.config.reasoning.system_prompt,
            turn_detection=TurnDetection(**td.model_dump()),
        )

    def check_session_config(self, session: Any, param: str = "session") -> SessionConfig:
        """The settings `session` would give a new session; ProtocolError if refused."""
        return self.session_config().updated(session, param)

    def open_session(self, prefix: str, grant: Grant, model: str | None) -> RealtimeSession:
        """Admit a new Realtime session; raises SessionsFull, or ProtocolError for settings
        that cannot be used."""
        assert self.link is not None
        if len(self.calls) >= self.config.max_calls_per_process:
            raise SessionsFull(f"{len(self.calls)} calls in progress, the configured maximum")
        config = self.session_config()
        if grant.session is not None:
            config.apply(grant.session)
        if model:
            config.model = model
        session = self.link.open_session()
        call = RealtimeSession(
            call_id(prefix, self.index),
            self.link,
            session,
            self.vocoder_rate,
            self.metrics,
            config,
            on_closed=self._forget,
            hold_on_voice=self.config.gateway.barge_in_hold,
            prepare_reply_ms=self.config.gateway.prepare_reply_ms,
        )
        self.calls[call.call_id] = call
        self.by_session[session] = call
        self.metrics.sessions.set(len(self.calls))
        if self.watch is not None:
            self.watch.wake()
        return call

    def _ice_config(self) -> RTCConfiguration:
        return RTCConfiguration(
            iceServers=[RTCIceServer(urls=u) for u in self.config.gateway.ice_servers]
        )

    async def answer(
        self, offer_sdp: str, grant: Grant, session: dict[str, Any] | None = None
    ) -> tuple[str, str]:
        """Create a call from an SDP offer; (call_id, answer SDP). Raises SessionsFull,
        ProtocolError for refused settings, or ValueError for an offer that is not usable."""
        if session is not None:
            self.check_session_config(session)
        call = self.open_session("rtc", grant, None)
        if session is not None:
            call.config.apply(session)
        pc = RTCPeerConnection(self._ice_config())
        libopus = aiortc_tuning.opus_codec() == "opuslib"
        # with libopus, agent audio is played (and coded) at the Opus rate nearest the
        # vocoder's, caller audio decoded straight to what the VAD takes
        playout_rate = opus_rate_for(self.vocoder_rate) if libopus else PLAYOUT_RATE
        transport = WebRTCTransport(call, pc, playout_rate)
        call.bind(transport)
        try:
            await pc.setRemoteDescription(RTCSessionDescription(offer_sdp, "offer"))
            audio = [t for t in pc.getTransceivers() if t.kind == "audio"]
            if not audio:
                raise ValueError("the offer has no audio media section")
            if libopus:
                for transceiver in audio:
                    aiortc_tuning.decode_at(transceiver.receiver, CALLER_RATE)
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as exc:
            await call.close("bad offer")
            raise ValueError(f"unusable SDP offer: {exc}") from exc
        call.start()
        return call.call_id, pc.localDescription.sdp

    def open_utterance(self) -> Utterance:
        """A pipeline session for one /v1/audio/speech request; raises SessionsFull."""
        assert self.link is not None
        utterance = Utterance(self.link, self.link.open_session(), self.vocoder_rate)
        self.by_session[utterance.session] = utterance
        return utterance

    def close_utterance(self, utterance: Utterance) -> None:
        assert self.link is not None
        if not utterance.done:
            self.link.cancel(utterance.session, reason="client_gone")
        self.by_session.pop(utterance.session, None)
        self.link.close_session(utterance.session)

    def _forget(self, call: RealtimeSession) -> None:
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


async def _read_body(request: web.Request, limit: int = MAX_SDP_BYTES) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    body = await request.content.read(limit + 1)
    if len(body) > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(body))
    return body


def _authorize(request: web.Request, *, allow_ephemeral: bool = True) -> Grant | web.Response:
    try:
        return request.app[GATEWAY_KEY].auth.check(request, allow_ephemeral=allow_ephemeral)
    except AuthError as exc:
        return openai_error(401, str(exc), code=exc.code)


def _not_ready() -> web.Response:
    return openai_error(
        503,
        "the stage workers are not ready",
        code="not_ready",
        type_="server_error",
        headers={"Retry-After": "5"},
    )


def _full(gateway: Gateway, exc: Exception) -> web.Response:
    gateway.metrics.sessions_refused.inc()
    return openai_error(
        503,
        f"too many calls: {exc}",
        code="capacity",
        type_="server_error",
        headers={"Retry-After": "2"},
    )


def _refused(exc: ProtocolError) -> web.Response:
    return openai_error(400, str(exc), code=exc.code, param=exc.param)


async def _answer(
    request: web.Request, sdp: str, grant: Grant, session: dict[str, Any] | None = None
) -> tuple[str, str] | web.Response:
    gateway = request.app[GATEWAY_KEY]
    if not gateway.is_ready():
        return _not_ready()
    try:
        return await gateway.answer(sdp, grant, session)
    except SessionsFull as exc:
        return _full(gateway, exc)
    except ProtocolError as exc:
        return _refused(exc)
    except ValueError as exc:
        return openai_error(400, str(exc), code="invalid_sdp")


def _form_text(field: Any) -> str | None:
    """A multipart field as text: a plain field, a typed part (aiohttp gives bytes for
    application/sdp and application/json parts, as OpenAI's SDKs send them), or a file."""
    if isinstance(field, str):
        return field
    if isinstance(field, (bytes, bytearray)):
        return bytes(field).decode()
    if field is not None and hasattr(field, "file"):
        return field.file.read().decode()
    return None


async def _offer_form(request: web.Request) -> tuple[str, dict[str, Any] | None] | web.Response:
    """The `sdp` and optional `session` (JSON) fields of a multipart/form-data offer, the
    shape OpenAI's SDKs send when they configure the session with the call."""
    form = await request.post()
    try:
        sdp, session = _form_text(form.get("sdp")), _form_text(form.get("session"))
    except UnicodeDecodeError:
        return openai_error(400, "the form's fields must be UTF-8 text", code="invalid_request")
    if sdp is None:
        return openai_error(400, "the form needs an 'sdp' field", code="invalid_sdp")
    if session is None:
        return sdp, None
    try:
        parsed = json.loads(session)
    except json.JSONDecodeError as exc:
        return openai_error(400, f"'session' is not JSON: {exc}", code="invalid_json")
    return sdp, parsed


async def _to_least_loaded(request: web.Request) -> web.Response | None:
    """A new call for a sibling process with fewer sessions: its answer; None to take it here."""
    siblings = request.app[GATEWAY_KEY].siblings
    if siblings is not None and (target := siblings.target_for_new_call(request)):
        return await siblings.forward(request, target)
    return None


async def realtime_calls(request: web.Request) -> web.Response:
    """POST /v1/realtime/calls: SDP offer in, 201 with the SDP answer and Location out."""
    grant = _authorize(request)
    if isinstance(grant, web.Response):
        return grant
    if (forwarded := await _to_least_loaded(request)) is not None:
        return forwarded
    session = None
    if request.content_type == "multipart/form-data":
        form = await _offer_form(request)
        if isinstance(form, web.Response):
            return form
        sdp, session = form
    elif request.content_type == "application/sdp":
        body = await _read_body(request)
        try:
            sdp = body.decode()
        except UnicodeDecodeError:
            return openai_error(400, "the SDP offer is not UTF-8 text", code="invalid_sdp")
    else:
        return openai_error(
            415,
            "Content-Type must be application/sdp (or multipart/form-data with sdp and "
            f"session), not {request.content_type!r}",
            code="unsupported_media_type",
        )
    result = await _answer(request, sdp, grant, session)
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
    grant = _authorize(request)
    if isinstance(grant, web.Response):
        return grant
    if (forwarded := await _to_least_loaded(request)) is not None:
        return forwarded
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
    result = await _answer(request, data["sdp"], grant)
    if isinstance(result, web.Response):
        return result
    call_id, answer = result
    return web.json_response({"type": "answer", "sdp": answer, "call_id": call_id})


async def hang_up(request: web.Request) -> web.Response:
    """DELETE /v1/realtime/calls/{call_id}, or POST .../hangup (the GA SDK's)."""
    grant = _authorize(request)
    if isinstance(grant, web.Response):
        return grant
    gateway = request.app[GATEWAY_KEY]
    call = gateway.calls.get(request.match_info["call_id"])
    if call is None:
        holder = gateway.siblings and gateway.siblings.holder_of_call(
            request.match_info["call_id"], request
        )
        if holder:
            return await gateway.siblings.forward(request, holder)
        return openai_error(404, "no such call", code="not_found")
    await call.close("hung up by the client")
    return web.Response(status=204 if request.method == "DELETE" else 200)


async def realtime_websocket(request: web.Request) -> web.StreamResponse:
    """GET /v1/realtime?model=...: a Realtime session over a WebSocket."""
    grant = _authorize(request)
    if isinstance(grant, web.Response):
        return grant
    gateway = request.app[GATEWAY_KEY]
    if "call_id" in request.query:
        return openai_error(
            400,
            "joining a WebRTC call's events over a WebSocket (call_id) is not supported",
            code="unsupported",
            param="call_id",
        )
    if request.query.get("intent", "conversation") != "conversation":
        return openai_error(
            400,
            "transcription-only sessions are not supported",
            code="unsupported",
            param="intent",
        )
    if not gateway.is_ready():
        return _not_ready()
    try:
        call = gateway.open_session("sess", grant, request.query.get("model"))
    except SessionsFull as exc:
        return _full(gateway, exc)
    except ProtocolError as exc:
        return _refused(exc)
    ws = websocket_response()
    try:
        await ws.prepare(request)
    except BaseException:
        await call.close("websocket handshake failed")
        raise
    await serve_websocket(request, call, ws)
    return ws


async def client_secrets(request: web.Request) -> web.Response:
    """POST /v1/realtime/client_secrets: mint an ephemeral `ek_` key for a browser."""
    grant = _authorize(request, allow_ephemeral=False)
    if isinstance(grant, web.Response):
        return grant
    gateway = request.app[GATEWAY_KEY]
    body = await _read_body(request)
    try:
        data = json.loads(body) if body.strip() else {}
        if not isinstance(data, dict):
            raise ProtocolError("the body must be a JSON object")
        for key in data:
            if key not in ("expires_after", "session"):
                raise ProtocolError(f"unknown field {key!r}", param=key)
        ttl = None
        if (after := data.get("expires_after")) is not None:
            if not isinstance(after, dict) or after.get("anchor", "created_at") != "created_at":
                raise ProtocolError(
                    "expires_after must be {anchor: 'created_at', seconds: N}",
                    param="expires_after",
                )
            ttl = after.get("seconds", gateway.config.gateway.auth.client_secret_ttl_s)
            if isinstance(ttl, bool) or not isinstance(ttl, int) or not 10 <= ttl <= 7200:
                raise ProtocolError(
                    "expires_after.seconds must be an integer from 10 to 7200",
                    param="expires_after.seconds",
                )
        session = data.get("session") or {"type": "realtime"}
        config = gateway.check_session_config(session)
    except json.JSONDecodeError as exc:
        return openai_error(400, f"invalid JSON: {exc}", code="invalid_json")
    except ProtocolError as exc:
        return _refused(exc)
    try:
        secret = gateway.auth.mint(session, ttl)
    except ValueError as exc:
        return openai_error(400, str(exc), code="session_too_large", param="session")
    return web.json_response(
        {
            "value": secret.value,
            "expires_at": secret.expires_at,
            "session": config.to_json(ev.new_id("sess"), secret.expires_at),
        }
    )


async def audio_speech(request: web.Request) -> web.StreamResponse:
    """POST /v1/audio/speech: the vocoder alone, streamed."""
    grant = _authorize(request, allow_ephemeral=False)
    if isinstance(grant, web.Response):
        return grant
    gateway = request.app[GATEWAY_KEY]
    try:
        fields = speech.parse_request(
            speech.body_json(await _read_body(request)), gateway.config.vocoder.voice
        )
    except ProtocolError as exc:
        return _refused(exc)
    if not gateway.is_ready():
        return _not_ready()
    try:
        utterance = gateway.open_utterance()
    except SessionsFull as exc:
        return _full(gateway, exc)
    try:
        return await speech.respond(request, utterance, fields)
    except (TimeoutError, RuntimeError) as exc:
        logger.error("speech request failed: %s", exc)
        return openai_error(
            500, f"synthesis failed: {exc}", code="vocoder_error", type_="server_error"
        )
    finally:
        gateway.close_utterance(utterance)


async def health(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY_KEY]
    ready = gateway.is_ready()
    return web.json_response(
        {
            "status": "ready" if ready else "starting",
            "calls": len(gateway.calls),
            "process": gateway.instance,
        },
        status=200 if ready else 503,
    )


async def metrics(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY_KEY]
    gateway.update_ring_metrics()
    if MULTIPROCESS:  # every gateway process's figures, summed
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        body = generate_latest(registry)
    else:
        body = generate_latest(gateway.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(
    config: OmniConfig,
    names: RingNames,
    vocoder_rate: int,
    is_ready: Callable[[], bool],
    **process: Any,
) -> web.Application:
    """The app of one gateway process; `process`: Gateway's instance, socket_dir and
    signing_key, for a service of several."""
    app = web.Application(client_max_size=MAX_SDP_BYTES)
    gateway = Gateway(config, names, vocoder_rate, is_ready, **process)
    gateway.auth.announce(f"http://{config.gateway.host}:{config.gateway.port}")
    app[GATEWAY_KEY] = gateway
    app.cleanup_ctx.append(gateway.lifecycle)
    app.router.add_post("/v1/realtime/calls", realtime_calls)
    app.router.add_delete("/v1/realtime/calls/{call_id}", hang_up)
    app.router.add_post("/v1/realtime/calls/{call_id}/hangup", hang_up)
    app.router.add_get("/v1/realtime", realtime_websocket)
    app.router.add_post("/v1/realtime/client_secrets", client_secrets)
    app.router.add_post("/v1/audio/speech", audio_speech)
    app.router.add_post("/offer", offer)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def gateway_of(app: web.Application) -> Gateway:
    return app[GATEWAY_KEY]
