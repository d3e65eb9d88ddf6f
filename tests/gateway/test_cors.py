"""gateway.cors: preflights and the headers of answers, from the gateway served on 127.0.0.1 on
rings no stage reads (tests/web/test_agents_sdk.py is the real SDK in a real browser)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiortc import RTCPeerConnection

from gateway.app import gateway_of
from gateway.config import ConfigError, load_config
from tests.serving import serving_gateway_alone

pytestmark = pytest.mark.timeout(60)

TINY = Path(__file__).parents[2] / "configs" / "tiny.yaml"
KEY = "sk-cors-test"
PAGE = "http://127.0.0.1:5173"
ELSEWHERE = "https://evil.example"
# what Chromium asks before the Agents SDK's WebRTC offer (its fetch in openaiRealtimeWebRtc)
SDK_PREFLIGHT = {
    "Origin": PAGE,
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type,x-openai-agents-sdk",
}


def config(**cors: Any):
    return load_config(
        TINY,
        {
            "gateway.auth": {"api_keys": [KEY], "api_keys_env": None},
            "gateway.cors": cors,
            "gateway.media.gc_freeze": False,
        },
    )


@asynccontextmanager
async def gateway(**cors: Any) -> AsyncIterator[tuple[str, aiohttp.ClientSession, web.Application]]:
    async with (
        serving_gateway_alone(config(**cors)) as (base, app),
        aiohttp.ClientSession() as http,
    ):
        yield base, http, app


def listed(response: aiohttp.ClientResponse, header: str) -> set[str]:
    """A comma-separated header's items, lower-cased."""
    return {item.strip().lower() for item in response.headers.get(header, "").split(",")}


def cors_headers(response: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}


def test_origins_are_checked_as_the_config_is_read() -> None:
    assert config().gateway.cors.allowed_origins == []  # none by default
    assert config(allowed_origins=["HTTPS://App.Example"]).gateway.cors.allowed_origins == [
        "https://app.example"
    ]
    for bad in (["https://app.example/"], ["app.example"], ["https://app.example/x"], ["*", PAGE]):
        with pytest.raises(ConfigError, match="allowed_origins"):
            config(allowed_origins=bad)


async def test_preflight_of_an_allowed_origin_names_what_it_may_send() -> None:
    async with gateway(allowed_origins=[PAGE], max_age_s=300) as (base, http, _):
        for path in ("/v1/realtime/calls", "/v1/realtime/client_secrets"):
            async with http.options(f"{base}{path}", headers=SDK_PREFLIGHT) as r:
                assert r.status == 204, path
                assert r.headers["Access-Control-Allow-Origin"] == PAGE
                assert "post" in listed(r, "Access-Control-Allow-Methods")
                allowed = listed(r, "Access-Control-Allow-Headers")
                assert {"authorization", "content-type", "x-openai-agents-sdk"} <= allowed
                assert r.headers["Access-Control-Max-Age"] == "300"
                assert "Origin" in r.headers["Vary"]
        # the hang-ups; the openai SDK's x-stainless-* headers are echoed, whichever it sends
        asked = {**SDK_PREFLIGHT, "Access-Control-Request-Headers": "authorization,x-stainless-os"}
        for method, path in [
            ("DELETE", "/v1/realtime/calls/rtc_x"),
            ("POST", "/v1/realtime/calls/rtc_x/hangup"),
        ]:
            headers = {**asked, "Access-Control-Request-Method": method}
            async with http.options(f"{base}{path}", headers=headers) as r:
                assert r.status == 204, path
                assert method.lower() in listed(r, "Access-Control-Allow-Methods")
                assert "x-stainless-os" in listed(r, "Access-Control-Allow-Headers")


async def test_preflight_of_another_origin_is_refused_without_cors_headers() -> None:
    for allowed in ([PAGE], []):  # [] is the default: no other origin at all
        async with gateway(allowed_origins=allowed) as (base, http, _):
            headers = {**SDK_PREFLIGHT, "Origin": ELSEWHERE}
            async with http.options(f"{base}/v1/realtime/calls", headers=headers) as r:
                assert r.status == 403
                assert not cors_headers(r)
                error = (await r.json())["error"]
                assert error["code"] == "origin_not_allowed" and ELSEWHERE in error["message"]
                assert "gateway.cors.allowed_origins" in error["message"]
            # the request itself, had a browser sent it: answered, but not readable there
            auth = {"Origin": ELSEWHERE, "Authorization": f"Bearer {KEY}"}
            async with http.post(f"{base}/v1/realtime/client_secrets", headers=auth) as r:
                assert r.status == 200 and not cors_headers(r)
                assert "Origin" in r.headers["Vary"]


async def test_any_origin() -> None:
    async with gateway(allowed_origins=["*"]) as (base, http, _):
        headers = {**SDK_PREFLIGHT, "Origin": ELSEWHERE}
        async with http.options(f"{base}/v1/realtime/calls", headers=headers) as r:
            assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == "*"
        auth = {"Origin": ELSEWHERE, "Authorization": f"Bearer {KEY}"}
        async with http.post(f"{base}/v1/realtime/client_secrets", headers=auth) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "*"


async def sdp_offer() -> tuple[RTCPeerConnection, str]:
    pc = RTCPeerConnection()
    pc.addTransceiver("audio", direction="sendrecv")
    pc.createDataChannel("oai-events")
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


async def test_a_call_its_location_and_its_hang_up_reach_the_page() -> None:
    async with gateway(allowed_origins=[PAGE]) as (base, http, app):
        pc, offer = await sdp_offer()
        try:
            headers = {
                "Origin": PAGE,
                "Authorization": f"Bearer {KEY}",
                "Content-Type": "application/sdp",
            }
            async with http.post(f"{base}/v1/realtime/calls", data=offer, headers=headers) as r:
                assert r.status == 201, await r.text()
                assert r.headers["Access-Control-Allow-Origin"] == PAGE
                # the SDK reads the call id from Location: a page sees it only when exposed
                exposed = listed(r, "Access-Control-Expose-Headers")
                assert {"location", "retry-after"} <= exposed
                location = r.headers["Location"]
            call = gateway_of(app).calls[location.rsplit("/", 1)[1]]
            async with http.delete(f"{base}{location}", headers=headers) as r:
                assert r.status == 204 and r.headers["Access-Control-Allow-Origin"] == PAGE
            async with asyncio.timeout(10):
                await call.closed.wait()
            assert not gateway_of(app).calls
        finally:
            await pc.close()


async def test_errors_reach_the_page_too() -> None:
    """The SDK shows the gateway's reason for a refusal: only a page that may read it can."""
    async with gateway(allowed_origins=[PAGE]) as (base, http, _):
        wrong = {"Origin": PAGE, "Authorization": "Bearer sk-wrong"}
        async with http.post(f"{base}/v1/realtime/calls", data="v=0", headers=wrong) as r:
            assert r.status == 401 and r.headers["Access-Control-Allow-Origin"] == PAGE
            assert (await r.json())["error"]["code"] == "invalid_api_key"
        auth = {"Origin": PAGE, "Authorization": f"Bearer {KEY}"}
        async with http.post(f"{base}/v1/realtime/calls/rtc_nope/hangup", headers=auth) as r:
            assert r.status == 404 and r.headers["Access-Control-Allow-Origin"] == PAGE
        # raised by the handler, not returned: marked all the same
        too_big = b"{" + b" " * (128 * 1024)
        async with http.post(f"{base}/v1/realtime/client_secrets", data=too_big, headers=auth) as r:
            assert r.status == 413 and r.headers["Access-Control-Allow-Origin"] == PAGE


async def test_metrics_health_and_the_rest_have_no_cors() -> None:
    async with gateway(allowed_origins=["*"]) as (base, http, _):
        for path in ("/metrics", "/health", "/offer", "/v1/realtime"):
            async with http.options(f"{base}{path}", headers=SDK_PREFLIGHT) as r:
                assert r.status == 405 and not cors_headers(r), path
        async with http.get(f"{base}/metrics", headers={"Origin": PAGE}) as r:
            assert r.status == 200 and not cors_headers(r)
            assert "Origin" not in r.headers.get("Vary", "")
