"""Tools as functions: the sandboxed Python tool's schema, a toolbox over several tools, argument checks
against the schemas, sessions per episode — with the real bubblewrap sandbox where code runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

from tools.base import FunctionSpec, ToolConfigError, ToolResult, code_function_spec
from tools.fakes import EchoTool
from tools.functions import Toolbox
from tools.registry import build_tool
from tools.sandbox.local_sandbox import LocalPythonSandbox
from tools.sandbox_fusion.client import SandboxFusionTool


class _Lookup:
    """A function tool offering `lookup(key: string)` (control logic only: the MCP tool is the real one)."""

    name: ClassVar[str] = "lookup_fake"

    def __init__(self, specs: tuple[FunctionSpec, ...] | None = None) -> None:
        self._specs = specs or (FunctionSpec(name="lookup", parameters={
            "type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}),)

    def functions(self) -> tuple[FunctionSpec, ...]:
        return self._specs

    async def call_function(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        return ToolResult(status="ok", stdout=f"{name}:{arguments['key']}")

    def session(self) -> Any:
        raise AssertionError("no sessions in this test")


def test_the_python_tool_is_one_function_taking_its_code_as_a_string() -> None:
    spec = code_function_spec(LocalPythonSandbox)
    assert spec.name == "python"
    assert spec.parameters == {"type": "object", "properties": {"code": {
        "type": "string", "description": "The python code to run."}}, "required": ["code"],
        "additionalProperties": False}
    assert spec.as_template_tool()["function"]["name"] == "python"
    assert code_function_spec(SandboxFusionTool).name == "sandbox_fusion"


def test_a_toolbox_joins_the_tools_functions_in_order_and_checks_calls() -> None:
    toolbox = Toolbox([EchoTool(), _Lookup()])
    assert [spec.name for spec in toolbox.specs] == ["echo", "lookup"]
    assert [t["function"]["name"] for t in toolbox.template_tools()] == ["echo", "lookup"]
    assert toolbox.problem("lookup", {"key": "a"}) is None
    assert toolbox.problem("search", {}) == ("unknown", "unknown tool 'search'; the tools are: echo, lookup")
    kind, message = toolbox.problem("lookup", {"key": 5}) or ("", "")
    assert kind == "invalid_arguments" and "key: 5 is not of type 'string'" in message
    kind, message = toolbox.problem("echo", {"code": "1", "extra": True}) or ("", "")
    assert kind == "invalid_arguments" and "'extra' was unexpected" in message
    kind, message = toolbox.problem("lookup", {}) or ("", "")
    assert "'key' is a required property" in message


def test_two_tools_with_one_function_name_are_refused_with_the_fix() -> None:
    message = r"tools.0 and tools.1 both offer a function named 'echo'.*prefix"
    with pytest.raises(ToolConfigError, match=message):
        Toolbox([EchoTool(), EchoTool()])


def test_a_function_with_an_invalid_schema_is_refused_naming_it() -> None:
    bad = (FunctionSpec(name="lookup", parameters={"type": "no-such-type"}),)
    with pytest.raises(ToolConfigError, match=r"tools.0: function 'lookup' declares an invalid JSON schema"):
        Toolbox([_Lookup(bad)])


async def test_calls_run_in_the_real_sandbox_and_sessions_keep_state_per_episode() -> None:
    spec = {"type": "python", "timeout_s": 10, "warm_pool_size": 0}
    async with build_tool(spec) as python:
        toolbox = Toolbox([python, _Lookup()])
        async with toolbox.episode(preamble="import math\n") as episode:
            results = await episode.run([("python", {"code": "print(math.sqrt(49))"}),
                                         ("lookup", {"key": "k"})])
        assert [r.stdout for r in results] == ["7.0\n", "lookup:k"]
        async with toolbox.episode(use_session=True) as episode:  # one interpreter for the episode
            await episode.run([("python", {"code": "x = 41"})])
            (result,) = await episode.run([("python", {"code": "print(x + 1)"})])
        assert result.stdout == "42\n"
        async with toolbox.episode(use_session=True) as episode:  # a new episode starts afresh
            (result,) = await episode.run([("python", {"code": "print(x)"})])
        assert result.status == "error" and "NameError" in result.stderr
