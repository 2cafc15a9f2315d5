"""A tool's fence language: which fenced block the loop runs, stops at and hands to the tool.

Tools without a `code_fence` declaration get exactly the python behaviour of before (the python
regex below is the one the loop always used); a tool declaring `code_fence = "sql"` gets
```` ```sql ```` blocks and nothing else. The real-engine, real-sandbox episodes of a SQL tool are in
tests/examples/test_tool_plugin.py.
"""

from __future__ import annotations

import re
from typing import ClassVar

from agent_env.loop import EpisodeSettings, run_episode
from agent_env.turns import (
    CLOSING_FENCE_STOPS,
    CODE_BLOCK,
    PYTHON_FENCE,
    code_fence,
    decide_turn,
    turn_needs_more,
)
from rollout.fakes import ScriptedEngine, ScriptedReply
from rollout.tiny import build_byte_tokenizer
from rollout.types import GenerationRequest
from tools.base import ToolCall, ToolResult
from tools.fakes import EchoTool, ScriptedTool


class SqlEchoTool(EchoTool):
    """The echo fake, reading ```sql blocks."""

    code_fence: ClassVar[str] = "sql"


class SqlScriptedTool(ScriptedTool):
    code_fence: ClassVar[str] = "sql"


def _scripted(texts: list[str]) -> tuple[object, ScriptedEngine]:
    tokenizer = build_byte_tokenizer()
    replies = iter(texts)

    def script(request: GenerationRequest) -> ScriptedReply:
        ids = tokenizer.encode(next(replies), add_special_tokens=False)
        return ScriptedReply([*ids, tokenizer.eos_token_id])

    return tokenizer, ScriptedEngine(script, eos_token_id=tokenizer.eos_token_id, decode=tokenizer.decode)


def _answer_is_3(text: str) -> object:
    class Score:
        score = float("\\boxed{3}" in text)

    return Score()


def test_the_python_fence_is_the_regex_and_stops_the_loop_always_used() -> None:
    assert CODE_BLOCK is PYTHON_FENCE.block
    assert CODE_BLOCK.pattern == r"```(?:python|py)[ \t]*\n(.*?)\n?```" and CODE_BLOCK.flags & re.DOTALL
    assert PYTHON_FENCE.stops == CLOSING_FENCE_STOPS == ("```\n",)


def test_a_sql_fence_reads_sql_blocks_only() -> None:
    sql = code_fence("sql")
    text = "```python\nprint(1)\n```\nno: ```sql\nSELECT 1\n```\n"
    assert decide_turn(text, "boxed", sql).code == "SELECT 1"
    assert decide_turn(text, "boxed").code == "print(1)"  # the default fence is python's
    assert decide_turn("```python\nprint(1)\n```\n", "boxed", sql).kind == "void"
    assert decide_turn("```sqlite\nSELECT 1\n```\n", "boxed", sql).kind == "void"  # another tag
    assert turn_needs_more("look:\n```\n", sql) and not turn_needs_more("```sql\nSELECT 1\n```\n", sql)
    assert turn_needs_more("```sql\nSELECT 1\n```\n")  # for python, a stop there closed no block
    assert code_fence("c++").block.search("```c++\nint x;\n```").group(1) == "int x;"  # tags are escaped


async def test_the_loop_hands_a_sql_tool_its_blocks_and_stops_at_their_closing_fence() -> None:
    tokenizer, engine = _scripted(["Count:\n```sql\nSELECT 1 + 2\n```\n", "So \\boxed{3}."])
    tool = SqlScriptedTool([ToolResult(status="ok", stdout="3\n")])
    async with engine:
        episode = await run_episode(engine, tokenizer, [1, 2], EpisodeSettings(), _answer_is_3, tool=tool,
                                    trajectory_id="e", group_id="g")
    assert [call.code for call in tool.calls] == ["SELECT 1 + 2"]
    assert all(request.sampling.stop == ("```\n",) for request in engine.requests)
    assert episode.turns[0].observation == "\n```output\n3\n```\n" and episode.trajectory.reward == 1.0
    assert (episode.trajectory.task.tool_calls, episode.trajectory.task.turns) == (1, 2)


async def test_a_python_block_does_not_end_the_turn_of_a_sql_tool() -> None:
    """The closing fence of a python block stops generation, but it closed no sql block, so the same
    turn goes on (a second request); without a sql block or an answer the turn is void."""
    tokenizer, engine = _scripted(["```python\nprint(3)\n```\n", "I give up."])
    async with engine, SqlEchoTool() as tool:
        episode = await run_episode(engine, tokenizer, [1, 2], EpisodeSettings(), _answer_is_3, tool=tool,
                                    trajectory_id="e", group_id="g")
    assert len(engine.requests) == 2 and episode.trajectory.task.turns == 1
    assert episode.trajectory.task.tool_calls == 0 and episode.trajectory.task.void_turns == 1


async def test_a_tool_without_a_declaration_gets_python_blocks() -> None:
    # the sql block's closing fence stops generation but closes no python block: the turn goes on
    tokenizer, engine = _scripted(["```sql\nSELECT 3\n```\n", "```python\nprint(3)\n```\n", "\\boxed{3}"])
    tool = ScriptedTool([ToolResult(status="ok", stdout="3\n")])
    async with engine:
        await run_episode(engine, tokenizer, [1, 2], EpisodeSettings(), _answer_is_3, tool=tool,
                          trajectory_id="e", group_id="g")
    assert tool.calls == [ToolCall(code="print(3)")]
