"""The protocol's data types and the in-tree fakes."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from tools._output import cap_text, decode_capped, last_line
from tools.base import Tool, ToolCall, ToolResult, ToolSession
from tools.fakes import EchoTool, EchoToolSettings, ScriptedTool


def test_call_and_result_are_frozen_and_reject_unknown_fields() -> None:
    call = ToolCall(code="print(1)")
    with pytest.raises(ValidationError):
        call.code = "x"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="Extra inputs"):
        ToolCall(code="x", timeout=3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="greater than 0"):
        ToolCall(code="x", timeout_s=0)
    with pytest.raises(ValidationError, match="'ok', 'error', 'timeout', 'memory' or 'output_truncated'"):
        ToolResult(status="crashed")  # type: ignore[arg-type]


def test_result_with_binary_files_round_trips_through_json() -> None:
    result = ToolResult(status="ok", stdout="é", files={"a.bin": b"\x00\xff"}, exit_code=0)
    assert ToolResult.model_validate_json(result.model_dump_json()) == result


@pytest.mark.parametrize(("status", "is_ok"), [("ok", True), ("output_truncated", True), ("error", False)])
def test_is_ok_counts_truncated_output_as_a_successful_run(status: str, is_ok: bool) -> None:
    assert ToolResult(status=status).is_ok is is_ok  # type: ignore[arg-type]


def test_truncation_marker_counts_bytes() -> None:
    # 10 bytes written, 4 kept: the marker says so.
    assert decode_capped(b"abcd", 10) == "abcd\n[output truncated: showing the first 4 of 10 bytes]\n"
    assert decode_capped(b"abcd", 4) == "abcd"
    text, is_cut = cap_text("héllo", 3)  # 'h' + 2-byte 'é' = 3 bytes of 6
    assert is_cut and text.startswith("hé\n[output truncated: showing the first 3 of 6 bytes]")


def test_last_line_is_the_exception_line() -> None:
    assert last_line("Traceback (most recent call last):\n  ...\nKeyError: 'x'\n\n") == "KeyError: 'x'"


async def test_echo_tool_implements_the_protocol() -> None:
    async with EchoTool() as tool, tool.session() as session:
        assert isinstance(tool, Tool) and isinstance(session, ToolSession)
        result = await session.run(ToolCall(code="print(1)"))
    assert (result.status, result.stdout) == ("ok", "print(1)")


async def test_scripted_tool_replays_results_and_records_calls() -> None:
    scripted = [ToolResult(status="timeout", message="Timed out"), ToolResult(status="ok", stdout="2\n")]
    tool = ScriptedTool(scripted, delay_s=0.01)
    first = await tool.run(ToolCall(code="a"))
    second = await tool.run(ToolCall(code="b"))
    assert [first, second] == scripted and [call.code for call in tool.calls] == ["a", "b"]
    with pytest.raises(IndexError, match="call #3 but was scripted with 2"):
        await tool.run(ToolCall(code="c"))


async def test_a_slow_fake_can_be_cancelled() -> None:
    task = asyncio.create_task(EchoTool(EchoToolSettings(delay_s=10)).run(ToolCall(code="x")))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
