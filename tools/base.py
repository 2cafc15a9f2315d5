"""The one seam between the agent loop and code execution: the `Tool` protocol and its data.

A tool call is a frozen `ToolCall` (code plus optional stdin, files and tighter limits); the answer
is a frozen `ToolResult`. A failure of the *executed code* (exception, timeout, memory, flood of
output) is data in the result, never an exception: the model sees it and the loop goes on. Only
problems on our side raise: a missing sandbox backend or bad settings (`ToolConfigError`,
`ToolUnavailableError`), or a bug.

For function calling a tool is seen as named functions with JSON schemas (`FunctionSpec`): a tool
that offers its own (an MCP server, `FunctionTool`) lists them; a code-execution tool is one function
whose only argument is the code (`code_function_spec`).

This module defines types, plus `code_fence_of` (which fenced blocks a tool reads: its optional
`code_fence` declaration, checked); implementations live beside it (`local_sandbox.py`,
`sandbox_fusion_client.py`, `e2b.py`, `mcp_tool.py`, `fakes.py`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

ToolStatus = Literal["ok", "error", "timeout", "memory", "output_truncated"]
"""How a call ended, most severe first when several apply: `timeout` (wall-clock or CPU-time
limit; the process tree was killed), `memory` (MemoryError or killed by the kernel for memory),
`error` (an exception or a non-zero exit), `output_truncated` (ran fine but stdout or stderr
exceeded the byte cap), `ok`."""

Language = Literal["python", "bash"]

DEFAULT_CODE_FENCE = "python"
"""The fence language of a tool that declares no `code_fence` (every built-in tool)."""

_FENCE_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+.-]*")

_FROZEN_WITH_BYTES = ConfigDict(
    frozen=True,
    extra="forbid",
    use_attribute_docstrings=True,
    ser_json_bytes="base64",
    val_json_bytes="base64",
)
"""Immutable, strict, and file contents (bytes) as base64 in JSON, so results can be logged."""


class ToolCall(BaseModel):
    """One execution request. Per-call limits can only tighten the tool's configured limits."""

    model_config = _FROZEN_WITH_BYTES

    code: str
    """Source code to run (the tool's preamble, if any, runs first in the same namespace)."""
    language: Language = "python"
    """Interpreter for `code`; `bash` runs under the same sandbox as python."""
    stdin: str | None = None
    """Text on the program's standard input; None gives an empty stdin."""
    timeout_s: float | None = Field(default=None, gt=0)
    """Wall-clock limit in seconds; None uses the tool's limit, larger values are capped at it."""
    memory_limit_mb: int | None = Field(default=None, gt=0)
    """Memory cap in MiB; None uses the tool's limit, larger values are capped at it."""
    files: Mapping[str, bytes] = Field(default_factory=dict)
    """Files written into the work directory before the code runs: relative path -> content."""
    fetch_files: tuple[str, ...] = ()
    """Paths (relative to the work directory) read back after the run into `ToolResult.files`."""


class ToolResult(BaseModel):
    """What one call produced. Output strings are decoded as UTF-8 with replacement characters."""

    model_config = _FROZEN_WITH_BYTES

    status: ToolStatus
    """How the call ended; see `ToolStatus`."""
    stdout: str = ""
    """Standard output, cut at the tool's byte cap with a marker line when truncated."""
    stderr: str = ""
    """Standard error (tracebacks), cut at the byte cap with a marker line when truncated."""
    exit_code: int | None = None
    """Process exit status (128+N when killed by signal N); None when the run was timed out."""
    wall_time_s: float = 0.0
    """Seconds from handing the code to the sandbox until its result was known."""
    cpu_time_s: float | None = None
    """User+system CPU seconds of the code and its children; None when the sandbox was killed."""
    is_stdout_truncated: bool = False
    """True when stdout exceeded the byte cap (the rest was read and dropped)."""
    is_stderr_truncated: bool = False
    """True when stderr exceeded the byte cap."""
    message: str = ""
    """One line for the model or the logs on non-ok results ("Timed out after 2 s ..."); "" if ok."""
    files: Mapping[str, bytes] = Field(default_factory=dict)
    """Contents of the requested `fetch_files` that existed (each cut at the tool's file cap)."""
    is_session_reset: bool = False
    """True in a stateful session when this call killed the interpreter: earlier variables are gone."""

    @property
    def is_ok(self) -> bool:
        return self.status in ("ok", "output_truncated")


@runtime_checkable
class ToolSession(Protocol):
    """A stateful interpreter for one trajectory: variables survive between calls. Calls are serial."""

    async def run(self, call: ToolCall) -> ToolResult: ...


@runtime_checkable
class Tool(Protocol):
    """A code-execution backend. Use it as an async context manager; `run` may be called
    concurrently from many tasks (the tool bounds its own concurrency).

    To be built from config by `tools/registry.py`, a class also needs `settings_model` (a
    pydantic model with `extra="forbid"`) and a constructor taking one instance of it.

    Optional: `code_fence: ClassVar[str]`, the language tag of the fenced block the agent loop hands
    this tool, e.g. `"sql"` for a tool that runs ```` ```sql ```` blocks. The loop stops a turn at
    that block's closing fence and passes the block's content as `ToolCall.code` (with the default
    `language`; a tool with its own fence reads `code` in its own language). Without it the tool
    gets ```` ```python ```` blocks (also ```` ```py ````), as every built-in tool does. Read it
    with `code_fence_of`, which checks it.

    Optional: `has_sessions: ClassVar[bool]`, False for a tool whose backend keeps no state between
    calls (its `session` raises); a task with `loop.use_session: true` is then refused when it loads.
    Read it with `has_sessions`.
    """

    name: ClassVar[str]

    async def __aenter__(self) -> Any: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    async def run(self, call: ToolCall) -> ToolResult:
        """Execute one call in a fresh interpreter. Failures of the code are data in the result."""
        ...

    def session(self) -> AbstractAsyncContextManager[ToolSession]:
        """A stateful session, closed (and its interpreter killed) when the context exits."""
        ...


class FunctionSpec(BaseModel):
    """One function a model may call: its name, what it does and its arguments' JSON schema."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    """The name the model writes in a call (letters, digits, `_ . -`)."""
    description: str = ""
    """What the function does, shown to the model."""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    """The JSON schema of the arguments object."""

    def as_template_tool(self) -> dict[str, Any]:
        """The OpenAI-style entry chat templates read from `tools=`."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@runtime_checkable
class FunctionSession(Protocol):
    """One episode's stateful connection to a function tool (e.g. an MCP session)."""

    async def call_function(self, name: str, arguments: Mapping[str, Any]) -> ToolResult: ...


@runtime_checkable
class FunctionTool(Protocol):
    """A tool that offers named functions with JSON schemas instead of running code (tool type
    `mcp`). Used as an async context manager like `Tool`; `functions()` is known once it is entered.
    A failure of a call (the function's own error, a server that stopped answering) is data in the
    result, never an exception. `session()` gives one episode its own session (`loop.use_session`)."""

    name: ClassVar[str]

    async def __aenter__(self) -> Any: ...

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...

    def functions(self) -> tuple[FunctionSpec, ...]: ...

    async def call_function(self, name: str, arguments: Mapping[str, Any]) -> ToolResult: ...

    def session(self) -> AbstractAsyncContextManager[FunctionSession]: ...


CODE_ARGUMENT = "code"
"""The one argument of a code-execution tool called as a function."""


def code_function_spec(tool: object) -> FunctionSpec:
    """A code-execution tool (class or instance) as one function: named after the tool (`python`,
    `sandbox_fusion`, ...), taking the code in its fence language as `code: string`."""
    language = code_fence_of(tool)
    name = getattr(tool, "name", None) or language
    return FunctionSpec(
        name=name,
        description=(f"Run {language} code in a sandbox and return what it prints (stdout); an exception "
                     "returns its last line. Nothing is shown unless the code prints it."),
        parameters={"type": "object", "properties": {CODE_ARGUMENT: {
            "type": "string", "description": f"The {language} code to run."}},
            "required": [CODE_ARGUMENT], "additionalProperties": False},
    )


def offers_functions(tool_class: type) -> bool:
    """Whether a tool class lists its own functions (a `FunctionTool`) rather than running code."""
    return callable(getattr(tool_class, "functions", None)) and callable(getattr(tool_class, "call_function",
                                                                                 None))


class ToolError(Exception):
    """Base of the errors our tools raise (never for failures of the executed code)."""


class ToolConfigError(ToolError, ValueError):
    """Settings or a tool spec are invalid; the message names the field, the value and the fix."""


class ToolUnavailableError(ToolError, RuntimeError):
    """The backend cannot be used (missing program or package, service down, circuit open)."""


def code_fence_of(tool: object) -> str:
    """The fence language `tool` (a tool class or instance) declares as `code_fence`, else "python".

    Raises ToolConfigError for a declaration the loop cannot match: not a single tag such as
    `sql` or `c++` (letters, digits and `_+.-`, starting with a letter or digit)."""
    fence = getattr(tool, "code_fence", DEFAULT_CODE_FENCE)
    if not isinstance(fence, str) or not _FENCE_TAG.fullmatch(fence):
        owner = tool if isinstance(tool, type) else type(tool)
        raise ToolConfigError(
            f"{owner.__module__}.{owner.__qualname__}.code_fence = {fence!r} is not a fence language tag; "
            "declare one word such as code_fence = 'sql' (letters, digits, _ + . -), or remove it for "
            "```python blocks"
        )
    return fence


def has_sessions(tool_class: type) -> bool:
    """Whether a tool class offers stateful sessions (its optional `has_sessions`, default True)."""
    return bool(getattr(tool_class, "has_sessions", True))
