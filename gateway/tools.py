"""The Realtime API's `tools`, `tool_choice` and `parallel_tool_calls`, as a session or a
response.create gives them: checked, and kept in the form the session echoes back and the
reasoning stage is told (stages.messages.Tools).

Two kinds of tools: `function` tools, which the client runs (it answers a call with a
function_call_output item), and `mcp` servers, whose tools the gateway lists and calls itself
(gateway.mcp). A tool_choice names a function, or an MCP server's tool.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from gateway.config import ToolsConfig
from gateway.fields import ProtocolError, check_keys, mapping, text_field, unsupported
from stages.messages import Tool, Tools

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_TOOLS = 128
# every tool's schema together: they go to the reasoning stage in one ring record, and into
# every prompt
MAX_TOOLS_BYTES = 64 * 1024
CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str
    parameters: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
        }

    def spec(self) -> Tool:
        return Tool(self.name, self.description, json.dumps(self.parameters))


@dataclass(frozen=True)
class McpServer:
    """An MCP server the session's model may use, through the gateway."""

    server_label: str
    server_url: str
    allowed_tools: tuple[str, ...] | None = None  # None: all of them
    read_only: bool | None = None  # allowed_tools' filter by the tools' readOnlyHint
    headers: tuple[tuple[str, str], ...] = ()
    authorization: str | None = None
    server_description: str | None = None

    def allows(self, name: str, read_only: bool | None) -> bool:
        """Whether the server's tool `name` (its readOnlyHint `read_only`) is offered."""
        if self.allowed_tools is not None and name not in self.allowed_tools:
            return False
        return self.read_only is None or bool(read_only) == self.read_only

    def http_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.authorization:
            headers["Authorization"] = f"Bearer {self.authorization}"
        return headers

    def to_json(self) -> dict[str, Any]:
        allowed: Any = None
        if self.read_only is not None:
            allowed = {"read_only": self.read_only}
            if self.allowed_tools is not None:
                allowed["tool_names"] = list(self.allowed_tools)
        elif self.allowed_tools is not None:
            allowed = list(self.allowed_tools)
        return {
            "type": "mcp",
            "server_label": self.server_label,
            "server_url": self.server_url,
            "allowed_tools": allowed,
            "require_approval": "never",
            "server_description": self.server_description,
            # headers and the token are the client's secrets: never echoed
        }


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "auto"  # auto, none, required, function, mcp
    name: str | None = None
    server_label: str | None = None

    def to_json(self) -> Any:
        if self.mode == "function":
            return {"type": "function", "name": self.name}
        if self.mode == "mcp":
            return {"type": "mcp", "server_label": self.server_label, "name": self.name}
        return self.mode


@dataclass(frozen=True)
class ToolSet:
    """A session's (or one response's) tools and how the model may use them."""

    functions: tuple[FunctionTool, ...] = ()
    servers: tuple[McpServer, ...] = ()
    choice: ToolChoice = field(default_factory=ToolChoice)
    parallel: bool = True

    def to_json(self) -> list[dict[str, Any]]:
        return [t.to_json() for t in self.functions] + [s.to_json() for s in self.servers]

    def server(self, label: str) -> McpServer | None:
        return next((s for s in self.servers if s.server_label == label), None)

    def for_model(self, mcp_tools: list[Tool], strict: bool = True) -> Tools:
        """What the reasoning stage is told: the function tools and the MCP tools listed so
        far (`mcp_tools`), and the choice (an MCP tool chosen is a function to it). A choice
        of an MCP tool not listed yet is an error, or with `strict` off (the session's
        settings, sent again once the listing comes) "auto" until then."""
        specs = [t.spec() for t in self.functions] + mcp_tools
        mode, name = self.choice.mode, self.choice.name
        if mode in ("function", "mcp"):
            if not any(t.name == name for t in specs) and not strict:
                return Tools(specs, "auto", None, self.parallel)
            if not any(t.name == name for t in specs):
                # an MCP tool chosen before its server's tools are listed (or one it lacks)
                raise ProtocolError(
                    f"tool_choice names {name!r}, which is not among the tools the model has",
                    param="tool_choice",
                )
            mode = "function"
        return Tools(specs, mode, name if mode == "function" else None, self.parallel)


def parse_tools(
    value: Any, param: str, allow_mcp: bool = True
) -> tuple[tuple[FunctionTool, ...], tuple[McpServer, ...]]:
    """`tools` as given: function tools and MCP servers, checked."""
    if not isinstance(value, list):
        raise ProtocolError(f"{param} must be a list", param=param)
    if len(value) > MAX_TOOLS:
        raise ProtocolError(f"{param} holds at most {MAX_TOOLS} tools", param=param)
    functions: list[FunctionTool] = []
    servers: list[McpServer] = []
    for i, tool in enumerate(value):
        where = f"{param}[{i}]"
        tool = mapping(tool, where)
        kind = tool.get("type", "function")
        if kind == "function":
            functions.append(_function(tool, where))
        elif kind == "mcp":
            if not allow_mcp:
                raise unsupported(f"{where}.type='mcp'", "declare MCP servers in session.tools")
            servers.append(_mcp(tool, where))
        else:
            raise ProtocolError(
                f"{where}.type must be 'function' or 'mcp', not {kind!r}", param=f"{where}.type"
            )
    names = [f.name for f in functions]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ProtocolError(f"{param} names the function {dup!r} twice", param=param)
    labels = [s.server_label for s in servers]
    dup = next((n for n in labels if labels.count(n) > 1), None)
    if dup is not None:
        raise ProtocolError(f"{param} names the MCP server {dup!r} twice", param=param)
    size = len(json.dumps([f.to_json() for f in functions]))
    if size > MAX_TOOLS_BYTES:
        raise ProtocolError(
            f"{param}: the function tools take {size} bytes of JSON, more than {MAX_TOOLS_BYTES}",
            param=param,
        )
    return tuple(functions), tuple(servers)


def _function(tool: dict[str, Any], where: str) -> FunctionTool:
    check_keys(tool, {"type", "name", "description", "parameters"}, where)
    name = tool.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ProtocolError(
            f"{where}.name must be 1 to 64 letters, digits, '_' or '-', not {name!r}",
            param=f"{where}.name",
        )
    description = text_field(tool.get("description", ""), f"{where}.description")
    parameters = tool.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    parameters = mapping(parameters, f"{where}.parameters")
    if parameters.get("type", "object") != "object":
        raise ProtocolError(
            f"{where}.parameters must be a JSON Schema of type 'object' (a function's "
            "arguments are a JSON object)",
            param=f"{where}.parameters",
        )
    _schema_check(parameters, f"{where}.parameters")
    return FunctionTool(name, description, parameters)


def _schema_check(schema: dict[str, Any], param: str) -> None:
    """A JSON Schema the structured outputs can hold the arguments to: one that is itself
    a valid schema (the model's output is checked against it)."""
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ProtocolError(
            f"{param} is not a valid JSON Schema: {exc.message}", param=param
        ) from None


def _mcp(tool: dict[str, Any], where: str) -> McpServer:
    check_keys(
        tool,
        {
            "type",
            "server_label",
            "server_url",
            "allowed_tools",
            "require_approval",
            "headers",
            "authorization",
            "server_description",
            "connector_id",
            "tunnel_id",
            "defer_loading",
            "allowed_callers",
        },
        where,
    )
    label = tool.get("server_label")
    if not isinstance(label, str) or not NAME.match(label):
        raise ProtocolError(
            f"{where}.server_label must be 1 to 64 letters, digits, '_' or '-'",
            param=f"{where}.server_label",
        )
    for key in ("connector_id", "tunnel_id"):
        if tool.get(key) is not None:
            raise unsupported(f"{where}.{key}", "give the MCP server's server_url")
    if tool.get("defer_loading"):
        raise unsupported(f"{where}.defer_loading", "an MCP server's tools are listed at once")
    if tool.get("allowed_callers") not in (None, ["direct"]):
        raise unsupported(f"{where}.allowed_callers", "the model calls the tools directly")
    url = tool.get("server_url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > 2048:
        raise ProtocolError(
            f"{where}.server_url must be the http(s) URL of a streamable-HTTP MCP server",
            param=f"{where}.server_url",
        )
    if tool.get("require_approval") not in ("never", {"never": {}}):
        raise unsupported(
            f"{where}.require_approval",
            "approvals are not built: set require_approval to 'never'",
        )
    allowed_tools, read_only = _allowed_tools(tool.get("allowed_tools"), f"{where}.allowed_tools")
    headers = tool.get("headers") or {}
    headers = mapping(headers, f"{where}.headers")
    for key, val in headers.items():
        if not isinstance(val, str) or len(key) > 256 or len(val) > 8192:
            raise ProtocolError(
                f"{where}.headers values are strings (names of at most 256 characters, "
                "values of 8192)",
                param=f"{where}.headers",
            )
    authorization = tool.get("authorization")
    if authorization is not None and not isinstance(authorization, str):
        raise ProtocolError(
            f"{where}.authorization must be a string", param=f"{where}.authorization"
        )
    description = tool.get("server_description")
    if description is not None:
        description = text_field(description, f"{where}.server_description")
    return McpServer(
        label,
        url,
        allowed_tools,
        read_only,
        tuple(sorted(headers.items())),
        authorization,
        description,
    )


def _allowed_tools(value: Any, param: str) -> tuple[tuple[str, ...] | None, bool | None]:
    if value is None:
        return None, None
    if isinstance(value, list):
        if not all(isinstance(v, str) for v in value):
            raise ProtocolError(f"{param} must list tool names", param=param)
        return tuple(value), None
    value = mapping(value, param)
    check_keys(value, {"tool_names", "read_only"}, param)
    names = value.get("tool_names")
    if names is not None and not (
        isinstance(names, list) and all(isinstance(v, str) for v in names)
    ):
        raise ProtocolError(f"{param}.tool_names must list tool names", param=param)
    read_only = value.get("read_only")
    if read_only is not None and not isinstance(read_only, bool):
        raise ProtocolError(f"{param}.read_only must be a boolean", param=param)
    return (tuple(names) if names is not None else None), read_only


def parse_tool_choice(value: Any, param: str) -> ToolChoice:
    if isinstance(value, str):
        if value not in CHOICES:
            raise ProtocolError(
                f"{param} must be one of {CHOICES} or a tool, not {value!r}", param=param
            )
        return ToolChoice(value)
    value = mapping(value, param)
    kind = value.get("type")
    if kind == "function":
        check_keys(value, {"type", "name"}, param)
        name = value.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ProtocolError(f"{param}.name must name a function", param=f"{param}.name")
        return ToolChoice("function", name)
    if kind == "mcp":
        check_keys(value, {"type", "server_label", "name"}, param)
        label, name = value.get("server_label"), value.get("name")
        if not isinstance(label, str) or not (name is None or isinstance(name, str)):
            raise ProtocolError(
                f"{param} names an MCP server's tool: server_label and name", param=param
            )
        if name is None:
            raise unsupported(f"{param}.name", "name the MCP tool the model must call")
        return ToolChoice("mcp", name, label)
    raise ProtocolError(
        f"{param}.type must be 'function' or 'mcp', not {kind!r}", param=f"{param}.type"
    )


def check_choice(tools: ToolSet, param: str) -> None:
    """A named choice must name one of the tools."""
    choice = tools.choice
    if choice.mode == "function" and not any(f.name == choice.name for f in tools.functions):
        raise ProtocolError(
            f"{param} names the function {choice.name!r}, which is not in tools",
            param=param,
        )
    if choice.mode == "mcp" and tools.server(choice.server_label or "") is None:
        raise ProtocolError(
            f"{param} names the MCP server {choice.server_label!r}, which is not in tools",
            param=param,
        )
    if choice.mode == "required" and not (tools.functions or tools.servers):
        raise ProtocolError(f"{param} is 'required' but there are no tools", param=param)


def updated(tools: ToolSet, update: dict[str, Any], param: str, allow_mcp: bool = True) -> ToolSet:
    """`tools` with an update's tools, tool_choice and parallel_tool_calls applied."""
    functions, servers = tools.functions, tools.servers
    if "tools" in update:
        value = update["tools"] if update["tools"] is not None else []
        functions, servers = parse_tools(value, f"{param}.tools", allow_mcp)
    choice = tools.choice
    if "tool_choice" in update:
        choice = parse_tool_choice(update["tool_choice"], f"{param}.tool_choice")
    parallel = tools.parallel
    if "parallel_tool_calls" in update:
        parallel = update["parallel_tool_calls"]
        if not isinstance(parallel, bool):
            raise ProtocolError(
                f"{param}.parallel_tool_calls must be a boolean",
                param=f"{param}.parallel_tool_calls",
            )
    new = ToolSet(functions, servers, choice, parallel)
    check_choice(new, f"{param}.tool_choice")
    return new


def check_servers(tools: ToolSet, config: ToolsConfig, param: str) -> None:
    """Refuse MCP servers the gateway may not connect to (gateway.tools.mcp_servers)."""
    for server in tools.servers:
        if not config.mcp_allowed(server.server_url):
            raise ProtocolError(
                f"this gateway may not connect to the MCP server {server.server_url!r} "
                "(gateway.tools.mcp_servers)",
                param=f"{param}.tools",
                code="mcp_server_not_allowed",
            )
