"""An MCP server for the tool tests, on the official SDK's MCPServer (FastMCP in mcp 1.x),
served over streamable HTTP on 127.0.0.1: `python -m tests.gateway.mcp_server` prints
`port N` once it listens, and serves until it is terminated."""

from __future__ import annotations

import asyncio
import socket
import sys

import uvicorn
from mcp.server.mcpserver import MCPServer

server = MCPServer("omni-gateway-tests")


@server.tool(description="The weather now in a city")
def get_weather(city: str) -> str:
    return f"Sunny and 22 degrees in {city}."


@server.tool(description="Look something up slowly (for timeouts and barge-in)")
async def slow_lookup(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return f"Looked it up in {seconds} seconds."


@server.tool(description="A tool that always fails")
def broken_tool() -> str:
    raise RuntimeError("the tool broke")


def main() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    # listening before the port is told: a client that connects while uvicorn is still
    # starting waits in the backlog instead of being refused
    sock.listen(128)
    print(f"port {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(server.streamable_http_app(), log_level="warning", lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
