"""The demo page as a person first meets it: `configs/offline.yaml` with its real models, a
question asked aloud into Chromium's microphone, and a spoken, correct answer on the page."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio
from playwright.async_api import Browser, expect

from gateway.config import load_config
from stages.audio import resample, write_wav
from stages.backends import bundled
from stages.backends.tts_piper import load_piper
from tests.web.browser import PageProblems, launched

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.asyncio(loop_scope="module")]

OFFLINE = Path(__file__).parents[2] / "configs" / "offline.yaml"
QUESTION = "What is the capital of France? Please tell me in one sentence."
SECONDS = 1000  # Playwright timeouts are in ms


@pytest.fixture(scope="module")
def config():
    # test_offline_call's stages, shared with it (tests/conftest.py: SHARING_STAGES)
    return load_config(OFFLINE, {"gateway.port": 0, "max_sessions": 8})


@pytest.fixture(scope="module")
def question_wav(tmp_path_factory) -> Path:
    """Two seconds for the call to connect, the question in the Piper voice, then silence."""
    voice = load_piper(bundled.resolve("bundled:piper-en_US-joe-medium"))
    spoken = resample(np.concatenate(list(voice.synthesize(QUESTION))), voice.sample_rate, 16000)
    pcm = np.concatenate([np.zeros(32000, np.int16), spoken, np.zeros(16000, np.int16)])
    path = tmp_path_factory.mktemp("microphone") / "question.wav"
    write_wav(path, pcm, 16000)
    return path


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser(question_wav) -> AsyncIterator[Browser]:
    async with launched(question_wav) as browser:
        yield browser


async def test_a_question_asked_aloud_gets_a_spoken_correct_answer(server, browser) -> None:
    base, _ = server
    context = await browser.new_context(viewport={"width": 1100, "height": 900})
    try:
        page = await context.new_page()
        problems = PageProblems(page)
        await page.goto(f"{base}/")
        await page.get_by_role("button", name="Connect", exact=True).click()
        await expect(page.locator("#call-state")).to_have_text("Connected", timeout=20 * SECONDS)

        you = page.locator("#turns li.user").first
        await expect(you).to_have_attribute("data-state", "done", timeout=30 * SECONDS)
        await expect(you.locator(".text")).to_have_text(re.compile(r"capital of France", re.I))

        agent = page.locator("#turns li.agent").first
        await expect(agent).to_be_visible(timeout=30 * SECONDS)
        await expect(page.locator("#agent-state")).to_have_text("speaking", timeout=30 * SECONDS)
        await page.wait_for_function(
            "document.getElementById('agent-level').value > 0.05", timeout=15 * SECONDS
        )
        await expect(agent.locator(".text")).to_have_text(
            re.compile(r"Paris"), timeout=30 * SECONDS
        )
        await expect(page.locator("#v-turn")).to_have_text(
            re.compile(r"^\d+ ms$"), timeout=30 * SECONDS
        )
        await page.get_by_role("button", name="Disconnect", exact=True).click()
        await expect(page.locator("#call-state")).to_have_text("Disconnected")
        assert not problems.messages, problems.messages
    finally:
        await context.close()
