"""Building tools from specs: built-ins, entry-point plug-ins, import paths, and the errors."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import pytest
import yaml

from tools.base import ToolCall, ToolConfigError
from tools.e2b import E2BTool
from tools.fakes import EchoTool
from tools.registry import BUILTIN_TOOLS, build_tool, known_tools
from tools.sandbox.local_sandbox import LocalPythonSandbox
from tools.sandbox_fusion.client import SandboxFusionTool

SPECS_YAML = """
python:
  type: python
  timeout_s: 5
  memory_limit_mb: 768
  preamble: |
    def final_answer(x):
        print(x)
remote:
  type: sandbox_fusion
  endpoint: http://127.0.0.1:8080
  max_retries: 2
cloud:
  type: e2b
  timeout_s: 20
"""


def test_builtin_specs_from_yaml_build_their_tools_with_validated_settings() -> None:
    specs = yaml.safe_load(SPECS_YAML)
    python, remote, cloud = (build_tool(specs[name]) for name in ("python", "remote", "cloud"))
    assert isinstance(python, LocalPythonSandbox) and python.settings.timeout_s == 5.0
    assert python.settings.preamble.startswith("def final_answer")
    assert isinstance(remote, SandboxFusionTool) and remote.settings.max_retries == 2
    assert isinstance(cloud, E2BTool) and cloud.settings.timeout_s == 20.0
    assert set(BUILTIN_TOOLS) <= set(known_tools())


def test_import_path_type_builds_any_tool_class() -> None:
    tool = build_tool({"type": "tools.fakes:EchoTool", "delay_s": 0.5})
    assert isinstance(tool, EchoTool) and tool.delay_s == 0.5


def test_unknown_type_lists_the_known_ones_and_how_to_register_a_plugin() -> None:
    with pytest.raises(ToolConfigError) as error:
        build_tool({"type": "pythn"})
    message = str(error.value)
    assert "unknown tool type 'pythn'; known: e2b, echo, mcp, python, sandbox_fusion" in message
    assert '[project.entry-points."vcpo.tools"]' in message and "my_pkg.module:MyTool" in message


def test_missing_type_is_explained() -> None:
    with pytest.raises(ToolConfigError, match="must be a mapping with a string `type`"):
        build_tool({"timeout_s": 3})


def test_bad_settings_name_the_field_the_value_and_the_fix() -> None:
    with pytest.raises(ToolConfigError) as error:
        build_tool({"type": "python", "timeout_s": -1, "memory_limt_mb": 512})
    message = str(error.value)
    assert "2 problem(s)" in message
    assert "timeout_s = -1: Input should be greater than 0" in message
    assert "Wall-clock limit per call in seconds" in message  # the field's docstring as the fix
    assert "memory_limt_mb = 512: Extra inputs are not permitted" in message
    assert "valid fields:" in message and "memory_limit_mb" in message


def test_missing_required_setting_says_what_to_add() -> None:
    with pytest.raises(ToolConfigError, match=r"endpoint: Field required\. Fix: add it \(Base URL"):
        build_tool({"type": "sandbox_fusion"})


def test_import_path_to_a_class_without_settings_model_is_refused() -> None:
    with pytest.raises(ToolConfigError, match="has no `settings_model`"):
        build_tool({"type": "tools.fakes:ScriptedTool"})


def test_entry_point_plugin_is_found_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A distribution that declares `[project.entry-points."vcpo.tools"] shout = ...` is usable as
    `type: shout` once installed (here: its metadata and module on sys.path)."""
    (tmp_path / "vcpo_shout_plugin.py").write_text(
        textwrap.dedent(
            """
            from pydantic import BaseModel, ConfigDict
            from tools.fakes import EchoTool
            from tools.base import ToolResult

            class ShoutSettings(BaseModel):
                model_config = ConfigDict(extra="forbid")
                suffix: str = "!"

            class ShoutTool(EchoTool):
                name = "shout"
                settings_model = ShoutSettings

                def __init__(self, settings):
                    super().__init__()
                    self.suffix = settings.suffix

                def _answer(self, call):
                    return ToolResult(status="ok", stdout=call.code.upper() + self.suffix)
            """
        )
    )
    dist_info = tmp_path / "vcpo_shout_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: vcpo-shout-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[vcpo.tools]\nshout = vcpo_shout_plugin:ShoutTool\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert known_tools()["shout"] == "vcpo_shout_plugin:ShoutTool"
    tool = build_tool({"type": "shout", "suffix": "!!"})
    with pytest.raises(ToolConfigError, match="suffx"):
        build_tool({"type": "shout", "suffx": "?"})

    result = asyncio.run(tool.run(ToolCall(code="hi")))
    assert result.stdout == "HI!!"
