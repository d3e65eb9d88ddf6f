"""Debian's chromium for the demo page's tests, driven by Playwright (never `playwright
install`): its launch with a fake microphone playing a WAV, and the problems a page reports."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from playwright.async_api import Browser, ConsoleMessage, Page, async_playwright

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# ../shared/FACTS.md: the flags Debian's chromium needs for a fake microphone and loopback ICE
CHROMIUM_FLAGS = [
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--allow-loopback-in-peer-connection",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-gpu",
]


@asynccontextmanager
async def launched(microphone_wav: Path) -> AsyncIterator[Browser]:
    """Chromium whose fake microphone plays `microphone_wav` once, then silence."""
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium missing: scripts/setup.sh --test installs it (Debian's chromium)")
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM,
            # %noloop: after the WAV, the microphone hears silence instead of the WAV again
            args=[*CHROMIUM_FLAGS, f"--use-file-for-fake-audio-capture={microphone_wav}%noloop"],
            timeout=30_000,
        )
        try:
            yield browser
        finally:
            await browser.close()


class PageProblems:
    """Console errors and uncaught exceptions of a page."""

    def __init__(self, page: Page) -> None:
        self.messages: list[str] = []
        page.on("console", self._console)
        page.on("pageerror", lambda exc: self.messages.append(f"uncaught: {exc}"))

    def _console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.messages.append(f"console: {message.text}")
