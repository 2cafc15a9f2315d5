"""A tool's optional `code_fence` declaration: read with a default, checked when a spec resolves."""

from __future__ import annotations

from typing import ClassVar

import pytest

from tools.base import DEFAULT_CODE_FENCE, ToolConfigError, code_fence_of
from tools.fakes import EchoTool
from tools.registry import build_tool, resolve_tool_class
from tools.sandbox.local_sandbox import LocalPythonSandbox


class SqlEcho(EchoTool):
    code_fence: ClassVar[str] = "sql"


class SpacedFence(EchoTool):
    code_fence: ClassVar[str] = "my sql"  # two words: no model writes ```my sql


def test_tools_without_a_declaration_read_python_blocks() -> None:
    assert DEFAULT_CODE_FENCE == "python"
    assert code_fence_of(LocalPythonSandbox) == code_fence_of(EchoTool()) == "python"


def test_a_declared_fence_is_read_from_the_class_or_an_instance() -> None:
    assert code_fence_of(SqlEcho) == code_fence_of(SqlEcho()) == "sql"
    assert code_fence_of(build_tool({"type": f"{__name__}:SqlEcho"})) == "sql"


def test_a_bad_declaration_fails_when_the_spec_resolves_naming_the_class_and_the_fix() -> None:
    with pytest.raises(ToolConfigError) as error:
        resolve_tool_class(f"{__name__}:SpacedFence")
    message = str(error.value)
    assert f"tool type '{__name__}:SpacedFence'" in message
    assert "SpacedFence.code_fence = 'my sql' is not a fence language tag" in message
    assert "code_fence = 'sql'" in message  # the fix
