"""Function calling over a task's tools: one namespace of named functions, argument checks against
their JSON schemas, and an episode's calls (concurrent, on per-episode sessions when asked).

A `Toolbox` joins the started tools of a task into one set of functions: a tool that lists its own
(`FunctionTool`, e.g. an MCP server) contributes each of them; a code-execution tool (`python`,
`sandbox_fusion`, a plug-in with a `code_fence`) is one function taking `code: string`. Names must
be unique across the tools. The agent loop asks the toolbox for the chat template's `tools=` list,
checks each parsed call (`problem`) and runs an episode's calls through `episode()`.

What it does not do: parse model text (agent_env), or decide what the model sees of a result.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from tools.base import (
    CODE_ARGUMENT,
    FunctionSpec,
    ToolCall,
    ToolConfigError,
    ToolResult,
    ToolUnavailableError,
    code_function_spec,
    offers_functions,
)

log = logging.getLogger(__name__)

CallProblem = Literal["unknown", "invalid_arguments"]


@dataclass(frozen=True)
class _Route:
    spec: FunctionSpec
    tool_index: int
    is_code: bool


class Toolbox:
    """The functions of a task's started tools (see the module docstring). Build it after the tools are
    entered (an MCP tool knows its functions only then); it does not own or close them."""

    def __init__(self, tools: Sequence[Any]) -> None:
        routes: dict[str, _Route] = {}
        for index, tool in enumerate(tools):
            is_code = not offers_functions(type(tool))
            specs = (code_function_spec(tool),) if is_code else tuple(tool.functions())
            for spec in specs:
                if spec.name in routes:
                    other = routes[spec.name].tool_index
                    raise ToolConfigError(
                        f"tools.{other} and tools.{index} both offer a function named {spec.name!r}; "
                        "give an mcp tool a `prefix:` (or list only some of its `tools:`), or keep one")
                routes[spec.name] = _Route(spec, index, is_code)
        self._validators: dict[str, Draft202012Validator] = {}
        for name, route in routes.items():
            try:
                Draft202012Validator.check_schema(route.spec.parameters)
            except SchemaError as exc:
                raise ToolConfigError(f"tools.{route.tool_index}: function {name!r} declares an invalid JSON "
                                      f"schema for its arguments: {exc.message}") from None
            self._validators[name] = Draft202012Validator(route.spec.parameters)
        self.tools = tuple(tools)
        self._routes = routes

    def route(self, name: str) -> _Route:
        """Where the function `name` runs (KeyError for a name no tool offers)."""
        return self._routes[name]

    @property
    def specs(self) -> tuple[FunctionSpec, ...]:
        return tuple(route.spec for route in self._routes.values())

    def template_tools(self) -> list[dict[str, Any]]:
        """The `tools=` list of `tokenizer.apply_chat_template`, in the tools' order."""
        return [spec.as_template_tool() for spec in self.specs]

    def problem(self, name: str, arguments: Mapping[str, Any]) -> tuple[CallProblem, str] | None:
        """Why a call cannot run (an unknown name, arguments against the schema), for the model; None if
        it can."""
        if name not in self._routes:
            return "unknown", f"unknown tool {name!r}; the tools are: {', '.join(self._routes)}"
        errors = sorted(self._validators[name].iter_errors(dict(arguments)), key=lambda e: list(e.path))
        if errors:
            details = "; ".join(f"{'.'.join(str(p) for p in e.path) or '(arguments)'}: {e.message}"
                                for e in errors[:3])
            return "invalid_arguments", f"arguments of {name!r} do not match its schema: {details}"
        return None

    @contextlib.asynccontextmanager
    async def episode(self, *, use_session: bool = False, preamble: str = ""
                      ) -> AsyncIterator[ToolboxEpisode]:
        """One episode's view: calls run on the shared tools, or with `use_session` on sessions of their
        own, opened when the episode first calls the tool and closed when the episode ends."""
        async with contextlib.AsyncExitStack() as stack:
            yield ToolboxEpisode(self, stack, use_session, preamble)


class ToolboxEpisode:
    """Runs one episode's calls; see `Toolbox.episode`."""

    def __init__(self, toolbox: Toolbox, stack: contextlib.AsyncExitStack, use_session: bool,
                 preamble: str) -> None:
        self.toolbox = toolbox
        self._stack, self._use_session, self._preamble = stack, use_session, preamble
        self._sessions: dict[int, Any] = {}
        self._locks: dict[int, asyncio.Lock] = {}

    async def run(self, calls: Sequence[tuple[str, Mapping[str, Any]]]) -> list[ToolResult]:
        """Run checked calls (`Toolbox.problem` is None for each) concurrently; results in call order.
        Calls to one session run one after another (a session is one interpreter or connection)."""
        routes = [self.toolbox.route(name) for name, _ in calls]
        if self._use_session:  # opened here, in the episode's task, which also closes them
            for route in routes:
                if route.tool_index not in self._sessions:
                    tool = self.toolbox.tools[route.tool_index]
                    self._sessions[route.tool_index] = await self._stack.enter_async_context(tool.session())
                    self._locks[route.tool_index] = asyncio.Lock()
        return list(await asyncio.gather(*(self._call(route, arguments)
                                           for route, (_, arguments) in zip(routes, calls, strict=True))))

    async def _call(self, route: _Route, arguments: Mapping[str, Any]) -> ToolResult:
        index = route.tool_index
        runner = self._sessions.get(index, self.toolbox.tools[index])
        lock = self._locks.get(index)
        try:
            async with lock if lock is not None else contextlib.nullcontext():
                if route.is_code:
                    return await runner.run(ToolCall(code=self._preamble + str(arguments[CODE_ARGUMENT])))
                return await runner.call_function(route.spec.name, arguments)
        except ToolUnavailableError:
            raise  # the backend is down for everyone: the run stops loudly, not train on errors
        except Exception as exc:  # a bug or a broken backend for this one call: data, counted as an error
            log.warning("tool %r failed on our side (%s: %s); the model sees an error", route.spec.name,
                        type(exc).__name__, exc)
            return ToolResult(status="error", message=f"ToolError: {type(exc).__name__}: {str(exc)[:200]}")
