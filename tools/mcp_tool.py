"""An MCP server's tools as functions (tool type `mcp`), through the official `mcp` SDK.

The tool connects when it starts (stdio: it launches the server as a child process; streamable HTTP:
it reaches a running server), lists the server's tools with their JSON schemas, keeps those the spec's
`tools` names (refusing, with the list, a name the server does not offer) and calls them by name. Calls
share that one connection; `session()` opens a connection of its own for one episode
(`loop.use_session`), which for a stdio server is a server process of its own and for an HTTP server
an MCP session (`Mcp-Session-Id`) of its own — where a stateful server keeps per-episode state.

Failures: a call that fails on the server's side (`isError`, a JSON-RPC error) is data, an `error`
result the model sees. A call that gets no answer within `call_timeout_s` is cancelled alone — the SDK
sends the server a cancel notification — and the connection, the other calls in flight on it and the
server's state stay. A connection that breaks is replaced on the next call. A call that failed after it
was sent may have run, so it is retried only when repeating it is safe: the server marks the tool
read-only or idempotent (MCP's tool annotations) or the spec's `idempotent` names it; a call that never
reached the server (no connection) is always retried, up to `max_retries` times. Then it fails with an
error the model sees, and the episode and the run go on. When an episode's own session had to be
replaced, its next result says that the server's state of its earlier calls is gone. Only a server that
cannot be reached when the tool starts raises (`ToolUnavailableError`).

Each connection lives in a task of its own: the SDK's transports are anyio task groups, which must be
entered and left by one task, while the calls come from many episodes' tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from tools.base import FunctionSpec, ToolConfigError, ToolResult, ToolUnavailableError
from tools.settings import MCPSettings

if TYPE_CHECKING:
    from mcp import ClientSession

log = logging.getLogger(__name__)

_CONNECTION_CLOSED, _REQUEST_TIMEOUT = -32000, -32001
"""JSON-RPC codes the SDK gives a closed connection and a request timeout; any other error code is the
server's answer, data for the model."""

_RESTARTED_NOTE = ("The tool server's session was restarted (the connection broke): state from this "
                   "episode's earlier calls is gone.")


class _Connection:
    """One MCP client session, opened and closed by a task of its own (see the module docstring)."""

    def __init__(self, settings: MCPSettings) -> None:
        self.settings = settings
        self.session: ClientSession | None = None
        self._ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def open(cls, settings: MCPSettings) -> _Connection:
        connection = cls(settings)
        connection._task = asyncio.create_task(connection._own(), name=f"mcp {settings.where}")
        try:
            await asyncio.wait_for(asyncio.shield(connection._ready), settings.connect_timeout_s)
        except BaseException:
            await connection.close(wait_s=0.0)
            raise
        return connection

    async def _own(self) -> None:
        from mcp import ClientSession

        try:
            async with contextlib.AsyncExitStack() as stack:
                read, write = await stack.enter_async_context(self._transport(stack))
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                self.session = session
                self._ready.set_result(None)
                await self._closing.wait()
        except BaseException as exc:  # the handshake failed, or the transport died under the session
            if not self._ready.done():
                self._ready.set_exception(exc if isinstance(exc, Exception) else ConnectionError(str(exc)))
            if not isinstance(exc, Exception | asyncio.CancelledError):
                raise
        finally:
            self.session = None

    def _transport(self, stack: contextlib.AsyncExitStack) -> contextlib.AbstractAsyncContextManager[Any]:
        settings = self.settings
        if settings.command is not None:
            from mcp import StdioServerParameters, stdio_client

            command = sys.executable if settings.command in ("python", "python3") else settings.command
            return stdio_client(StdioServerParameters(command=command, args=list(settings.args),
                                                      env=dict(settings.env) or None, cwd=settings.cwd))
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        # the GET stream may stay open between calls: reads wait longer than any one call
        timeout = httpx2.Timeout(settings.connect_timeout_s, read=max(300.0, settings.call_timeout_s * 2))
        client = httpx2.AsyncClient(headers=dict(settings.headers), timeout=timeout)
        stack.push_async_callback(client.aclose)
        return streamable_http_client(str(settings.url), http_client=client)

    @property
    def is_open(self) -> bool:
        return self.session is not None and self._task is not None and not self._task.done()

    async def close(self, wait_s: float | None = None) -> None:
        """Leave the session and stop its transport (a stdio server is terminated), waiting up to
        `wait_s` (default: the connect timeout) for a clean exit before cancelling it. Idempotent."""
        self._closing.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task),
                                   self.settings.connect_timeout_s if wait_s is None else wait_s)
        except Exception:  # a transport that does not stop in time (or failed as it stopped)
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task


class _Link:
    """A connection that is opened on first use and replaced when it breaks."""

    def __init__(self, settings: MCPSettings) -> None:
        self.settings = settings
        self._connection: _Connection | None = None
        self._lock = asyncio.Lock()
        self.opened = 0
        """Connections opened so far: a call that sees this grow ran on a new server session."""

    async def get(self) -> _Connection:
        async with self._lock:
            if self._connection is None or not self._connection.is_open:
                if self._connection is not None:
                    await self._connection.close()
                self._connection = await _Connection.open(self.settings)
                self.opened += 1
            return self._connection

    async def drop(self, connection: _Connection) -> None:
        """Close `connection` if it is still the current one (a broken or hung one)."""
        async with self._lock:
            if self._connection is connection:
                self._connection = None
        await connection.close()

    async def close(self) -> None:
        async with self._lock:
            connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()


class MCPTool:
    """`type: mcp` (see the module docstring). Use as `async with MCPTool(settings) as tool`."""

    name: ClassVar[str] = "mcp"
    settings_model: ClassVar[type[BaseModel]] = MCPSettings

    def __init__(self, settings: MCPSettings) -> None:
        self.settings = settings
        self._shared = _Link(settings)
        self._specs: tuple[FunctionSpec, ...] = ()
        self._remote: dict[str, str] = {}
        self._repeatable: set[str] = set()
        self._slots = asyncio.Semaphore(settings.max_concurrency)

    async def __aenter__(self) -> MCPTool:
        settings = self.settings
        try:
            connection = await self._shared.get()
            listed = await asyncio.wait_for(_list_tools(connection), settings.connect_timeout_s)
        except Exception as exc:
            await self._shared.close()
            raise ToolUnavailableError(
                f"MCP server {settings.where}: cannot connect and list its tools within "
                f"{settings.connect_timeout_s:g} s ({_describe(exc)}); check the tool's "
                "`command`/`args` or `url`, and that the server runs") from None
        names = [tool.name for tool in listed]
        for field, wanted in (("tools", settings.tools or ()), ("idempotent", settings.idempotent)):
            missing = [name for name in wanted if name not in names]
            if missing:
                await self._shared.close()
                raise ToolConfigError(
                    f"MCP server {settings.where} does not list tool(s) {', '.join(map(repr, missing))}; it "
                    f"lists: {', '.join(names) or 'no tools'}. Fix the tool spec's `{field}:`"
                    + (" (or remove it to offer all of them)" if field == "tools" else ""))
        chosen = [tool for tool in listed if settings.tools is None or tool.name in settings.tools]
        try:
            self._specs = tuple(FunctionSpec(name=settings.prefix + tool.name, description=tool.description
                                             or "", parameters=dict(tool.input_schema)) for tool in chosen)
        except ValueError as exc:
            await self._shared.close()
            raise ToolConfigError(f"MCP server {settings.where} lists a tool vcpo cannot offer ({exc}); "
                                  "name the tools to offer in the spec's `tools:`") from None
        self._remote = {settings.prefix + tool.name: tool.name for tool in chosen}
        self._repeatable = {tool.name for tool in chosen if tool.name in settings.idempotent
                            or _marked_repeatable(tool)}
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._shared.close()

    def functions(self) -> tuple[FunctionSpec, ...]:
        return self._specs

    async def call_function(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        """Call `name` (as `functions()` lists it) on the shared connection."""
        return await self._call(self._shared, name, arguments)

    def session(self) -> MCPSession:
        """A connection of one episode's own (a stdio server process, an HTTP MCP session)."""
        return MCPSession(self)

    async def _call(self, link: _Link, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        settings, remote = self.settings, self._remote[name]
        started, failure, attempts = time.perf_counter(), "", 0
        async with self._slots:
            for attempt in range(settings.max_retries + 1):
                if attempt:
                    await asyncio.sleep(settings.retry_backoff_s * 2 ** (attempt - 1))
                attempts += 1
                try:
                    connection = await link.get()
                except Exception as exc:  # nothing was sent: always safe to try again
                    failure = f"cannot connect: {_describe(exc)}"
                    log.warning("MCP server %s: %s (attempt %d of %d)", settings.where, failure, attempts,
                                settings.max_retries + 1)
                    continue
                try:
                    session = connection.session
                    if session is None:
                        raise ConnectionError("the connection closed")
                    call = session.call_tool(remote, dict(arguments),
                                             read_timeout_seconds=settings.call_timeout_s)
                    # the SDK times the call out (and cancels it on the server); this is a backstop
                    result = await asyncio.wait_for(call, settings.call_timeout_s + 5.0)
                    return _result(result, time.perf_counter() - started)
                except Exception as exc:
                    code = getattr(exc, "code", None)
                    if isinstance(code, int) and code not in (_CONNECTION_CLOSED, _REQUEST_TIMEOUT):
                        return ToolResult(status="error", message=f"{remote}: {exc}",
                                          wall_time_s=time.perf_counter() - started)
                    timed_out = isinstance(exc, TimeoutError) or code == _REQUEST_TIMEOUT
                    failure = (f"no answer within {settings.call_timeout_s:g} s" if timed_out
                               else f"the connection broke: {_describe(exc)}")
                    log.warning("MCP server %s: call %r failed (attempt %d of %d): %s", settings.where,
                                remote, attempts, settings.max_retries + 1, failure)
                    if not timed_out or not connection.is_open:  # a timed-out call was cancelled alone
                        await link.drop(connection)
                    if remote not in self._repeatable:
                        return ToolResult(status="error", message=(
                            f"the tool server did not answer {remote!r} ({failure}); the call may have run, "
                            "so it was not repeated"), wall_time_s=time.perf_counter() - started)
        return ToolResult(status="error", message=(
            f"the tool server did not answer {remote!r} ({failure}) after {attempts} attempts"),
            wall_time_s=time.perf_counter() - started)


class MCPSession:
    """One episode's own connection to the server; opened on enter, closed on exit."""

    def __init__(self, tool: MCPTool) -> None:
        self._tool = tool
        self._link = _Link(tool.settings)

    async def __aenter__(self) -> MCPSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._link.close()

    async def call_function(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        """Call `name` on this episode's connection; a result on a replaced one says the state is gone."""
        before = self._link.opened
        result = await self._tool._call(self._link, name, arguments)
        if before and self._link.opened != before:
            return result.model_copy(update={
                "is_session_reset": True, "message": f"{result.message} {_RESTARTED_NOTE}".strip()})
        return result


async def _list_tools(connection: _Connection) -> list[Any]:
    """Every tool the server lists (all pages)."""
    from mcp.types import PaginatedRequestParams

    session = connection.session
    if session is None:
        raise ConnectionError("the connection closed")
    tools: list[Any] = []
    cursor: str | None = None
    for _ in range(100):  # a server whose pages never end cannot hang the start
        page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
        tools.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def _marked_repeatable(tool: Any) -> bool:
    """The server's annotations say a second call does no harm: read-only, or idempotent."""
    annotations = getattr(tool, "annotations", None)
    return bool(annotations and (annotations.read_only_hint or annotations.idempotent_hint))


def _describe(exc: BaseException) -> str:
    """What failed, for the model and the logs: the innermost errors of an exception group (the SDK's
    transports are task groups, whose own message "unhandled errors in a TaskGroup" says nothing)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(dict.fromkeys(_describe(inner) for inner in exc.exceptions))
    if exc.__cause__ is not None and not str(exc):
        return _describe(exc.__cause__)
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _result(result: Any, wall_time_s: float) -> ToolResult:
    """An MCP `CallToolResult` as a ToolResult: its text content (other content named), structured
    content as JSON when there is no text; `isError` as status `error` with the text as its message."""
    parts = []
    for block in result.content or ():
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')} content]")
    text = "\n".join(parts)
    if not text and getattr(result, "structured_content", None) is not None:
        text = json.dumps(result.structured_content)
    if result.is_error:
        return ToolResult(status="error", message=text or "the tool reported an error",
                          wall_time_s=wall_time_s)
    return ToolResult(status="ok", stdout=text, wall_time_s=wall_time_s)
