"""Errors over HTTP in OpenAI's shape (`{"error": {message, type, code, param}}`), for the
handlers' own refusals and for aiohttp's (a body over the size limit, an unknown route), so
that an SDK can read every one."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from aiohttp import web

_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "body_too_large",
    415: "unsupported_media_type",
}
# what aiohttp's own errors carry that a client acts on
_KEPT_HEADERS = ("Allow", "Retry-After")


class OpenAIError(web.HTTPException):
    """A refusal, raised by a handler or a helper of one at any depth; openai_shaped_errors
    answers it. Raised past that middleware, aiohttp sends the same status and JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.status_code = status  # aiohttp's subclasses set it on the class, one per status
        self.error = {"message": message, "type": type_, "code": code, "param": param}
        self.extra_headers = dict(headers or {})
        super().__init__(
            headers=self.extra_headers,
            text=json.dumps({"error": self.error}),
            content_type="application/json",
        )
        self.args = (f"{status} {code}: {message}",)  # not just the reason, in a traceback

    def response(self) -> web.Response:
        """The answer, a fresh Response: aiohttp deprecates returning an exception."""
        return web.json_response(
            {"error": self.error}, status=self.status, headers=self.extra_headers
        )


@web.middleware
async def openai_shaped_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The handlers' refusals answered, and aiohttp's own HTTP errors re-shaped."""
    try:
        return await handler(request)
    except OpenAIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else exc.reason
        return OpenAIError(
            exc.status,
            message,
            code=_CODES.get(exc.status, "invalid_request"),
            headers={k: v for k, v in exc.headers.items() if k in _KEPT_HEADERS},
        ).response()
