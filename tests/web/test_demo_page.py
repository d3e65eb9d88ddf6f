"""The demo page in a real browser: Debian's chromium driven by Playwright, its fake microphone
playing espeak-ng speech, calling the gateway over 127.0.0.1 with the offline stages
(pocketsphinx, vLLM on the tiny random-weight model, espeak-ng) on real rings.

One browser and one stage pipeline serve the whole module. Each page opens the microphone
afresh, and Chromium then plays the fake-capture WAV from its start: a question, a pause long
enough for the agent to start its reply, then more speech that cuts the reply off.
"""

from __future__ import annotations

import asyncio
import re
import wave
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web
from PIL import Image
from playwright.async_api import Browser, Page, expect

from gateway.app import gateway_of
from gateway.page import add_page_routes
from tests.serving import metric, serving, tiny_call_config
from tests.web.browser import PageProblems, launched

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.asyncio(loop_scope="module")]

RATE = 16000
LEAD_S = 2.0  # covers getUserMedia -> call connected; speech before that would be lost
PAUSE_S = 6.0  # the agent starts speaking 0.2-2 s after the question on 2 busy cores
QUESTION = "what is the weather like today in paris"
INTERRUPTION = "stop please I have another question"
SECONDS = 1000  # Playwright timeouts are in ms
API_KEY = "sk-demo-page-test"


@pytest.fixture(scope="module")
def config():
    return tiny_call_config(
        {
            # replies long enough (about 13 s of speech) to be talked over
            "gateway.max_output_tokens": 48,
            # the page sends the key the person types; without it calls are refused
            "gateway.auth": {"api_keys": [API_KEY], "api_keys_env": None},
        }
    )


@pytest.fixture(scope="module")
def barge_in_wav(make_speech, tmp_path_factory) -> Path:
    """Silence, the question, a pause for the agent's reply, the interruption, silence."""
    silence = lambda s: np.zeros(int(RATE * s), np.int16)  # noqa: E731
    pcm = np.concatenate(
        [
            silence(LEAD_S),
            make_speech(QUESTION).pcm16,
            silence(PAUSE_S),
            make_speech(INTERRUPTION).pcm16,
            silence(1.0),
        ]
    )
    path = tmp_path_factory.mktemp("microphone") / "barge_in.wav"
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(RATE)
        out.writeframes(pcm.tobytes())
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser(barge_in_wav) -> AsyncIterator[Browser]:
    async with launched(barge_in_wav) as browser:
        yield browser


@pytest_asyncio.fixture(loop_scope="module")
async def page(browser) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1100, "height": 900})
    page = await context.new_page()
    page.set_default_timeout(10 * SECONDS)
    yield page
    await context.close()


def assert_not_blank(path: Path) -> None:
    """A screenshot with something drawn: a blank or single-colour page has no variance."""
    pixels = np.asarray(Image.open(path).convert("L"), dtype=np.float64)
    assert pixels.std() > 8, f"{path} looks blank (pixel std {pixels.std():.1f})"


async def audio_in(page: Page) -> dict:
    """The agent's audio as the page receives and plays it."""
    return await page.evaluate(
        """async () => {
            const { inbound } = await window.omniDemo.client.audioStats();
            const audio = document.getElementById("agent-audio");
            return {
                bytes: inbound?.bytesReceived ?? 0,
                packets: inbound?.packetsReceived ?? 0,
                paused: audio.paused,
                time: audio.currentTime,
                ready: audio.readyState,
            };
        }"""
    )


async def test_call_transcripts_audio_barge_in_and_hang_up(server, page, tmp_path) -> None:
    base, app = server
    gateway = gateway_of(app)
    problems = PageProblems(page)
    barge_ins_before = await metric(base, "omni_barge_ins_total")
    await page.goto(f"{base}/")
    await page.locator("summary", has_text="Settings").click()
    await page.get_by_label("API key (optional)").fill(API_KEY)

    # connect: the SDP offer goes to /v1/realtime/calls with the key, asking for the gateway's
    # own events (the page shows first audio and cancel from them); a 201 answer comes back
    calls = "/v1/realtime/calls?omni_events=on"
    async with page.expect_response(lambda r: r.url.endswith(calls)) as answer:
        await page.get_by_role("button", name="Connect", exact=True).click()
    offer = (await answer.value).request
    assert (await answer.value).status == 201
    assert await offer.header_value("content-type") == "application/sdp"
    assert await offer.header_value("authorization") == f"Bearer {API_KEY}"
    await expect(page.locator("#call-state")).to_have_text("Connected", timeout=20 * SECONDS)
    assert len(gateway.calls) == 1
    call = next(iter(gateway.calls.values()))
    # with the permission granted, the microphones are listed by name to choose from
    fake_mic = page.locator("#microphone option", has_text="Fake")
    await expect(fake_mic.first).to_be_attached()

    # the server hears the question: a turn of the caller's appears, then its transcript
    you = page.locator("#turns li.user").first
    await expect(you).to_be_visible(timeout=15 * SECONDS)
    assert await metric(base, 'omni_vad_events_total{event="speech_started"}') >= 1
    await expect(you).to_have_attribute("data-state", "done", timeout=20 * SECONDS)
    # pocketsphinx on espeak's voice: "weather" comes out as its homophone "whether" at times
    heard = re.compile(r"what|weather|whether|today|paris", re.I)
    await expect(you.locator(".text")).to_have_text(heard)

    # the agent answers: its audio arrives, plays, and carries sound; its transcript shows
    agent = page.locator("#turns li.agent").first
    await expect(agent).to_be_visible(timeout=20 * SECONDS)
    await expect(page.locator("#agent-state")).to_have_text("speaking", timeout=20 * SECONDS)
    before = await audio_in(page)
    await page.wait_for_function(
        """([bytes, packets, time]) => {
            const inbound = window.omniDemo.stats?.inbound;  // the page samples it every second
            const audio = document.getElementById("agent-audio");
            return inbound && inbound.bytesReceived > bytes + 8000
                && inbound.packetsReceived > packets + 25
                && !audio.paused && audio.readyState >= 2 && audio.currentTime > time + 0.5;
        }""",
        arg=[before["bytes"], before["packets"], before["time"]],
        timeout=15 * SECONDS,
    )
    # the page's analyser of the received stream sees the agent's voice, not Opus silence
    await page.wait_for_function(
        "document.getElementById('agent-level').value > 0.05", timeout=10 * SECONDS
    )
    await expect(agent.locator(".text")).to_have_text(re.compile(r"[^\s…]{2,}"))

    # the interruption cuts the reply: the page marks it and measures when the voice stopped
    await expect(agent).to_have_attribute("data-state", "cut", timeout=25 * SECONDS)
    await expect(agent.locator(".turn-state")).to_have_text("interrupted by you")
    await expect(agent.locator(".cut-mark")).to_be_visible()
    await expect(page.locator("#v-cut")).to_have_text(re.compile(r"^\d+ ms$"), timeout=5 * SECONDS)
    # the gateway's own cancel latency (CANCEL to the last stage's ack) reaches the page
    await expect(page.locator("#v-cancel")).to_have_text(re.compile(r"^[\d.]+ ms$"))
    silent_after_ms = int((await page.locator("#v-cut").text_content()).split()[0])
    # a sanity bound for one sample on a busy machine (test_call_e2e measures the p95): it
    # catches a cut that waits for the end of a phrase, or audio that never stops
    assert silent_after_ms < 1500, f"the agent's voice went on {silent_after_ms} ms after the cut"
    assert await metric(base, "omni_barge_ins_total") == barge_ins_before + 1
    # ... and the interruption is a new turn of the caller's
    await expect(page.locator("#turns li.user").nth(1)).to_be_visible(timeout=10 * SECONDS)
    await expect(page.locator("#v-turn")).to_have_text(re.compile(r"^\d+ ms$"))
    await expect(page.locator("#v-first")).to_have_text(re.compile(r"^\d+ ms$"))

    shot = tmp_path / "call.png"
    await page.screenshot(path=str(shot), full_page=True)
    assert_not_blank(shot)

    # hang up: the gateway tears the call down and frees its pipeline session
    async with page.expect_response(lambda r: r.url.endswith("/hangup")) as hangup:
        await page.get_by_role("button", name="Disconnect", exact=True).click()
    assert (await hangup.value).status == 200  # the key went with it
    await expect(page.locator("#call-state")).to_have_text("Disconnected")
    async with asyncio.timeout(10):
        await call.closed.wait()
    assert not gateway.calls and not gateway.link.control.holder(call.session)
    async with aiohttp.ClientSession() as http, http.get(f"{base}/health") as r:
        assert (await r.json())["calls"] == 0
    assert await metric(base, "omni_sessions") == 0
    assert await page.evaluate("window.omniDemo.microphone === null && !window.omniDemo.client.pc")
    assert not problems.messages, problems.messages


async def test_page_is_labelled_and_fits_a_phone(server, browser, tmp_path) -> None:
    base, _ = server
    context = await browser.new_context(
        viewport={"width": 375, "height": 740}, is_mobile=True, has_touch=True
    )
    try:
        page = await context.new_page()
        problems = PageProblems(page)
        await page.goto(f"{base}/")
        for role, name in [
            ("button", "Connect"),
            ("button", "Disconnect"),
            ("combobox", "Microphone"),
            ("status", None),
            ("alert", None),
            ("meter", "Agent audio level"),
            ("meter", "Reply after you stopped"),
            ("meter", "Barge-in: agent silent after"),
            ("list", None),
        ]:
            await expect(page.get_by_role(role, name=name, exact=True).first).to_be_attached()
        await expect(page.get_by_label("API key (optional)")).to_be_attached()
        await expect(page.locator("#call-state")).to_have_text("Not connected")
        await expect(page.get_by_role("button", name="Disconnect", exact=True)).to_be_disabled()
        # nothing wider than the screen; the main button is a finger-sized target on it
        assert await page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
        box = await page.get_by_role("button", name="Connect", exact=True).bounding_box()
        assert box and box["x"] >= 0 and box["x"] + box["width"] <= 375 and box["height"] >= 44
        shot = tmp_path / "phone.png"
        await page.screenshot(path=str(shot), full_page=True)
        assert_not_blank(shot)
        assert not problems.messages, problems.messages
    finally:
        await context.close()


async def test_refused_microphone_is_explained(server, browser) -> None:
    base, app = server
    context = await browser.new_context()
    try:
        page = await context.new_page()
        # what a browser does when the person (or a policy) says no
        await page.add_init_script(
            """navigator.mediaDevices.getUserMedia = async () => {
                throw new DOMException("Permission denied", "NotAllowedError");
            };"""
        )
        posted = []
        page.on("request", lambda r: posted.append(r.url) if r.method == "POST" else None)
        await page.goto(f"{base}/")
        await page.get_by_role("button", name="Connect", exact=True).click()
        await expect(page.get_by_role("alert")).to_contain_text("Microphone access was refused")
        await expect(page.locator("#call-state")).to_have_text("Not connected")
        await expect(page.get_by_role("button", name="Connect", exact=True)).to_be_enabled()
        assert not posted and not gateway_of(app).calls
    finally:
        await context.close()


async def test_call_without_the_key_is_refused(server, page) -> None:
    base, app = server
    await page.goto(f"{base}/")
    calls = "/v1/realtime/calls?omni_events=on"
    async with page.expect_response(lambda r: r.url.endswith(calls)) as answer:
        await page.get_by_role("button", name="Connect", exact=True).click()
    assert (await answer.value).status == 401
    await expect(page.get_by_role("alert")).to_contain_text("The gateway refused the API key")
    await expect(page.locator("#call-state")).to_contain_text("Connection failed")
    await expect(page.get_by_role("button", name="Connect", exact=True)).to_be_enabled()
    assert await page.evaluate("window.omniDemo.microphone === null")
    assert not gateway_of(app).calls


async def test_gateway_refusal_is_shown(server, page) -> None:
    """A 503 from admission control reaches the person with the gateway's reason."""
    base, _ = server
    await page.route(
        "**/v1/realtime/calls?*",
        lambda route: route.fulfill(
            status=503,
            headers={"Retry-After": "2"},
            json={
                "error": {
                    "message": "too many calls: 24 calls in progress, the configured maximum",
                    "type": "server_error",
                    "code": "capacity",
                    "param": None,
                }
            },
        ),
    )
    await page.goto(f"{base}/")
    await page.get_by_role("button", name="Connect", exact=True).click()
    alert = page.get_by_role("alert")
    await expect(alert).to_contain_text("too many calls", timeout=15 * SECONDS)
    await expect(alert).to_contain_text("Try again in 2 s")
    await expect(page.locator("#call-state")).to_contain_text("Connection failed")
    await expect(page.get_by_role("button", name="Connect", exact=True)).to_be_enabled()
    assert await page.evaluate("window.omniDemo.microphone === null")


# events as the gateway sends them, with arrival times; the model must read either order of
# a barge-in's cut and speech_started, and a cut of a reply already generated in full
CONVERSATION_SCENARIO = """async () => {
    const { Conversation } = await import("/web/conversation.js");
    const c = new Conversation();
    const feed = (t, type, fields = {}) => c.apply({ type, receivedAt: t, ...fields });
    const item = (id, transcript) => ({ id, content: [{ type: "output_audio", transcript }] });
    feed(0, "input_audio_buffer.speech_started", { item_id: "u1" });
    feed(10, "conversation.item.input_audio_transcription.delta", { item_id: "u1", delta: "hel" });
    const partial = c.entries[0].partial;
    feed(900, "input_audio_buffer.speech_stopped", { item_id: "u1" });
    feed(901, "input_audio_buffer.committed", { item_id: "u1" });
    feed(1000, "conversation.item.input_audio_transcription.completed",
         { item_id: "u1", transcript: "hello there" });
    feed(1001, "response.created", { response: { id: "r1" } });
    feed(1002, "response.output_item.added", { response_id: "r1", item: { id: "a1" } });
    feed(1050, "response.output_audio_transcript.delta",
         { response_id: "r1", item_id: "a1", delta: "one two " });
    feed(1100, "output_audio_buffer.started", { response_id: "r1" });
    feed(1101, "omni.response.first_audio",
         { response_id: "r1", turn_latency_ms: 195.5, time_to_first_audio_ms: 98.2 });
    const speaking = c.agentSpeaking;
    feed(1200, "response.output_audio_transcript.delta",
         { response_id: "r1", item_id: "a1", delta: "three four" });
    feed(1300, "response.done", { response: { id: "r1", status: "completed",
                                              output: [item("a1", "one two three four")] } });
    // generated in full, still playing: the caller talks over it
    feed(2000, "output_audio_buffer.cleared", { response_id: "r1" });
    feed(2001, "conversation.item.truncated", { item_id: "a1", audio_end_ms: 640 });
    feed(2003, "input_audio_buffer.speech_started", { item_id: "u2" });
    feed(2010, "omni.response.cancelled", { response_id: "r1", cancel_latency_ms: 4.2 });
    feed(2020, "conversation.item.retrieved", { item: item("a1", "one two") });
    c.audioSilentAt(2150);
    const r1 = c.entries[1];
    // a reply still being generated, cut with speech_started first
    feed(3000, "input_audio_buffer.speech_stopped", { item_id: "u2" });
    feed(3001, "input_audio_buffer.committed", { item_id: "u2" });
    feed(3100, "response.created", { response: { id: "r2" } });
    feed(3300, "output_audio_buffer.started", { response_id: "r2" });
    feed(3900, "input_audio_buffer.speech_started", { item_id: "u3" });
    feed(3901, "output_audio_buffer.cleared", { response_id: "r2" });
    feed(3902, "response.done", { response: { id: "r2", status: "cancelled",
        status_details: { type: "cancelled", reason: "turn_detected" }, output: [] } });
    const r2 = c.entries[3];
    return {
        partial, speaking, kinds: c.entries.map((e) => e.kind),
        user: c.entries[0].transcript,
        r1: { state: r1.state, cutBy: r1.cutBy, heard: r1.heard, heardMs: r1.heardMs,
              text: r1.text, latency: r1.latency, measuredBy: r1.measuredBy },
        r2: { state: r2.state, cutBy: r2.cutBy, userItemId: r2.userItemId, latency: r2.latency },
        agentSpeaking: c.agentSpeaking,
    };
}"""


@pytest_asyncio.fixture(loop_scope="module")
async def page_server() -> AsyncIterator[str]:
    """The page alone, without stages: for what runs in the browser only."""
    app = web.Application()
    add_page_routes(app)
    async with serving(app) as base:
        yield base


async def test_conversation_model_reads_the_event_orders(page_server, page) -> None:
    await page.goto(f"{page_server}/")
    got = await page.evaluate(CONVERSATION_SCENARIO)
    assert got["partial"] == "hel" and got["speaking"] is True
    assert got["kinds"] == ["user", "agent", "user", "agent", "user"]
    assert got["user"] == "hello there"
    r1 = got["r1"]
    assert r1["state"] == "cut" and r1["cutBy"] == "turn_detected"
    assert (r1["heard"], r1["heardMs"], r1["text"]) == ("one two", 640, "one two three four")
    # the gateway's figures win over the arrival-time estimates; the client adds the stop
    assert r1["latency"] == {
        "turnMs": 195.5,
        "firstAudioMs": 98.2,
        "transcriptMs": 100,
        "cancelMs": 4.2,
        "audioStopMs": 150,
    }
    assert r1["measuredBy"]["turnMs"] == "server"
    assert r1["measuredBy"]["audioStopMs"] == "client"
    r2 = got["r2"]
    assert r2["state"] == "cut" and r2["cutBy"] == "turn_detected" and r2["userItemId"] == "u2"
    assert r2["latency"]["turnMs"] == 300  # speech_stopped 3000 -> audio started 3300
    assert got["agentSpeaking"] is False
