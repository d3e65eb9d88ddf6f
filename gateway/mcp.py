"""One session's connection to one MCP server, through the official `mcp` SDK: its tools
listed once, then called as the model asks, each call bounded by a timeout.

The SDK's streamable-HTTP transport runs in anyio task groups, which must be entered and
left by the same task: a connection's own task holds it open, and calls from any task of the
session go through it. A call or a listing that fails comes back as the Realtime API's MCP
error object (protocol_error, http_error, tool_execution_error), never as an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from gateway.tools import McpServer

logger = logging.getLogger(__name__)

MAX_OUTPUT_BYTES = 64 * 1024  # an answer longer than this is cut: it goes into every prompt


@dataclass(frozen=True)
class ListedTool:
    """A tool an MCP server offers, as mcp_list_tools shows it."""

    name: str
    description: str
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "input_schema": self.input_schema,
            "annotations": self.annotations,
        }

    @property
    def read_only(self) -> bool | None:
        return None if self.annotations is None else self.annotations.get("readOnlyHint")


class McpFailure(Exception):
    """A listing or call that failed; `error` is the API's error object for it."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(error.get("message", ""))
        self.error = error


def _error(exc: BaseException, what: str) -> dict[str, Any]:
    """The Realtime API's MCP error object for a failure of `what`."""
    from mcp.shared.exceptions import MCPError

    if isinstance(exc, McpFailure):
        return exc.error
    if isinstance(exc, TimeoutError):
        return {"type": "http_error", "code": 504, "message": f"{what} timed out"}
    if isinstance(exc, MCPError):
        return {"type": "protocol_error", "code": exc.code, "message": exc.message}
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(status, int):
        return {"type": "http_error", "code": status, "message": f"{what}: HTTP {status}"}
    if isinstance(exc, BaseExceptionGroup):
        first = exc.exceptions[0] if exc.exceptions else exc
        return _error(first, what)
    return {
        "type": "http_error",
        "code": 502,
        "message": f"{what} failed: {type(exc).__name__}: {exc}",
    }


class McpConnection:
    """A session's link to one MCP server: `open` connects and lists its tools, `call`
    calls one, `close` hangs up (safe to call twice, and on a connection never opened)."""

    def __init__(self, server: McpServer, list_timeout_s: float, call_timeout_s: float) -> None:
        self.server = server
        self.list_timeout_s = list_timeout_s
        self.call_timeout_s = call_timeout_s
        self._client: Any = None
        self._ready: asyncio.Future[list[ListedTool]] | None = None
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> list[ListedTool]:
        """Connect and list the server's tools; raises McpFailure."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._task = asyncio.create_task(self._hold(), name=f"mcp-{self.server.server_label}")
        try:
            return await asyncio.wait_for(asyncio.shield(self._ready), self.list_timeout_s)
        except TimeoutError:
            await self.close()
            raise McpFailure(_error(TimeoutError(), "listing the tools")) from None
        except McpFailure:
            await self.close()
            raise

    async def _hold(self) -> None:
        """The task that holds the connection open until `close`."""
        from mcp.client.client import Client
        from mcp.client.streamable_http import streamable_http_client

        assert self._ready is not None
        try:
            import httpx2

            http = httpx2.AsyncClient(
                headers=self.server.http_headers(),
                timeout=httpx2.Timeout(self.call_timeout_s, read=max(self.call_timeout_s, 300)),
            )
            async with http:
                transport = streamable_http_client(self.server.server_url, http_client=http)
                async with Client(transport, read_timeout_seconds=self.call_timeout_s) as client:
                    self._client = client
                    tools = await self._list(client)
                    if not self._ready.done():
                        self._ready.set_result(tools)
                    await self._closing.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the SDK raises ExceptionGroups from its task groups
            if not self._ready.done():
                self._ready.set_exception(McpFailure(_error(exc, "connecting to the server")))
            else:
                logger.warning("MCP server %s: connection lost: %s", self.server.server_label, exc)
        finally:
            self._client = None

    async def _list(self, client: Any) -> list[ListedTool]:
        tools: list[ListedTool] = []
        cursor = None
        for _ in range(100):  # pages; a server that never stops paging is cut off
            page = await client.list_tools(cursor=cursor)
            for tool in page.tools:
                annotations = (
                    tool.annotations.model_dump(by_alias=True, exclude_none=True)
                    if tool.annotations is not None
                    else None
                )
                listed = ListedTool(
                    tool.name, tool.description or "", dict(tool.input_schema), annotations
                )
                if self.server.allows(listed.name, listed.read_only):
                    tools.append(listed)
            cursor = page.next_cursor
            if not cursor:
                break
        return tools

    async def call(self, name: str, arguments: str) -> str:
        """The tool's answer, as text; raises McpFailure (a timeout after call_timeout_s)."""
        client = self._client
        if client is None:
            raise McpFailure(
                {"type": "http_error", "code": 503, "message": "the MCP server is not connected"}
            )
        try:
            args = json.loads(arguments or "{}")
        except ValueError as exc:
            raise McpFailure(
                {"type": "tool_execution_error", "message": f"the arguments are not JSON: {exc}"}
            ) from None
        try:
            result = await asyncio.wait_for(client.call_tool(name, args), self.call_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise McpFailure(_error(exc, f"the call of {name}")) from None
        text = _text(result)
        if result.is_error:
            raise McpFailure({"type": "tool_execution_error", "message": text})
        return text

    async def close(self) -> None:
        self._closing.set()
        task, self._task = self._task, None
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 2.0)
            except (TimeoutError, Exception):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task


def _text(result: Any) -> str:
    """A tool result as the text the model reads: its text parts, else its structured
    content as JSON, cut at MAX_OUTPUT_BYTES."""
    parts = [c.text for c in result.content if getattr(c, "type", None) == "text"]
    if not parts and result.structured_content is not None:
        parts = [json.dumps(result.structured_content)]
    if not parts and result.content:
        parts = [json.dumps([c.model_dump(exclude_none=True) for c in result.content])]
    text = "\n".join(parts)
    if len(text.encode("utf-8")) > MAX_OUTPUT_BYTES:
        text = text.encode("utf-8")[:MAX_OUTPUT_BYTES].decode("utf-8", "ignore")
    return text
