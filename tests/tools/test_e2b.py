"""The E2B adapter: result mapping on E2B's own result types, the missing-package error, and a
live test that runs only with an API key (E2B is a cloud service)."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from tools.base import ToolCall, ToolUnavailableError
from tools.e2b import E2BTool, execution_to_result
from tools.settings import E2BSettings


@pytest.fixture
def models() -> Any:
    """E2B's own result classes (the mapping is tested on the real types, not look-alikes)."""
    return pytest.importorskip("e2b_code_interpreter.models", reason="pip install 'vcpo[e2b]' for this test")


def _execution(models: Any, stdout: list[str], stderr: list[str], error: Any = None) -> Any:
    return models.Execution(logs=models.Logs(stdout=stdout, stderr=stderr), error=error)


def test_printed_output_maps_to_ok(models: Any) -> None:
    execution = _execution(models, ["4", "2\n"], [])
    result = execution_to_result(execution, wall_time_s=0.5, max_output_bytes=1000)
    assert (result.status, result.stdout, result.exit_code, result.wall_time_s) == ("ok", "42\n", 0, 0.5)


def test_an_exception_maps_to_error_with_its_traceback(models: Any) -> None:
    error = models.ExecutionError("ValueError", "bad", "Traceback ...\nValueError: bad\n")
    result = execution_to_result(
        _execution(models, [], ["warn\n"], error), wall_time_s=0.1, max_output_bytes=1000
    )
    assert (result.status, result.exit_code, result.message) == ("error", 1, "ValueError: bad")
    assert result.stderr == "warn\nTraceback ...\nValueError: bad\n"


def test_memory_error_maps_to_memory(models: Any) -> None:
    error = models.ExecutionError("MemoryError", "", "")
    result = execution_to_result(_execution(models, [], [], error), wall_time_s=0.1, max_output_bytes=1000)
    assert result.status == "memory" and result.stderr == "MemoryError: \n"


def test_long_output_is_truncated_like_the_local_sandbox(models: Any) -> None:
    result = execution_to_result(_execution(models, ["x" * 300], []), wall_time_s=0.1, max_output_bytes=256)
    assert result.status == "output_truncated" and result.is_stdout_truncated
    assert "[output truncated: showing the first 256 of 300 bytes]" in result.stdout


async def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "e2b_code_interpreter", None)  # makes the import fail
    with pytest.raises(ToolUnavailableError, match=r"pip install 'vcpo\[e2b\]'"):
        async with E2BTool(E2BSettings()):
            pass


@pytest.mark.skipif(not os.environ.get("E2B_API_KEY"), reason="E2B_API_KEY not set")
async def test_live_e2b_sandbox_runs_code_and_sessions() -> None:
    async with E2BTool(E2BSettings(timeout_s=30)) as tool:
        result = await tool.run(ToolCall(code="print(6 * 7)"))
        async with tool.session() as session:
            await session.run(ToolCall(code="x = 41"))
            kept = await session.run(ToolCall(code="print(x + 1)"))
    assert (result.status, result.stdout) == ("ok", "42\n")
    assert kept.stdout == "42\n"
