"""The OpenAI Agents JS SDK (`@openai/agents-realtime`, its own browser bundle) in Debian's
chromium, on a page served from another origin than the gateway's: its WebRTC transport posts
the offer across origins (gateway.cors), its session talks over the call's data channel, and
the fake microphone's question is answered, with the offline stages (pocketsphinx, vLLM on the
tiny random-weight model, espeak-ng) on real rings. The same page on an origin the gateway
does not allow cannot connect.

tests/web/agents_sdk holds the SDK's pinned package (scripts/setup.sh --test runs `npm ci`
there) and the page.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web
from playwright.async_api import Browser, Page

from gateway.app import gateway_of
from stages.audio import write_wav
from tests.serving import serving, tiny_call_config
from tests.web.browser import PageProblems, launched

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

SDK = Path(__file__).parent / "agents_sdk"
BUNDLE = SDK / "node_modules" / "@openai" / "agents-realtime" / "dist" / "bundle"
API_KEY = "sk-agents-sdk-test"
QUESTION = "what is the weather like today in paris"
LEAD_S = 3.0  # covers getUserMedia -> call connected; speech before that would be lost
SECONDS = 1000  # Playwright timeouts are in ms


def page_app() -> web.Application:
    """The SDK's page and its bundle, as another site would serve them."""
    app = web.Application()

    async def index(request: web.Request) -> web.FileResponse:
        return web.FileResponse(SDK / "page" / "index.html")

    app.router.add_get("/", index)
    app.router.add_static("/app/", SDK / "page")
    app.router.add_static("/sdk/", BUNDLE)
    return app


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def page_origins() -> AsyncIterator[tuple[str, str]]:
    """The page from two origins: one the gateway allows, one it does not."""
    if not (BUNDLE / "openai-realtime-agents.mjs").is_file():
        pytest.fail(f"the Agents SDK is not installed: scripts/setup.sh --test (npm ci in {SDK})")
    async with serving(page_app()) as allowed, serving(page_app()) as other:
        yield allowed, other


@pytest.fixture(scope="module")
def config(page_origins):
    allowed, _ = page_origins
    return tiny_call_config(
        {
            "gateway.max_output_tokens": 16,  # short replies: only that they come is tested
            "gateway.auth": {"api_keys": [API_KEY], "api_keys_env": None},
            "gateway.cors": {"allowed_origins": [allowed]},
        }
    )


@pytest.fixture(scope="module")
def question_wav(make_speech, tmp_path_factory) -> Path:
    """Silence while the call connects, the question, then silence for the turn to end."""
    silence = np.zeros(int(16000 * LEAD_S), np.int16)
    pcm = np.concatenate([silence, make_speech(QUESTION).pcm16, np.zeros(16000, np.int16)])
    path = tmp_path_factory.mktemp("microphone") / "question.wav"
    write_wav(path, pcm, 16000)
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser(question_wav) -> AsyncIterator[Browser]:
    async with launched(question_wav) as browser:
        yield browser


@pytest_asyncio.fixture(loop_scope="module")
async def page(browser) -> AsyncIterator[Page]:
    context = await browser.new_context()
    page = await context.new_page()
    page.set_default_timeout(10 * SECONDS)
    yield page
    await context.close()


async def client_secret(base: str) -> str:
    """An `ek_` key, minted by the app's server with its API key, as OpenAI's docs do."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{base}/v1/realtime/client_secrets",
            json={"session": {"type": "realtime"}},
            headers={"Authorization": f"Bearer {API_KEY}"},
        ) as r,
    ):
        assert r.status == 200, await r.text()
        return (await r.json())["value"]


async def open_page(page: Page, origin: str) -> None:
    await page.goto(f"{origin}/")
    await page.wait_for_function("window.agentsCall !== undefined")


async def connect(page: Page, base: str, key: str) -> Any:
    return await page.evaluate(
        "(options) => window.agentsCall.connect(options)",
        {"url": f"{base}/v1/realtime/calls", "apiKey": key},
    )


async def seen(page: Page, event: str, times: int = 1, timeout_s: float = 30) -> None:
    await page.wait_for_function(
        "([type, times]) => window.agentsCall.seen(type) >= times",
        arg=[event, times],
        timeout=timeout_s * SECONDS,
    )


async def test_the_sdk_on_another_origin_connects_and_is_answered(
    server, page_origins, page
) -> None:
    base, app = server
    allowed, _ = page_origins
    gateway = gateway_of(app)
    problems = PageProblems(page)
    key = await client_secret(base)
    await open_page(page, allowed)

    connected = await connect(page, base, key)
    # the call id comes from Location, which a page on another origin reads only if exposed
    assert connected["status"] == "connected"
    assert connected["callId"] in gateway.calls
    call = gateway.calls[connected["callId"]]
    await seen(page, "session.created")
    await seen(page, "session.updated")

    # the fake microphone's question is heard and answered
    await seen(page, "input_audio_buffer.speech_started")
    await seen(page, "conversation.item.input_audio_transcription.completed")
    await seen(page, "response.done", timeout_s=60)

    # a typed message: conversation.item.create, then response.create, over the data channel
    await page.evaluate("window.agentsCall.session.sendMessage('and what about tomorrow')")
    await seen(page, "response.done", times=2, timeout_s=60)

    assert await page.evaluate("window.agentsCall.errors") == []

    # the hang-up, across origins as well: the SDK sees the call end
    status = await page.evaluate(
        "(options) => window.agentsCall.hangUp(options)",
        {"url": f"{base}/v1/realtime/calls", "apiKey": key},
    )
    assert status == 204
    async with asyncio.timeout(10):
        await call.closed.wait()
    assert not gateway.calls
    await page.wait_for_function("window.agentsCall.session.transport.status === 'disconnected'")
    assert not problems.messages, problems.messages


async def test_the_sdk_on_an_origin_not_allowed_cannot_connect(server, page_origins, page) -> None:
    base, app = server
    _, other = page_origins
    problems = PageProblems(page)
    key = await client_secret(base)
    await open_page(page, other)

    refused = await page.evaluate(
        """async (options) => {
            try {
                await window.agentsCall.connect(options);
                return null;
            } catch (error) {
                return String(error?.message ?? error);
            }
        }""",
        {"url": f"{base}/v1/realtime/calls", "apiKey": key},
    )
    assert refused == "Failed to fetch"  # what a browser says of a request CORS blocked
    assert any("blocked by CORS policy" in m for m in problems.messages), problems.messages
    assert not gateway_of(app).calls
