"""The `mcp` tool against a real MCP server (the official SDK's, tests/tools/mcp_test_server.py) on stdio
and on loopback streamable HTTP: listing and calling tools, per-episode sessions, refusals at start,
and a server that hangs, dies or goes away and comes back."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.base import ToolConfigError, ToolUnavailableError
from tools.mcp_tool import MCPTool
from tools.registry import build_tool
from tools.settings import MCPSettings

SERVER = Path(__file__).with_name("mcp_test_server.py")
pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_http_server(port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen([sys.executable, str(SERVER), "http", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, "the MCP test server exited while starting"
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return process
        time.sleep(0.2)
    process.kill()
    raise AssertionError("the MCP test server did not listen within 60 s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    port = _free_port()
    process = _start_http_server(port)
    yield f"http://127.0.0.1:{port}/mcp"
    _stop(process)


def _stdio(**settings: Any) -> dict[str, Any]:
    return {"type": "mcp", "command": "python", "args": [str(SERVER)], "call_timeout_s": 5,
            "retry_backoff_s": 0.0, **settings}


@pytest.fixture(params=["stdio", "http"])
def spec(request: pytest.FixtureRequest) -> dict[str, Any]:
    if request.param == "stdio":
        return _stdio()
    return {"type": "mcp", "url": request.getfixturevalue("http_url"), "call_timeout_s": 5,
            "retry_backoff_s": 0.0}


async def test_it_lists_the_servers_tools_with_their_schemas_and_calls_them(spec: dict[str, Any]) -> None:
    async with build_tool(spec) as tool:
        functions = {f.name: f for f in tool.functions()}
        assert set(functions) == {"add", "note", "sleep", "crash"}
        assert functions["add"].description == "Add two integers."
        assert functions["add"].parameters["properties"]["a"]["type"] == "integer"
        assert functions["add"].parameters["required"] == ["a", "b"]
        ok = await tool.call_function("add", {"a": 2, "b": 3})
        assert (ok.status, ok.stdout) == ("ok", "5")
        refused = await tool.call_function("add", {"a": "two", "b": 3})  # the server's own validation
        assert refused.status == "error" and "valid integer" in refused.message


async def test_the_spec_picks_tools_and_prefixes_their_names(spec: dict[str, Any]) -> None:
    async with build_tool({**spec, "tools": ["add"], "prefix": "calc_"}) as tool:
        assert [f.name for f in tool.functions()] == ["calc_add"]
        assert (await tool.call_function("calc_add", {"a": 1, "b": 1})).stdout == "2"


async def test_a_tool_the_server_does_not_list_is_refused_at_start_with_the_list(spec: dict[str, Any]
                                                                                  ) -> None:
    with pytest.raises(ToolConfigError) as info:
        async with build_tool({**spec, "tools": ["add", "search"]}):
            pass
    assert "does not list tool(s) 'search'; it lists: add, note, sleep, crash" in str(info.value)


async def test_each_episode_session_has_its_own_server_state(spec: dict[str, Any]) -> None:
    async with build_tool(spec) as tool:
        assert (await tool.call_function("note", {"text": "a"})).stdout == "a"
        async with tool.session() as first, tool.session() as second:
            assert (await first.call_function("note", {"text": "x"})).stdout == "x"
            assert (await second.call_function("note", {"text": "y"})).stdout == "y"
            assert (await first.call_function("note", {"text": "z"})).stdout == "x,z"
        assert (await tool.call_function("note", {"text": "b"})).stdout == "a,b"  # the shared session


async def test_a_hung_call_is_cancelled_alone_and_not_repeated_unless_it_is_safe(spec: dict[str, Any]
                                                                                 ) -> None:
    async with build_tool({**spec, "call_timeout_s": 1.0, "max_retries": 1}) as tool:
        started = time.perf_counter()
        hung = await tool.call_function("sleep", {"seconds": 30})
        assert time.perf_counter() - started < 10
        assert hung.status == "error"
        assert hung.message == ("the tool server did not answer 'sleep' (no answer within 1 s); the call may "
                                "have run, so it was not repeated")
        assert (await tool.call_function("add", {"a": 2, "b": 2})).stdout == "4"
    async with build_tool({**spec, "call_timeout_s": 1.0, "max_retries": 1, "idempotent": ["sleep"]}) as tool:
        hung = await tool.call_function("sleep", {"seconds": 30})
        assert hung.message == ("the tool server did not answer 'sleep' (no answer within 1 s) after 2 "
                                "attempts")


async def test_a_hung_call_leaves_the_calls_in_flight_and_the_servers_state_alone(spec: dict[str, Any]
                                                                                 ) -> None:
    """On the shared connection: one call times out while another is in flight; the other answers and the
    server's state (a stdio server's process, an HTTP server's session) is the same after."""
    async with build_tool({**spec, "call_timeout_s": 3.0, "max_retries": 0}) as tool:
        assert (await tool.call_function("note", {"text": "a"})).stdout == "a"

        async def in_flight_when_the_other_times_out() -> Any:
            await asyncio.sleep(1.5)
            return await tool.call_function("sleep", {"seconds": 2.0})  # answers at ~3.5 s

        hung, other = await asyncio.gather(tool.call_function("sleep", {"seconds": 30}),
                                           in_flight_when_the_other_times_out())
        assert hung.status == "error" and "no answer within 3 s" in hung.message
        assert (other.status, other.stdout) == ("ok", "woke")
        assert (await tool.call_function("note", {"text": "b"})).stdout == "a,b"


async def test_an_episode_whose_session_was_replaced_is_told_its_state_is_gone() -> None:
    async with build_tool(_stdio(max_retries=1)) as tool, tool.session() as session:
        assert (await session.call_function("note", {"text": "x"})).stdout == "x"
        died = await session.call_function("crash", {})
        assert died.status == "error" and "the connection broke" in died.message
        assert "may have run, so it was not repeated" in died.message
        after = await session.call_function("note", {"text": "y"})
        assert (after.status, after.stdout, after.is_session_reset) == ("ok", "y", True)
        assert "state from this episode's earlier calls is gone" in after.message
        again = await session.call_function("note", {"text": "z"})
        assert (again.stdout, again.is_session_reset) == ("y,z", False)


async def test_a_stdio_server_that_dies_fails_the_call_and_is_restarted() -> None:
    async with build_tool(_stdio(max_retries=1)) as tool:
        died = await tool.call_function("crash", {})
        assert died.status == "error" and "it was not repeated" in died.message
        assert (await tool.call_function("add", {"a": 1, "b": 2})).stdout == "3"


async def test_an_http_server_that_goes_away_and_comes_back_is_reconnected() -> None:
    port = _free_port()
    process = _start_http_server(port)
    spec = {"type": "mcp", "url": f"http://127.0.0.1:{port}/mcp", "call_timeout_s": 3, "max_retries": 1,
            "retry_backoff_s": 0.0, "connect_timeout_s": 5}
    try:
        async with build_tool(spec) as tool:
            assert (await tool.call_function("add", {"a": 1, "b": 1})).stdout == "2"
            _stop(process)
            gone = await tool.call_function("add", {"a": 1, "b": 1})  # read-only: retried
            assert gone.status == "error" and "after 2 attempts" in gone.message
            assert "TaskGroup" not in gone.message, gone.message  # what failed, not the SDK's wrapper
            process = await asyncio.to_thread(_start_http_server, port)
            assert (await tool.call_function("add", {"a": 5, "b": 1})).stdout == "6"
    finally:
        _stop(process)


async def test_a_server_that_cannot_be_reached_stops_the_tool_at_start() -> None:
    closed = {"type": "mcp", "url": f"http://127.0.0.1:{_free_port()}/mcp", "connect_timeout_s": 5}
    with pytest.raises(ToolUnavailableError, match=r"MCP server http://127\.0\.0\.1:\d+/mcp: cannot connect"):
        async with build_tool(closed):
            pass
    with pytest.raises(ToolUnavailableError, match="no-such-mcp-server"):
        async with build_tool({"type": "mcp", "command": "no-such-mcp-server", "connect_timeout_s": 5}):
            pass


async def test_an_idempotent_name_the_server_does_not_list_is_refused_at_start() -> None:
    with pytest.raises(ToolConfigError, match=r"not list tool\(s\) 'search'.*the tool spec's `idempotent:`"):
        async with build_tool(_stdio(idempotent=["add", "search"])):
            pass


def test_the_settings_need_exactly_one_transport() -> None:
    with pytest.raises(ToolConfigError, match="set exactly one of `command`"):
        build_tool({"type": "mcp"})
    with pytest.raises(ToolConfigError, match="set exactly one of `command`"):
        build_tool({"type": "mcp", "command": "python", "url": "http://127.0.0.1:1/mcp"})
    assert isinstance(build_tool({"type": "mcp", "url": "http://127.0.0.1:1/mcp"}), MCPTool)
    assert MCPSettings(command="python", args=("s.py",)).where == "python s.py"
