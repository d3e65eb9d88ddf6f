"""The browser demo page: `GET /` serves web/index.html, `GET /web/...` its modules and styles.

The page is plain JS modules with no build step (web/realtime-client.js is the reusable
client, web/conversation.js turns events into turns and latencies, web/app.js is the page).
"""

from __future__ import annotations

import logging
from pathlib import Path

from aiohttp import web

logger = logging.getLogger(__name__)

WEB_ROOT = Path(__file__).resolve().parents[1] / "web"
# the modules change with the server: make browsers revalidate instead of guessing freshness
NO_CACHE = {"Cache-Control": "no-cache"}


def add_page_routes(app: web.Application, root: Path = WEB_ROOT) -> None:
    """Serve the demo page from `root`; without that folder (an install without web/), `/`
    answers 404 saying so and the rest of the gateway runs as before."""
    index = root / "index.html"
    if not index.is_file():
        logger.warning("demo page not served: %s does not exist", index)

        async def missing(request: web.Request) -> web.Response:
            raise web.HTTPNotFound(text=f"the demo page is not installed ({index} is missing)")

        app.router.add_get("/", missing)
        return

    async def page(request: web.Request) -> web.FileResponse:
        return web.FileResponse(index, headers=NO_CACHE)

    app.router.add_get("/", page)
    app.router.add_static("/web/", root, follow_symlinks=False)
    app.on_response_prepare.append(_no_cache_for_assets)


async def _no_cache_for_assets(request: web.Request, response: web.StreamResponse) -> None:
    if request.path.startswith("/web/"):
        response.headers.setdefault("Cache-Control", "no-cache")
