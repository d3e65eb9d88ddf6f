"""The aiohttp application: the OpenAI-shaped HTTP and WebSocket endpoints, health and metrics,
in front of the calls this process carries (gateway.calls)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from gateway import events as ev
from gateway import speech, twilio
from gateway.admission import TooManyCalls
from gateway.auth import AuthError, Grant
from gateway.calls import MULTIPROCESS, Gateway
from gateway.config import OmniConfig
from gateway.cors import add_cors
from gateway.hosts import FORWARDED_HOST, verify
from gateway.http_errors import OpenAIError, openai_shaped_errors
from gateway.json_input import parse_json
from gateway.page import add_page_routes
from gateway.protocol import ProtocolError
from gateway.realtime_url import omni_events, realtime_query
from gateway.siblings import FORWARDED, VOUCHED, client_address, host_of_call
from gateway.websocket import serve_websocket, websocket_response
from stages.link import SessionsFull
from stages.rings import RingNames

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_SDP_BYTES = 64 * 1024
GATEWAY_KEY = web.AppKey("gateway", "Gateway")


async def _read_body(request: web.Request) -> bytes:
    """The whole body (it may come in many pieces), at most the app's client_max_size (413
    past it), within gateway.limits.request_timeout_s (408 past it)."""
    return await _in_time(request, request.read())


async def _in_time(request: web.Request, reading: Awaitable[T]) -> T:
    """A body read, within gateway.limits.request_timeout_s (a client that sends its body
    slowly, or never, holds a connection otherwise); 408 past it."""
    timeout = request.app[GATEWAY_KEY].config.gateway.limits.request_timeout_s
    try:
        async with asyncio.timeout(timeout):
            return await reading
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            text=f"the request's body did not come within {timeout:g} s"
        ) from None


def _authorize(request: web.Request, *, allow_ephemeral: bool = True) -> Grant:
    """The caller's grant; a 429 for an address throttled for wrong keys, a 401 for a wrong
    or missing key."""
    gateway = request.app[GATEWAY_KEY]
    address = client_address(request)
    try:
        gateway.admission.check_auth_rate(address)
        return gateway.auth.check(request, allow_ephemeral=allow_ephemeral)
    except TooManyCalls as exc:
        raise _too_many(gateway, exc, count=False) from None
    except AuthError as exc:
        gateway.admission.auth_failed(address)
        raise OpenAIError(401, str(exc), code=exc.code) from None


def _not_ready() -> OpenAIError:
    return OpenAIError(
        503,
        "the stage workers are not ready",
        code="not_ready",
        type_="server_error",
        headers={"Retry-After": "5"},
    )


def _full(gateway: Gateway, exc: Exception) -> OpenAIError:
    """The refusal of a call when every session is taken, counted."""
    gateway.metrics.sessions_refused.inc()
    return OpenAIError(
        503,
        f"too many calls: {exc}",
        code="capacity",
        type_="server_error",
        headers={"Retry-After": "2"},
    )


def _too_many(gateway: Gateway, exc: TooManyCalls, count: bool = True) -> OpenAIError:
    if count:  # a refused call (not a throttled key)
        gateway.metrics.sessions_refused.inc()
    return OpenAIError(
        429,
        str(exc),
        code="rate_limit_exceeded",
        type_="rate_limit_error",
        headers={"Retry-After": str(exc.retry_after_s)},
    )


def _refused(exc: ProtocolError) -> OpenAIError:
    return OpenAIError(400, str(exc), code=exc.code, param=exc.param)


async def _answer(
    request: web.Request, sdp: str, grant: Grant, session: dict[str, Any] | None = None
) -> tuple[str, str]:
    """The call's id and SDP answer to `sdp`."""
    gateway = request.app[GATEWAY_KEY]
    if not gateway.is_ready():
        raise _not_ready()
    try:
        return await gateway.answer(sdp, grant, session, client_address(request))
    except SessionsFull as exc:
        raise _full(gateway, exc) from None
    except TooManyCalls as exc:
        raise _too_many(gateway, exc) from None
    except ProtocolError as exc:
        raise _refused(exc) from None
    except ValueError as exc:
        raise OpenAIError(400, str(exc), code="invalid_sdp") from None


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


async def _offer_form(request: web.Request) -> tuple[str, dict[str, Any] | None]:
    """The `sdp` and optional `session` (JSON) fields of a multipart/form-data offer, the
    shape OpenAI's SDKs send when they configure the session with the call."""
    try:
        form = await _in_time(request, request.post())
    except web.HTTPException:
        raise  # a body over the size limit: 413
    except Exception as exc:  # aiohttp's multipart reader fails in many ways on bad bodies
        raise OpenAIError(
            400, f"unreadable multipart/form-data body: {exc}", code="invalid_request"
        ) from None
    try:
        sdp, session = _form_text(form.get("sdp")), _form_text(form.get("session"))
    except UnicodeDecodeError:
        raise OpenAIError(
            400, "the form's fields must be UTF-8 text", code="invalid_request"
        ) from None
    if sdp is None:
        raise OpenAIError(400, "the form needs an 'sdp' field", code="invalid_sdp")
    if session is None:
        return sdp, None
    try:
        parsed = parse_json(session, "the 'session' field")
    except ProtocolError as exc:
        raise _refused(exc) from None
    if not isinstance(parsed, dict):
        raise OpenAIError(400, "'session' must be a JSON object", code="invalid_value")
    return sdp, parsed


@web.middleware
async def from_other_hosts(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A request another gateway host forwarded is taken only with the cluster's signature,
    which also vouches for the caller's address (gateway.hosts)."""
    if FORWARDED_HOST in request.headers:
        member = request.app[GATEWAY_KEY].member
        if member is None:
            raise OpenAIError(
                403, "forwarded by a gateway host, but this gateway is in no cluster",
                code="forbidden",
            )  # fmt: skip
        try:
            request[VOUCHED] = verify(member.secret, request, await _read_body(request)) or ""
        except PermissionError as exc:
            raise OpenAIError(403, str(exc), code="forbidden") from None
    return await handler(request)


async def _to_least_loaded(request: web.Request) -> web.Response | None:
    """A new call for another host, or a sibling process, with more room: its answer; None
    to take it here. A host that refuses it (503) is passed over for the next."""
    gateway = request.app[GATEWAY_KEY]
    hosts = gateway.hosts
    if hosts is not None and not hosts.forwarded(request) and FORWARDED not in request.headers:
        here = gateway.load_here()
        free_here = here.free if here is not None and here.ready else 0
        for host in hosts.table.targets_for_new_call(free_here):
            answer = await hosts.forward(request, host, client_address(request))
            if answer.status != 503:
                return answer
    siblings = gateway.siblings
    if siblings is not None and (target := siblings.target_for_new_call(request)):
        return await siblings.forward(request, target)
    return None


async def _to_holder(request: web.Request, call_id: str) -> web.Response | None:
    """A request for a call this process does not hold: the answer of the host or sibling
    process that does; None when nobody else holds it either. A 404 when it is on a host
    that does not answer."""
    gateway = request.app[GATEWAY_KEY]
    host = host_of_call(call_id)
    if gateway.hosts is not None and host is not None and host != gateway.hosts.member.host:
        if gateway.hosts.forwarded(request):
            return None  # forwarded once already
        holder = gateway.hosts.table.host(host)
        if holder is None:
            raise OpenAIError(
                404, f"no such call: gateway host {host}, which held it, is not answering",
                code="not_found",
            )  # fmt: skip
        return await gateway.hosts.forward(request, holder, client_address(request))
    sibling = gateway.siblings and gateway.siblings.holder_of_call(call_id, request)
    if sibling:
        return await gateway.siblings.forward(request, sibling)
    return None


async def realtime_calls(request: web.Request) -> web.Response:
    """POST /v1/realtime/calls: SDP offer in, 201 with the SDP answer and Location out."""
    grant = _authorize(request)
    if (forwarded := await _to_least_loaded(request)) is not None:
        return forwarded
    session = None
    if request.content_type == "multipart/form-data":
        sdp, session = await _offer_form(request)
    elif request.content_type == "application/sdp":
        body = await _read_body(request)
        try:
            sdp = body.decode()
        except UnicodeDecodeError:
            raise OpenAIError(400, "the SDP offer is not UTF-8 text", code="invalid_sdp") from None
    else:
        raise OpenAIError(
            415,
            "Content-Type must be application/sdp (or multipart/form-data with sdp and "
            f"session), not {request.content_type!r}",
            code="unsupported_media_type",
        )
    if (events := omni_events(realtime_query(request.query))) is not None:
        session = {**(session or {}), "omni_events": events}
    call_id, answer = await _answer(request, sdp, grant, session)
    return web.Response(
        status=201,
        text=answer,
        content_type="application/sdp",
        headers={"Location": f"/v1/realtime/calls/{call_id}"},
    )


async def offer(request: web.Request) -> web.Response:
    """POST /offer: aiortc-style JSON {sdp, type} in, JSON {sdp, type, call_id} out."""
    grant = _authorize(request)
    if (forwarded := await _to_least_loaded(request)) is not None:
        return forwarded
    if request.content_type != "application/json":
        raise OpenAIError(
            415, "Content-Type must be application/json", code="unsupported_media_type"
        )
    try:
        data = parse_json(await _read_body(request))
    except ProtocolError as exc:
        raise _refused(exc) from None
    if (
        not isinstance(data, dict)
        or data.get("type") != "offer"
        or not isinstance(data.get("sdp"), str)
    ):
        raise OpenAIError(400, 'expected {"type": "offer", "sdp": "..."}', code="invalid_offer")
    events = omni_events(realtime_query(request.query))
    session = None if events is None else {"omni_events": events}
    call_id, answer = await _answer(request, data["sdp"], grant, session)
    return web.json_response({"type": "answer", "sdp": answer, "call_id": call_id})


async def hang_up(request: web.Request) -> web.Response:
    """DELETE /v1/realtime/calls/{call_id}, or POST .../hangup (the GA SDK's)."""
    _authorize(request)
    gateway = request.app[GATEWAY_KEY]
    call = gateway.calls.get(request.match_info["call_id"])
    if call is None:
        elsewhere = await _to_holder(request, request.match_info["call_id"])
        if elsewhere is None:
            raise OpenAIError(404, "no such call", code="not_found")
        return elsewhere
    await call.close("hung up by the client")
    return web.Response(status=204 if request.method == "DELETE" else 200)


async def realtime_websocket(request: web.Request) -> web.StreamResponse:
    """GET /v1/realtime?model=...: a Realtime session over a WebSocket."""
    grant = _authorize(request)
    gateway = request.app[GATEWAY_KEY]
    query = realtime_query(request.query)
    if "call_id" in query:
        raise OpenAIError(
            400,
            "joining a WebRTC call's events over a WebSocket (call_id) is not supported",
            code="unsupported",
            param="call_id",
        )
    if query.get("intent", "conversation") != "conversation":
        raise OpenAIError(
            400,
            "transcription-only sessions are not supported",
            code="unsupported",
            param="intent",
        )
    if not gateway.is_ready():
        raise _not_ready()
    try:
        call = gateway.open_session("sess", grant, query.get("model"), client_address(request))
    except SessionsFull as exc:
        raise _full(gateway, exc) from None
    except TooManyCalls as exc:
        raise _too_many(gateway, exc) from None
    except ProtocolError as exc:
        raise _refused(exc) from None
    if (events := omni_events(query)) is not None:
        call.config.omni_events = events
    ws = websocket_response()
    try:
        await ws.prepare(request)
    except BaseException:
        await call.close("websocket handshake failed")
        raise
    await serve_websocket(request, call, ws, gateway.config.gateway.limits.first_event_timeout_s)
    return ws


async def twilio_stream(request: web.Request) -> web.StreamResponse:
    """GET /v1/telephony/twilio: a Twilio Media Stream (TwiML <Connect><Stream>) as a phone
    call; its key comes in the stream's parameters, checked at its start (gateway.twilio)."""
    gateway = request.app[GATEWAY_KEY]
    if not gateway.is_ready():
        raise _not_ready()
    ws = web.WebSocketResponse(max_msg_size=twilio.MAX_MESSAGE_BYTES, heartbeat=30)
    await ws.prepare(request)
    await twilio.serve_stream(gateway, request, ws, client_address(request))
    return ws


async def client_secrets(request: web.Request) -> web.Response:
    """POST /v1/realtime/client_secrets: mint an ephemeral `ek_` key for a browser."""
    _authorize(request, allow_ephemeral=False)
    gateway = request.app[GATEWAY_KEY]
    body = await _read_body(request)
    try:
        data = parse_json(body) if body.strip() else {}
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
        session = data.get("session")
        if session is None:
            session = {"type": "realtime"}
        if not isinstance(session, dict):
            raise ProtocolError("session must be an object", param="session")
        config = gateway.check_session_config(session)
    except ProtocolError as exc:
        raise _refused(exc) from None
    try:
        secret = gateway.auth.mint(session, ttl)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), code="session_too_large", param="session") from None
    return web.json_response(
        {
            "value": secret.value,
            "expires_at": secret.expires_at,
            "session": config.to_json(ev.new_id("sess"), secret.expires_at),
        }
    )


async def audio_speech(request: web.Request) -> web.StreamResponse:
    """POST /v1/audio/speech: the vocoder alone, streamed."""
    _authorize(request, allow_ephemeral=False)
    gateway = request.app[GATEWAY_KEY]
    try:
        fields = speech.parse_request(
            parse_json(await _read_body(request)), gateway.config.vocoder.voice
        )
    except ProtocolError as exc:
        raise _refused(exc) from None
    if not gateway.is_ready():
        raise _not_ready()
    try:
        speech_request = gateway.open_speech_request()
    except SessionsFull as exc:
        raise _full(gateway, exc) from None
    try:
        return await speech.respond(request, speech_request, fields)
    except (TimeoutError, RuntimeError) as exc:
        logger.error("speech request failed: %s", exc)
        raise OpenAIError(
            500, f"synthesis failed: {exc}", code="vocoder_error", type_="server_error"
        ) from None
    finally:
        gateway.close_speech_request(speech_request)


async def health(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY_KEY]
    ready = gateway.is_ready()
    body: dict[str, Any] = {
        "status": "ready" if ready else "starting",
        "calls": len(gateway.calls),
        "process": gateway.instance,
    }
    if gateway.hosts is not None:  # this host and the others it hears from
        body["host"] = gateway.hosts.member.host
        body["hosts"] = [
            {"host": h.host, "url": h.url, "free": h.free, "capacity": h.capacity, "ready": h.ready}
            for h in sorted(gateway.hosts.table.hosts(), key=lambda h: h.host)
        ]
    return web.json_response(body, status=200 if ready else 503)


async def metrics(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY_KEY]
    try:
        gateway.scrape_auth.check(request)
    except AuthError as exc:
        raise OpenAIError(401, str(exc), code=exc.code) from None
    gateway.update_ring_metrics()
    if MULTIPROCESS:  # every gateway process's figures, summed
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        body = generate_latest(registry)
    else:
        body = generate_latest(gateway.metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(
    config: OmniConfig,
    names: RingNames,
    vocoder_rate: int,
    is_ready: Callable[[], bool],
    *,
    page: bool = True,
    **process: Any,
) -> web.Application:
    """The whole app of one gateway process, the first or another (gateway.gateway_process):
    the Realtime endpoints, health, metrics, CORS and with `page` the demo page at /.
    `process`: Gateway's instance, socket_dir and signing_key, for a service of several, and
    member, for a host of a cluster."""
    app = web.Application(
        client_max_size=MAX_SDP_BYTES,
        middlewares=[openai_shaped_errors, from_other_hosts],
        # a connection that sends no whole request (half-sent headers, or idle between
        # requests) is closed after this: aiohttp waits an hour by default
        handler_args={"keepalive_timeout": config.gateway.limits.request_timeout_s},
    )
    gateway = Gateway(config, names, vocoder_rate, is_ready, **process)
    gateway.auth.announce(f"http://{config.gateway.host}:{config.gateway.port}")
    app[GATEWAY_KEY] = gateway
    add_cors(app, config.gateway.cors)
    app.cleanup_ctx.append(gateway.lifecycle)
    app.router.add_post("/v1/realtime/calls", realtime_calls)
    app.router.add_delete("/v1/realtime/calls/{call_id}", hang_up)
    app.router.add_post("/v1/realtime/calls/{call_id}/hangup", hang_up)
    app.router.add_get("/v1/realtime", realtime_websocket)
    app.router.add_post("/v1/realtime/client_secrets", client_secrets)
    app.router.add_post("/v1/audio/speech", audio_speech)
    app.router.add_post("/offer", offer)
    if config.gateway.telephony.twilio:
        try:
            twilio.check_profiles(gateway)
        except ProtocolError as exc:
            raise ValueError(f"gateway.telephony: {exc}") from None
        app.router.add_get(twilio.PATH, twilio_stream)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    if page:
        add_page_routes(app)
    return app


def gateway_of(app: web.Application) -> Gateway:
    return app[GATEWAY_KEY]
