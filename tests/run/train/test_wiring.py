"""`load_task` refuses what a task's schema cannot see, naming the file and the field, before any model
is loaded: here a session asked of a tool that keeps no state between calls. What only a started tool
can tell (the tools an MCP server lists) is refused before the engine starts."""

from __future__ import annotations

from typing import Any

import pytest

from configs.loader import ConfigError
from rollout.tiny import build_byte_tokenizer
from run.train.wiring import load_task, task_runtime

COUNTDOWN = "configs/tasks/countdown.yaml"


def test_a_session_on_a_stateless_tool_is_refused_when_the_task_loads() -> None:
    task, _ = load_task(COUNTDOWN, ["loop.use_session=true"])  # the local sandbox keeps sessions
    assert task.loop.use_session
    stateless = "tool={type: sandbox_fusion, endpoint: 'http://127.0.0.1:8080'}"
    assert load_task(COUNTDOWN, [stateless])[0].tool["type"] == "sandbox_fusion"  # fine without sessions
    with pytest.raises(ConfigError) as info:
        load_task(COUNTDOWN, [stateless, "loop.use_session=true"])
    assert info.value.source.endswith("countdown.yaml")
    assert info.value.problems == [
        "loop.use_session: true, but tool type 'sandbox_fusion' keeps no state between calls; set "
        "loop.use_session: false, or use type: python (the local sandbox) or type: e2b for a stateful "
        "interpreter"]


def test_a_function_tool_in_a_code_fence_task_is_refused_with_the_fix() -> None:
    mcp = "tool={type: mcp, command: python, args: [server.py]}"
    with pytest.raises(ConfigError) as info:
        load_task(COUNTDOWN, [mcp])
    assert info.value.problems == ["tool: tool type 'mcp' offers functions, not a code fence; set "
                                   "loop.tool_format: function_call"]
    task, _ = load_task(COUNTDOWN, [mcp, "loop.tool_format=function_call"])
    assert task.tool_specs()[0]["type"] == "mcp"


async def test_a_tool_its_mcp_server_does_not_list_is_refused_before_the_engine_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Any] = []

    async def start_engine(*args: Any) -> None:
        started.append(args)
        raise AssertionError("the engine started before the tools were checked")

    monkeypatch.setattr("rollout.engines.factory.start_engine", start_engine)
    wrong = ("tools=[{type: mcp, command: python, args: [examples/mcp_tool/server.py], "
             "tools: [stock, search]}]")
    task, path = load_task("examples/mcp_tool/task.yaml", [wrong])
    with pytest.raises(ConfigError) as info:
        async with task_runtime(task, path, model_dir="unused", tokenizer=build_byte_tokenizer(),
                                settings=None, which="train"):
            pass
    assert "does not list tool(s) 'search'" in str(info.value) and not started
