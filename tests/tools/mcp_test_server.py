"""A real MCP server (the official SDK's `MCPServer`) for the `mcp` tool's tests, on stdio or HTTP.

Tools: `add` (typed arguments; annotated read-only, so safe to repeat), `note` (state kept per MCP
session), `sleep` (a call that hangs past a timeout), `crash` (the server process dies mid-call). Run:
`python mcp_test_server.py` (stdio) or `python mcp_test_server.py http PORT` (streamable HTTP on
127.0.0.1:PORT/mcp). Test support only.
"""

from __future__ import annotations

import asyncio
import os
import sys

from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

app = MCPServer("vcpo-test")
_notes: dict[str, list[str]] = {}


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
def note(text: str, ctx: Context) -> str:
    """Remember `text` in this MCP session's state; returns every note the session holds so far."""
    # over HTTP the client's MCP session id; on stdio the process is the session
    session = (ctx.headers or {}).get("mcp-session-id", "stdio")
    notes = _notes.setdefault(session, [])
    notes.append(text)
    return ",".join(notes)


@app.tool()
async def sleep(seconds: float) -> str:
    """Wait `seconds`, then answer."""
    await asyncio.sleep(seconds)
    return "woke"


@app.tool()
def crash() -> str:
    """End the server process at once (a server that dies mid-call)."""
    os._exit(3)


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
