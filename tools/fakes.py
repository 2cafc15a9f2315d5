"""In-tree fakes of the `Tool` protocol, for unit tests of control logic elsewhere (agent loop,
rollout scheduling, cancellation). They execute nothing. A test that claims code execution works
must use a real tool (`LocalPythonSandbox`), never these.

* `EchoTool` answers every call with its code as stdout (`type: echo` in the registry).
* `ScriptedTool` answers with a given list of results, in order, and records the calls.
Both can wait `delay_s` per call to exercise timeouts and cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from tools.base import ToolCall, ToolResult


class EchoToolSettings(BaseModel):
    """Settings of the echo fake."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    type: Literal["echo"] = "echo"
    """Registry key of this tool."""
    delay_s: float = Field(default=0.0, ge=0)
    """Seconds each call waits before answering."""


_Self = TypeVar("_Self", bound="_NoResources")


class _NoResources:
    """Async context manager that holds nothing: fakes start and stop instantly."""

    async def __aenter__(self: _Self) -> _Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None


class _FakeBase(_NoResources):
    """Shared plumbing of the fakes: optional delay, sessions that just forward."""

    delay_s: float = 0.0

    async def run(self, call: ToolCall) -> ToolResult:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return self._answer(call)

    def _answer(self, call: ToolCall) -> ToolResult:
        raise NotImplementedError

    def session(self) -> _FakeSession:
        return _FakeSession(self)


class _FakeSession(_NoResources):
    def __init__(self, tool: _FakeBase) -> None:
        self._tool = tool

    async def run(self, call: ToolCall) -> ToolResult:
        return await self._tool.run(call)


class EchoTool(_FakeBase):
    """Returns `ToolResult(status="ok", stdout=call.code)` for every call."""

    name: ClassVar[str] = "echo"
    settings_model: ClassVar[type[BaseModel]] = EchoToolSettings

    def __init__(self, settings: EchoToolSettings | None = None) -> None:
        self.settings = settings or EchoToolSettings()
        self.delay_s = self.settings.delay_s

    def _answer(self, call: ToolCall) -> ToolResult:
        return ToolResult(status="ok", stdout=call.code, exit_code=0)


class ScriptedTool(_FakeBase):
    """Answers with `results` in order (raises IndexError past the end: the test under-scripted)
    and appends every call to `calls`."""

    name: ClassVar[str] = "scripted"

    def __init__(self, results: Sequence[ToolResult], delay_s: float = 0.0) -> None:
        self._results = list(results)
        self.delay_s = delay_s
        self.calls: list[ToolCall] = []

    def _answer(self, call: ToolCall) -> ToolResult:
        index = len(self.calls)
        self.calls.append(call)
        if index >= len(self._results):
            raise IndexError(
                f"ScriptedTool got call #{index + 1} but was scripted with {len(self._results)} results"
            )
        return self._results[index]
