"""Errors over HTTP in OpenAI's shape (`{"error": {message, type, code, param}}`), for the
handlers' own refusals and for aiohttp's (a body over the size limit, an unknown route), so
that an SDK can read every one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "body_too_large",
    415: "unsupported_media_type",
}


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


@web.middleware
async def openai_shaped_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's own HTTP errors, re-shaped; the handlers' JSON ones pass as they are."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else exc.reason
        return openai_error(
            exc.status,
            message,
            code=_CODES.get(exc.status, "invalid_request"),
            headers={k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")},
        )
