"""gateway.page: the demo page and its assets over HTTP, without stages or a browser."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from gateway.page import WEB_ROOT, add_page_routes
from tests.serving import serving


def serving_page(root: Path):
    app = web.Application()
    add_page_routes(app, root)
    return serving(app)


async def test_root_serves_the_page_and_its_modules() -> None:
    async with serving_page(WEB_ROOT) as base, aiohttp.ClientSession() as http:
        async with http.get(f"{base}/") as r:
            assert r.status == 200 and r.content_type == "text/html"
            assert r.headers["Cache-Control"] == "no-cache"
            page = await r.text()
        assert '<script type="module" src="/web/app.js">' in page
        for asset in ("app.js", "realtime-client.js", "conversation.js"):
            async with http.get(f"{base}/web/{asset}") as r:
                # browsers refuse a module served with a non-JavaScript type
                assert r.status == 200 and r.content_type.endswith("javascript"), asset
                assert r.headers["Cache-Control"] == "no-cache"
        async with http.get(f"{base}/web/style.css") as r:
            assert r.status == 200 and r.content_type == "text/css"


@pytest.mark.parametrize("path", ["/web/nope.js", "/web/../pyproject.toml", "/web/%2e%2e/setup.py"])
async def test_nothing_outside_web_is_served(path: str) -> None:
    async with serving_page(WEB_ROOT) as base, aiohttp.ClientSession() as http:
        url = URL(f"{base}{path}", encoded=True)  # sent as written, dots and all
        async with http.get(url) as r:
            assert r.status in (403, 404), await r.text()


async def test_without_web_folder_root_says_why(tmp_path: Path) -> None:
    async with (
        serving_page(tmp_path / "absent") as base,
        aiohttp.ClientSession() as http,
        http.get(f"{base}/") as r,
    ):
        assert r.status == 404
        assert "demo page is not installed" in await r.text()
