"""What a session does with tools: the MCP servers it lists and calls for the model, the
calls a reply makes (function calls for the client, MCP calls run here), and what follows a
reply that called: the client's function outputs, awaited with a deadline, or, after MCP
calls, the reply that reads their answers, started here without a round trip.

A cut reply (barge-in, cancel) drops its MCP calls where they are: their late answers are
ignored and no reply follows them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from gateway.config import ToolsConfig
from gateway.conversation import Conversation, Item, function_call, mcp_call, mcp_list_tools
from gateway.events import new_id
from gateway.mcp import ListedTool, McpConnection, McpFailure
from gateway.session.outbox import Outbox
from gateway.session.replies import Replies
from gateway.session.reply import Reply
from gateway.tools import McpServer, ToolSet, check_servers
from stages.messages import Tool, Tools

logger = logging.getLogger(__name__)

MAX_MCP_ROUNDS = 4  # replies in a row that call MCP tools; the next may only speak


@dataclass
class ServerLink:
    """One MCP server of the session: its connection and what it lists."""

    server: McpServer
    connection: McpConnection
    item: Item  # its mcp_list_tools item
    tools: list[ListedTool] = field(default_factory=list)
    ready: bool = False
    task: asyncio.Task[None] | None = None


class SessionTools:
    """One session's tools at work. `settings_changed`: the tools the model has changed (an
        MCP server's listing came); `follow_up(choice)`: start a reply that reads MCP answers, with
    that tool_choice ("auto", or "none" once MAX_MCP_ROUNDS replies in a row have called)."""

    def __init__(
        self,
        config: ToolsConfig,
        outbox: Outbox,
        items: Conversation,
        replies: Replies,
        spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
        settings_changed: Callable[[], None],
        follow_up: Callable[[str], None],
    ) -> None:
        self.config = config
        self.outbox, self.items, self.replies = outbox, items, replies
        self.spawn = spawn
        self.settings_changed = settings_changed
        self.follow_up = follow_up
        self.links: dict[str, ServerLink] = {}
        self._calls: dict[str, asyncio.Task[None]] = {}  # mcp_call item id -> its call
        self._awaited: dict[str, asyncio.TimerHandle] = {}  # call_id -> its output deadline
        self._mcp_rounds = 0
        self._functions: frozenset[str] = frozenset()  # the session's function tools' names
        replies.on_generated = self._generated
        replies.on_calls_ended = self.cut

    # -- MCP servers ---------------------------------------------------------------------------

    def check(self, tools: ToolSet) -> None:
        """Refuse MCP servers the gateway may not connect to (before anything changes)."""
        check_servers(tools, self.config, "session")

    def sync(self, tools: ToolSet) -> None:
        """The session's tools changed: connect to new MCP servers and list their tools
        (mcp_list_tools.*), hang up on those gone."""
        self._functions = frozenset(f.name for f in tools.functions)
        wanted = {s.server_label: s for s in tools.servers}
        for label in list(self.links):
            if wanted.get(label) != self.links[label].server:
                self._hang_up(self.links.pop(label))
        for label, server in wanted.items():
            if label not in self.links:
                self._connect(server)

    def _connect(self, server: McpServer) -> None:
        connection = McpConnection(
            server, self.config.mcp_list_timeout_s, self.config.mcp_call_timeout_s
        )
        item = mcp_list_tools(new_id("item"), server.server_label)
        link = self.links[server.server_label] = ServerLink(server, connection, item)
        self.outbox.item_added(item, self.items.add(item))
        self.outbox.mcp_list_tools("in_progress", item.id)
        link.task = self.spawn(self._list(link), f"mcp-list-{server.server_label}")

    async def _list(self, link: ServerLink) -> None:
        try:
            tools = await link.connection.open()
        except McpFailure as exc:
            if self.links.get(link.server.server_label) is link:
                del self.links[link.server.server_label]
            link.item.status = "failed"
            self.outbox.mcp_list_tools("failed", link.item.id)
            self.outbox.error(
                f"MCP server {link.server.server_label!r}: {exc.error['message']}; its tools "
                "are not available",
                code="mcp_list_tools_failed",
                type_="server_error",
            )
            logger.warning("MCP server %s: %s", link.server.server_label, exc.error)
            return
        if self.outbox.closed or self.links.get(link.server.server_label) is not link:
            await link.connection.close()  # the session ended, or dropped the server, meanwhile
            return
        names = self._names_taken(link)
        clash = [t.name for t in tools if t.name in names]
        if clash:
            self.outbox.error(
                f"MCP server {link.server.server_label!r}: tools {clash} have the names of "
                "other tools and are left out",
                code="mcp_tool_name_taken",
                type_="server_error",
            )
        link.tools = [t for t in tools if t.name not in names]
        link.ready = True
        link.item.status = "completed"
        link.item.fields["tools"] = [t.to_json() for t in link.tools]
        self.outbox.mcp_list_tools("completed", link.item.id)
        self.outbox.item_done(link.item)
        self.settings_changed()

    def _names_taken(self, link: ServerLink) -> set[str]:
        taken: set[str] = set(self._functions)
        for other in self.links.values():
            if other is not link and other.ready:
                taken.update(t.name for t in other.tools)
        return taken

    def _hang_up(self, link: ServerLink) -> None:
        if link.task is not None:
            link.task.cancel()
        self.spawn(link.connection.close(), f"mcp-close-{link.server.server_label}")

    def for_model(self, tools: ToolSet, strict: bool = True) -> Tools:
        """The tools the model may call now: the function tools and the listed MCP ones
        (`strict`: see ToolSet.for_model)."""
        listed = [
            Tool(t.name, t.description, _schema_json(t.input_schema))
            for label in (s.server_label for s in tools.servers)
            if (link := self.links.get(label)) is not None and link.ready
            for t in link.tools
        ]
        return tools.for_model(listed, strict)

    def _server_of(self, name: str) -> ServerLink | None:
        for link in self.links.values():
            if link.ready and any(t.name == name for t in link.tools):
                return link
        return None

    # -- a reply's calls -----------------------------------------------------------------------

    def call_started(self, reply: Reply, index: int, call_id: str, name: str) -> None:
        link = self._server_of(name)
        if link is None:
            item = function_call(new_id("item"), call_id, name)
        else:
            item = mcp_call(new_id("item"), link.server.server_label, name)
            item.fields["call_id"] = call_id  # the model's, for matching; not shown
        self.replies.call_started(reply, index, item)

    def call_made(self, reply: Reply, call_id: str, arguments: str) -> None:
        index = self._index(reply, call_id)
        if index is None:
            return
        self.replies.call_made(reply, index, arguments)
        item = reply.calls[index]
        if item.type == "mcp_call":
            link = self.links.get(item.fields["server_label"])
            self._calls[item.id] = self.spawn(
                self._call_mcp(reply, item, link), f"mcp-call-{item.id}"
            )

    def call_bad(self, reply: Reply, index: int, name: str, reason: str) -> None:
        self.replies.call_bad(reply, index, reason)
        self.outbox.error(
            f"the model's call of {name!r} was dropped: {reason}",
            code="invalid_tool_call",
            type_="server_error",
        )

    @staticmethod
    def _index(reply: Reply, call_id: str) -> int | None:
        return next((i for i, it in reply.calls.items() if it.fields["call_id"] == call_id), None)

    async def _call_mcp(self, reply: Reply, item: Item, link: ServerLink | None) -> None:
        output, error = None, None
        try:
            if link is None:
                raise McpFailure(
                    {"type": "http_error", "code": 503, "message": "the MCP server is gone"}
                )
            output = await link.connection.call(item.fields["name"], item.fields["arguments"])
        except McpFailure as exc:
            error = exc.error
        finally:
            self._calls.pop(item.id, None)
        self.replies.mcp_answered(reply, item, output, error)

    def cut(self, reply: Reply) -> None:
        """The reply was cut: its MCP calls stop, their answers never heard of."""
        for item in reply.calls.values():
            task = self._calls.pop(item.id, None)
            if task is not None:
                task.cancel()

    def _generated(self, reply: Reply, status: str) -> None:
        """A reply is whole: await the client's outputs for its function calls, or answer
        its MCP calls' results with a reply that reads them."""
        if status != "completed" or not reply.calls:
            self._mcp_rounds = 0
            return
        for item in reply.function_calls:
            self._await_output(item.fields["call_id"], item.fields["name"])
        answered = [i for i in reply.calls.values() if i.type == "mcp_call"]
        if answered and not reply.function_calls:
            self._mcp_rounds += 1
            choice = "auto" if self._mcp_rounds < MAX_MCP_ROUNDS else "none"
            self.follow_up(choice)

    # -- function outputs ----------------------------------------------------------------------

    def _await_output(self, call_id: str, name: str) -> None:
        timeout = self.config.function_output_timeout_s
        if timeout is None:
            return
        loop = asyncio.get_running_loop()
        self._awaited[call_id] = loop.call_later(timeout, self._no_output, call_id, name)

    def output_came(self, call_id: str) -> None:
        handle = self._awaited.pop(call_id, None)
        if handle is not None:
            handle.cancel()

    def _no_output(self, call_id: str, name: str) -> None:
        self._awaited.pop(call_id, None)
        self.outbox.error(
            f"no function_call_output came for the call {call_id!r} of {name!r} within "
            f"{self.config.function_output_timeout_s:g} s; the conversation goes on without it",
            code="function_call_output_timeout",
        )

    async def close(self) -> None:
        for handle in self._awaited.values():
            handle.cancel()
        self._awaited.clear()
        for task in list(self._calls.values()):
            task.cancel()
        links, self.links = list(self.links.values()), {}
        for link in links:
            if link.task is not None:
                link.task.cancel()
            await link.connection.close()


def _schema_json(schema: dict[str, Any]) -> str:
    return json.dumps(schema)
