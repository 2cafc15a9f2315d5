"""The SandboxFusion-compatible server (`serve`) driven by the official `sandbox-fusion` client and
by our own `SandboxFusionTool`, and our client's retries, timeouts and circuit breaker against a
small misbehaving HTTP server on loopback."""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.tools.conftest import REPO_ROOT
from tools.base import ToolCall, ToolConfigError, ToolUnavailableError
from tools.sandbox_fusion._circuit_breaker import CircuitBreaker, CircuitOpenError
from tools.sandbox_fusion.client import SandboxFusionTool
from tools.sandbox_fusion.server import check_bind_host
from tools.settings import SandboxFusionClientSettings, SandboxServerSettings

sandbox_fusion = pytest.importorskip("sandbox_fusion", reason="pip install sandbox-fusion==0.3.7 (dev extra)")

SERVER_CODE = """
from tools.sandbox_fusion.server import serve
from tools.settings import LocalSandboxSettings, SandboxServerSettings
sandbox = LocalSandboxSettings(timeout_s=3, memory_limit_mb=512, warm_pool_size=1)
serve("127.0.0.1", {port}, SandboxServerSettings(sandbox=sandbox, log_level="warning"))
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    """`serve()` in a child process on a free loopback port, stopped with SIGTERM."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER_CODE.format(port=port)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/v1/ping", timeout=1).text == "pong":
                break
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            pytest.fail(f"server did not start: {server.communicate()[0].decode(errors='replace')}")
        time.sleep(0.1)
    yield url
    server.send_signal(signal.SIGTERM)
    output = server.communicate(timeout=20)[0].decode(errors="replace")
    # uvicorn shuts down gracefully (lifespan closes the sandboxes), then re-raises the signal.
    assert server.returncode in (0, -signal.SIGTERM) and "Traceback" not in output, output


# --- the official client -------------------------------------------------------------------


def test_official_client_runs_python(server_url: str) -> None:
    request = sandbox_fusion.RunCodeRequest(code="print('hello')", language="python")
    response = sandbox_fusion.run_code(request, endpoint=server_url, max_attempts=1)
    assert response.status == sandbox_fusion.RunStatus.Success
    assert (response.run_result.status, response.run_result.return_code) == ("Finished", 0)
    assert response.run_result.stdout == "hello\n" and response.compile_result is None


def test_official_client_reads_its_endpoint_from_the_environment(
    server_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = importlib.import_module("sandbox_fusion.config")
    monkeypatch.setenv("SANDBOX_FUSION_ENDPOINT", server_url)
    try:
        importlib.reload(config)  # the package reads the variable when imported
        response = sandbox_fusion.run_code(sandbox_fusion.RunCodeRequest(code="print(2)", language="python"))
    finally:
        monkeypatch.undo()
        importlib.reload(config)
    assert response.run_result.stdout == "2\n"


def test_official_client_sees_failures_as_failed(server_url: str) -> None:
    request = sandbox_fusion.RunCodeRequest(code="1 / 0", language="python")
    response = sandbox_fusion.run_code(request, endpoint=server_url, max_attempts=1)
    assert response.status == sandbox_fusion.RunStatus.Failed
    assert response.run_result.return_code == 1 and "ZeroDivisionError" in response.run_result.stderr


def test_official_client_sees_timeouts(server_url: str) -> None:
    request = sandbox_fusion.RunCodeRequest(code="while True: pass", language="python", run_timeout=1)
    response = sandbox_fusion.run_code(request, endpoint=server_url, max_attempts=1)
    assert response.status == sandbox_fusion.RunStatus.Failed
    assert response.run_result.status == "TimeLimitExceeded" and response.run_result.return_code is None
    assert 0.95 <= response.run_result.execution_time < 2.5


def test_official_client_with_stdin_files_and_fetch_files(server_url: str) -> None:
    request = sandbox_fusion.RunCodeRequest(
        code="print(input()); open('out.txt', 'w').write(open('in.txt').read() * 2)",
        language="python",
        stdin="from stdin\n",
        files={"in.txt": base64.b64encode(b"ab").decode()},
        fetch_files=["out.txt"],
    )
    response = sandbox_fusion.run_code(request, endpoint=server_url, max_attempts=1)
    assert response.run_result.stdout == "from stdin\n"
    assert base64.b64decode(response.files["out.txt"]) == b"abab"


def test_official_client_runs_bash(server_url: str) -> None:
    request = sandbox_fusion.RunCodeRequest(code="echo $((6 * 7)); exit 3", language="bash")
    response = sandbox_fusion.run_code(request, endpoint=server_url, max_attempts=1)
    assert response.status == sandbox_fusion.RunStatus.Failed
    assert (response.run_result.stdout, response.run_result.return_code) == ("42\n", 3)


def test_unsupported_language_is_a_sandbox_error_the_client_raises(server_url: str) -> None:
    request = sandbox_fusion.RunCodeRequest(code="int main() {}", language="cpp")
    with pytest.raises(Exception, match="language 'cpp' is not supported by this server"):
        sandbox_fusion.run_code(request, endpoint=server_url, max_attempts=1)


async def test_official_async_client(server_url: str) -> None:
    request = sandbox_fusion.RunCodeRequest(code="print(sum(range(10)))", language="python")
    response = await sandbox_fusion.run_code_async(request, endpoint=server_url, max_attempts=1)
    assert response.run_result.stdout == "45\n"


def test_memory_limit_mb_is_honoured_when_posted_directly(server_url: str) -> None:
    # The 0.3.7 client drops memory_limit_MB, so post the service's JSON ourselves.
    body = {"code": "x = bytearray(300 << 20)\nprint('fits')", "language": "python"}
    within = httpx.post(f"{server_url}/run_code", json=body, timeout=30).json()
    limited = httpx.post(f"{server_url}/run_code", json={**body, "memory_limit_MB": 100}, timeout=30).json()
    assert (within["status"], within["run_result"]["stdout"]) == ("Success", "fits\n")
    assert limited["status"] == "Failed" and "MemoryError" in limited["run_result"]["stderr"]


def test_oversized_request_is_rejected_with_413(server_url: str) -> None:
    body = json.dumps({"code": "#" * (17 << 20), "language": "python"})
    response = httpx.post(f"{server_url}/run_code", content=body, timeout=30)
    assert response.status_code == 413


# --- our client against our server ---------------------------------------------------------


async def test_our_client_against_our_server(server_url: str) -> None:
    settings = SandboxFusionClientSettings(endpoint=server_url, run_timeout_s=2, memory_limit_mb=100)
    async with SandboxFusionTool(settings) as tool:
        ok, error, timeout, memory = await asyncio.gather(
            tool.run(ToolCall(code="print('hi')")),
            tool.run(ToolCall(code="raise ValueError('bad')")),
            tool.run(ToolCall(code="import time; time.sleep(10)", timeout_s=1)),
            tool.run(ToolCall(code="x = bytearray(300 << 20)")),
        )
        metrics = tool.metrics()
    assert (ok.status, ok.stdout, ok.exit_code) == ("ok", "hi\n", 0)
    assert (error.status, error.message) == ("error", "ValueError: bad")
    assert (timeout.status, timeout.exit_code) == ("timeout", None) and timeout.wall_time_s < 3
    assert memory.status == "memory"
    assert metrics["tools/sandbox_fusion_requests"] == 4 and metrics["tools/sandbox_fusion_retries"] == 0


async def test_sandbox_fusion_has_no_sessions() -> None:
    tool = SandboxFusionTool(SandboxFusionClientSettings(endpoint="http://127.0.0.1:1"))
    with pytest.raises(ToolConfigError, match="stateless"):
        tool.session()


def test_server_refuses_non_loopback_hosts_without_the_explicit_setting() -> None:
    check_bind_host("127.0.0.1", SandboxServerSettings())
    check_bind_host("::1", SandboxServerSettings())
    check_bind_host("localhost", SandboxServerSettings())
    with pytest.raises(ToolConfigError, match="use_non_loopback_host"):
        check_bind_host("0.0.0.0", SandboxServerSettings())
    check_bind_host("0.0.0.0", SandboxServerSettings(use_non_loopback_host=True))


# --- retries, timeouts and the breaker against a misbehaving server --------------------------

OK_RESPONSE = {
    "status": "Success",
    "message": "",
    "run_result": {
        "status": "Finished",
        "execution_time": 0.01,
        "return_code": 0,
        "stdout": "ok\n",
        "stderr": "",
    },
}


class MisbehavingServer:
    """HTTP on loopback that answers request i with `script[min(i, len - 1)]`: an HTTP status
    ("200", "404", "503", ...), "close" (drop the connection without answering) or "hang"."""

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.hits = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> MisbehavingServer:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        await reader.readexactly(length)
        action = self.script[min(self.hits, len(self.script) - 1)]
        self.hits += 1
        if action == "hang":
            await asyncio.sleep(30)
        if action != "close":
            body = json.dumps(OK_RESPONSE if action == "200" else {"detail": action}).encode()
            writer.write(
                f"HTTP/1.1 {action} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        writer.close()


def _client(url: str, **overrides: object) -> SandboxFusionTool:
    values: dict[str, object] = {"endpoint": url, "retry_backoff_s": 0.01, "max_retries": 3, **overrides}
    return SandboxFusionTool(SandboxFusionClientSettings.model_validate(values))


async def test_5xx_is_retried_with_backoff_until_success() -> None:
    async with MisbehavingServer(["503", "500", "200"]) as server, _client(server.url) as tool:
        start = time.monotonic()
        result = await tool.run(ToolCall(code="print('ok')"))
        elapsed = time.monotonic() - start
        metrics = tool.metrics()
    assert (result.status, result.stdout, server.hits) == ("ok", "ok\n", 3)
    assert metrics["tools/sandbox_fusion_retries"] == 2
    assert elapsed >= 0.01 + 0.02  # backoff 0.01 s, then doubled


async def test_dropped_connections_are_retried() -> None:
    async with MisbehavingServer(["close", "200"]) as server, _client(server.url) as tool:
        result = await tool.run(ToolCall(code="print('ok')"))
    assert result.status == "ok" and server.hits == 2


async def test_4xx_is_not_retried() -> None:
    async with MisbehavingServer(["404", "200"]) as server, _client(server.url) as tool:
        with pytest.raises(ToolUnavailableError, match=r"HTTP 404.*not retried"):
            await tool.run(ToolCall(code="print('ok')"))
    assert server.hits == 1


async def test_retries_are_bounded() -> None:
    async with MisbehavingServer(["502"]) as server, _client(server.url, max_retries=2) as tool:
        with pytest.raises(ToolUnavailableError, match=r"failed 3 attempt.*HTTP 502"):
            await tool.run(ToolCall(code="print('ok')"))
    assert server.hits == 3


async def test_a_hung_server_times_out_and_the_timeout_is_retried() -> None:
    async with (
        MisbehavingServer(["hang", "200"]) as server,
        _client(server.url, run_timeout_s=0.2, response_slack_s=0.1) as tool,
    ):
        start = time.monotonic()
        result = await tool.run(ToolCall(code="print('ok')"))
    assert result.status == "ok" and server.hits == 2
    assert 0.3 <= time.monotonic() - start < 2


async def test_connection_refused_is_transient_and_reported() -> None:
    async with _client(f"http://127.0.0.1:{_free_port()}", max_retries=1) as tool:
        with pytest.raises(ToolUnavailableError, match="ConnectError"):
            await tool.run(ToolCall(code="print('ok')"))
        assert tool.metrics()["tools/sandbox_fusion_transient_failures"] == 2


async def test_breaker_opens_fails_fast_then_half_opens_after_the_cooldown() -> None:
    async with (
        MisbehavingServer(["503", "503", "503", "200"]) as server,
        _client(server.url, max_retries=0, breaker_failure_threshold=3, breaker_cooldown_s=0.3) as tool,
    ):
        for _ in range(3):
            with pytest.raises(ToolUnavailableError, match="HTTP 503"):
                await tool.run(ToolCall(code="print('ok')"))
        assert tool.breaker.state == "open"
        with pytest.raises(CircuitOpenError, match="circuit open after 3 consecutive failures"):
            await tool.run(ToolCall(code="print('ok')"))
        assert server.hits == 3  # failed fast: the server was not contacted
        await asyncio.sleep(0.35)
        result = await tool.run(ToolCall(code="print('ok')"))  # the half-open trial
        assert result.status == "ok" and server.hits == 4 and tool.breaker.state == "closed"
        assert tool.metrics()["tools/sandbox_fusion_breaker_rejections"] == 1


def test_breaker_reopens_when_the_half_open_trial_fails() -> None:
    now = [0.0]
    breaker = CircuitBreaker("svc", failure_threshold=2, cooldown_s=10, clock=lambda: now[0])
    breaker.before_attempt()
    breaker.record_failure()
    breaker.before_attempt()
    breaker.record_failure()
    assert breaker.state == "open"
    now[0] = 10.0
    breaker.before_attempt()  # the trial
    assert breaker.state == "half_open"
    with pytest.raises(CircuitOpenError, match="trial request is in flight"):
        breaker.before_attempt()
    breaker.record_failure()
    assert breaker.state == "open" and breaker.times_opened == 2
    now[0] = 15.0
    with pytest.raises(CircuitOpenError, match=r"next trial in 5\.0 s"):
        breaker.before_attempt()
