"""A SandboxFusion service as a tool (`type: sandbox_fusion`): `POST /run_code` over async httpx.

Reliability, in the order a call meets it:
* concurrency: at most `max_concurrency` requests in flight (a semaphore; others wait), over a
  pooled HTTP/1.1 connection pool of the same size;
* circuit breaker (`_circuit_breaker.py`): after `breaker_failure_threshold` consecutive failed
  attempts calls fail fast with ToolUnavailableError until a trial after `breaker_cooldown_s` works;
* retries: only connection errors, timeouts and HTTP 5xx are retried, at most `max_retries`
  times, waiting `retry_backoff_s` doubled each time (capped at `max_backoff_s`). HTTP 4xx, a
  malformed response and SandboxError are not transient and raise at once.

A failure of the *code* (exception, timeout, memory) is a ToolResult like the local sandbox's; a
failure of the *service* raises ToolUnavailableError, so the rollout can decide what to do
instead of teaching the model that "connection refused" is what its code printed.
SandboxFusion's /run_code is stateless, so `session()` raises ToolConfigError.
Metrics: `metrics()` returns counters keyed `tools/sandbox_fusion_<name>`.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections import Counter
from types import TracebackType
from typing import Any, ClassVar, NoReturn

import httpx
from pydantic import BaseModel, ValidationError

from tools._output import cap_text, last_line
from tools.base import ToolCall, ToolConfigError, ToolResult, ToolStatus, ToolUnavailableError
from tools.sandbox_fusion._circuit_breaker import CircuitBreaker
from tools.sandbox_fusion.schema import RunCodeResponse
from tools.settings import SandboxFusionClientSettings

_TRANSIENT_ERRORS = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
"""Attempt failures worth retrying: the request may not have reached a healthy server."""

METRIC_PREFIX = "tools/sandbox_fusion_"
_COUNTERS = ("requests", "attempts", "retries", "transient_failures", "client_errors")


class SandboxFusionTool:
    """`async with SandboxFusionTool(settings) as tool: result = await tool.run(ToolCall(code=...))`"""

    name: ClassVar[str] = "sandbox_fusion"
    settings_model: ClassVar[type[BaseModel]] = SandboxFusionClientSettings
    has_sessions: ClassVar[bool] = False  # /run_code is stateless

    def __init__(self, settings: SandboxFusionClientSettings) -> None:
        self.settings = settings
        self._client: httpx.AsyncClient | None = None
        self._slots = asyncio.Semaphore(settings.max_concurrency)
        self.breaker = CircuitBreaker(
            f"SandboxFusion at {settings.endpoint}",
            settings.breaker_failure_threshold,
            settings.breaker_cooldown_s,
        )
        self._counts: Counter[str] = Counter(dict.fromkeys(_COUNTERS, 0))

    async def __aenter__(self) -> SandboxFusionTool:
        limits = httpx.Limits(
            max_connections=self.settings.max_concurrency,
            max_keepalive_connections=self.settings.max_concurrency,
        )
        self._client = httpx.AsyncClient(base_url=self.settings.endpoint.rstrip("/"), limits=limits)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def session(self) -> NoReturn:
        raise ToolConfigError(
            "SandboxFusion's /run_code is stateless, so it has no sessions; for stateful tasks use "
            "type: python (local sandbox) or type: e2b"
        )

    def metrics(self) -> dict[str, float]:
        values = {f"{METRIC_PREFIX}{key}": float(value) for key, value in self._counts.items()}
        values[f"{METRIC_PREFIX}breaker_opens"] = float(self.breaker.times_opened)
        values[f"{METRIC_PREFIX}breaker_rejections"] = float(self.breaker.rejections)
        values[f"{METRIC_PREFIX}breaker_is_open"] = float(self.breaker.state != "closed")
        return values

    async def run(self, call: ToolCall) -> ToolResult:
        settings = self.settings
        run_timeout_s = min(call.timeout_s or settings.run_timeout_s, settings.run_timeout_s)
        memory_limit_mb = call.memory_limit_mb or settings.memory_limit_mb
        if memory_limit_mb is not None and settings.memory_limit_mb is not None:
            memory_limit_mb = min(memory_limit_mb, settings.memory_limit_mb)
        body = {
            "code": call.code,
            "language": call.language,
            "run_timeout": run_timeout_s,
            "memory_limit_MB": memory_limit_mb if memory_limit_mb is not None else -1,
            "stdin": call.stdin,
            "files": {path: base64.b64encode(content).decode() for path, content in call.files.items()},
            "fetch_files": list(call.fetch_files),
        }
        async with self._slots:
            start = time.monotonic()
            payload = await self._post_with_retries(body, run_timeout_s)
            wall_time_s = time.monotonic() - start
        self._counts["requests"] += 1
        return response_to_result(
            payload, wall_time_s=wall_time_s, max_output_bytes=settings.max_output_bytes
        )

    async def _post_with_retries(self, body: dict[str, Any], run_timeout_s: float) -> Any:
        if self._client is None:
            raise RuntimeError("use the tool inside `async with SandboxFusionTool(settings) as tool:`")
        settings = self.settings
        timeout = httpx.Timeout(run_timeout_s + settings.response_slack_s, connect=settings.connect_timeout_s)
        last_problem = ""
        for attempt in range(settings.max_retries + 1):
            if attempt:
                self._counts["retries"] += 1
                await asyncio.sleep(
                    min(settings.retry_backoff_s * 2 ** (attempt - 1), settings.max_backoff_s)
                )
            self.breaker.before_attempt()
            self._counts["attempts"] += 1
            try:
                response = await self._client.post("/run_code", json=body, timeout=timeout)
            except _TRANSIENT_ERRORS as error:
                last_problem = f"{type(error).__name__}: {error}"
            else:
                if response.status_code < 500:
                    self.breaker.record_success()  # the service answered: it is up
                    return self._parse(response)
                last_problem = f"HTTP {response.status_code}: {response.text[:300]}"
            self.breaker.record_failure()
            self._counts["transient_failures"] += 1
        raise ToolUnavailableError(
            f"SandboxFusion at {settings.endpoint} failed {settings.max_retries + 1} attempt(s); "
            f"last problem: {last_problem}"
        )

    def _parse(self, response: httpx.Response) -> Any:
        if response.status_code != 200:
            self._counts["client_errors"] += 1
            raise ToolUnavailableError(
                f"SandboxFusion at {self.settings.endpoint} rejected the request "
                f"with HTTP {response.status_code} "
                f"(not retried: fix the request or the endpoint): {response.text[:500]}"
            )
        try:
            return response.json()
        except ValueError as error:
            raise ToolUnavailableError(
                f"SandboxFusion answered with invalid JSON: {response.text[:300]!r}"
            ) from error


def response_to_result(payload: Any, *, wall_time_s: float, max_output_bytes: int) -> ToolResult:
    """A `/run_code` response as a ToolResult. Raises ToolUnavailableError for SandboxError."""
    try:
        response = RunCodeResponse.model_validate(payload)
    except ValidationError as error:
        raise ToolUnavailableError(f"SandboxFusion's response does not fit its schema: {error}") from error
    if response.status == "SandboxError":
        raise ToolUnavailableError(
            f"SandboxFusion reported SandboxError: {response.message or '(no message)'}"
        )
    run = response.run_result or response.compile_result
    if run is None:
        raise ToolUnavailableError(f"SandboxFusion returned {response.status} without a run result")
    stdout, is_stdout_truncated = cap_text(run.stdout or "", max_output_bytes)
    stderr, is_stderr_truncated = cap_text(run.stderr or "", max_output_bytes)
    status: ToolStatus
    if run.status == "TimeLimitExceeded":
        status, message = (
            "timeout",
            f"Timed out after {run.execution_time or 0:.3g} s; the process was killed.",
        )
    elif run.return_code != 0:
        message = last_line(stderr) or response.message or f"Exited with status {run.return_code}."
        status = "memory" if message.startswith("MemoryError") else "error"
    elif is_stdout_truncated or is_stderr_truncated:
        status, message = "output_truncated", "The output was too long and was truncated."
    else:
        status, message = "ok", ""
    return ToolResult(
        status=status,
        stdout=stdout,
        stderr=stderr,
        exit_code=run.return_code,
        wall_time_s=wall_time_s,
        is_stdout_truncated=is_stdout_truncated,
        is_stderr_truncated=is_stderr_truncated,
        message=message,
        files={path: base64.b64decode(content) for path, content in response.files.items()},
    )
