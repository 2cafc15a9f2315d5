"""E2B cloud sandboxes as a tool (`type: e2b`), through `e2b_code_interpreter.AsyncSandbox`.

One E2B sandbox (a small cloud VM with a Jupyter kernel server) per tool instance, created on
enter and killed on exit. Each `run` gets a fresh code context (a fresh kernel namespace) that is
removed afterwards; a `session()` keeps one context for its lifetime. A timeout in a session
restarts its context and reports the session as reset. Only printed output counts: the value of
a trailing expression (Jupyter's "result") is not added to stdout, as with the local sandbox.

The package is optional (`pip install 'vcpo[e2b]'`) and imported when the tool starts; it reads
E2B_API_KEY itself unless `api_key` is set. Failures of the E2B service raise
ToolUnavailableError; failures of the code are ToolResults.
"""

from __future__ import annotations

import asyncio
import importlib
import time
from types import TracebackType
from typing import Any, ClassVar

from pydantic import BaseModel

from tools._output import cap_text
from tools.base import ToolCall, ToolResult, ToolStatus, ToolUnavailableError
from tools.settings import E2BSettings

INSTALL_HINT = "the e2b tool needs the e2b-code-interpreter package: pip install 'vcpo[e2b]'"


def _import_e2b() -> Any:
    try:
        return importlib.import_module("e2b_code_interpreter")
    except ImportError as error:
        raise ToolUnavailableError(INSTALL_HINT) from error


def execution_to_result(
    execution: Any, *, wall_time_s: float, max_output_bytes: int, is_session_reset: bool = False
) -> ToolResult:
    """Map an E2B `Execution` (logs.stdout/stderr: lists of chunks; error: name, value, traceback)."""
    stdout, is_stdout_truncated = cap_text("".join(execution.logs.stdout), max_output_bytes)
    stderr_text = "".join(execution.logs.stderr)
    error = execution.error
    if error is not None:
        stderr_text += error.traceback if error.traceback else f"{error.name}: {error.value}\n"
    stderr, is_stderr_truncated = cap_text(stderr_text, max_output_bytes)
    status: ToolStatus
    if error is None:
        exit_code = 0
        is_truncated = is_stdout_truncated or is_stderr_truncated
        status = "output_truncated" if is_truncated else "ok"
        message = "The output was too long and was truncated." if is_truncated else ""
    else:
        exit_code = 1
        status = "memory" if error.name == "MemoryError" else "error"
        message = f"{error.name}: {error.value}"
    return ToolResult(
        status=status,
        stdout=stdout,
        stderr=stderr,
        exit_code=exit_code,
        wall_time_s=wall_time_s,
        is_stdout_truncated=is_stdout_truncated,
        is_stderr_truncated=is_stderr_truncated,
        message=message,
        is_session_reset=is_session_reset,
    )


class E2BTool:
    """`async with E2BTool(E2BSettings()) as tool: result = await tool.run(ToolCall(code=...))`"""

    name: ClassVar[str] = "e2b"
    settings_model: ClassVar[type[BaseModel]] = E2BSettings

    def __init__(self, settings: E2BSettings | None = None) -> None:
        self.settings = settings or E2BSettings()
        self._sandbox: Any = None
        self._timeout_error: type[BaseException] = TimeoutError
        self._slots = asyncio.Semaphore(self.settings.max_concurrency)

    async def __aenter__(self) -> E2BTool:
        module = _import_e2b()
        self._timeout_error = importlib.import_module("e2b").TimeoutException
        settings = self.settings
        options: dict[str, Any] = {
            "timeout": settings.sandbox_lifetime_s,
            "request_timeout": settings.request_timeout_s,
        }
        if settings.api_key is not None:
            options["api_key"] = settings.api_key.get_secret_value()
        if settings.template is not None:
            options["template"] = settings.template
        try:
            self._sandbox = await module.AsyncSandbox.create(**options)
        except Exception as error:
            raise ToolUnavailableError(
                f"could not create an E2B sandbox: {type(error).__name__}: {error}"
            ) from error
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._sandbox is not None:
            sandbox, self._sandbox = self._sandbox, None
            await sandbox.kill()

    async def run(self, call: ToolCall) -> ToolResult:
        """Run in a fresh code context, removed afterwards."""
        sandbox = self._require_sandbox()
        async with self._slots:
            context = await sandbox.create_code_context(language=call.language)
            try:
                result, _ = await self.execute(context, call)
            finally:
                await sandbox.remove_code_context(context)
        return result

    def session(self) -> E2BSession:
        return E2BSession(self)

    async def execute(self, context: Any, call: ToolCall) -> tuple[ToolResult, bool]:
        """Run `call` in `context`; returns the result and whether it timed out."""
        if call.stdin is not None or call.files or call.fetch_files:
            return ToolResult(
                status="error", message="the e2b tool supports neither stdin nor files; use type: python"
            ), False
        timeout_s = min(call.timeout_s or self.settings.timeout_s, self.settings.timeout_s)
        start = time.monotonic()
        try:
            execution = await self._require_sandbox().run_code(call.code, context=context, timeout=timeout_s)
        except self._timeout_error:
            message = f"Timed out after {timeout_s:g} s (wall clock)."
            return ToolResult(status="timeout", wall_time_s=time.monotonic() - start, message=message), True
        return execution_to_result(
            execution, wall_time_s=time.monotonic() - start, max_output_bytes=self.settings.max_output_bytes
        ), False

    def _require_sandbox(self) -> Any:
        if self._sandbox is None:
            raise RuntimeError("use the tool inside `async with E2BTool(settings) as tool:`")
        return self._sandbox


class E2BSession:
    """One E2B code context for the session's lifetime; restarted (and reported reset) on timeout."""

    def __init__(self, tool: E2BTool) -> None:
        self._tool = tool
        self._context: Any = None
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> E2BSession:
        self._context = await self._tool._require_sandbox().create_code_context()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._context is not None and self._tool._sandbox is not None:
            await self._tool._sandbox.remove_code_context(self._context)
        self._context = None

    async def run(self, call: ToolCall) -> ToolResult:
        async with self._lock:
            if self._context is None:
                raise RuntimeError("use the session inside `async with tool.session() as session:`")
            result, is_timeout = await self._tool.execute(self._context, call)
            if not is_timeout:
                return result
            await self._tool._require_sandbox().restart_code_context(self._context)
            note = " The session was reset: variables from earlier calls are gone."
            return result.model_copy(update={"is_session_reset": True, "message": result.message + note})
