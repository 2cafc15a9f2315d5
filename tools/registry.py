"""Building a tool from a config spec such as `{"type": "python", "timeout_s": 5}`.

`type` is one of:
* a built-in name (`BUILTIN_TOOLS`: python, sandbox_fusion, e2b, mcp, echo);
* the name of an entry point in group `vcpo.tools` of any installed distribution, e.g. in its
  pyproject: `[project.entry-points."vcpo.tools"]  my_tool = "my_pkg.tools:MyTool"`;
* an import path `package.module:Class`.

The class must have `settings_model` (a pydantic model, ideally `extra="forbid"`) and a
constructor that takes one validated instance of it; it may declare `code_fence` (tools/base.py),
which is checked here too. The other keys of the spec are validated against that model; errors
name the field, the value given and the fix.

Nothing is imported or discovered at import time of this module: entry points are read when a
spec is resolved, so installing a plug-in needs no restart of anything but the process.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from importlib.metadata import entry_points
from types import MappingProxyType
from typing import Any

from pydantic import BaseModel, ValidationError

from tools.base import Tool, ToolConfigError, code_fence_of

ENTRY_POINT_GROUP = "vcpo.tools"

BUILTIN_TOOLS: Mapping[str, str] = MappingProxyType(
    {
        "python": "tools.sandbox.local_sandbox:LocalPythonSandbox",
        "sandbox_fusion": "tools.sandbox_fusion.client:SandboxFusionTool",
        "e2b": "tools.e2b:E2BTool",
        "mcp": "tools.mcp_tool:MCPTool",
        "echo": "tools.fakes:EchoTool",
    }
)

_PLUGIN_HINT = (
    f"To add a plug-in tool, register an entry point in group '{ENTRY_POINT_GROUP}' "
    f'(pyproject.toml: [project.entry-points."{ENTRY_POINT_GROUP}"] my_tool = "my_pkg.module:MyTool") '
    "or give its import path as type: 'my_pkg.module:MyTool'."
)


def known_tools() -> dict[str, str]:
    """Every name `type` can take (built-ins and installed entry points) -> its import path."""
    found = dict(BUILTIN_TOOLS)
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry_point.name, entry_point.value)
    return found


def resolve_tool_class(tool_type: str) -> type:
    """The class a `type` value names. Raises ToolConfigError listing the known names."""
    target = known_tools().get(tool_type)
    if target is None and ":" in tool_type:
        target = tool_type
    if target is None:
        names = ", ".join(sorted(known_tools()))
        raise ToolConfigError(f"unknown tool type {tool_type!r}; known: {names}. {_PLUGIN_HINT}")
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ToolConfigError(
            f"tool type {tool_type!r}: cannot import module {module_name!r}: {error}"
        ) from error
    tool_class = getattr(module, attribute, None)
    if not isinstance(tool_class, type):
        raise ToolConfigError(f"tool type {tool_type!r}: module {module_name!r} has no class {attribute!r}")
    if not (
        isinstance(getattr(tool_class, "settings_model", None), type)
        and issubclass(tool_class.settings_model, BaseModel)
    ):
        raise ToolConfigError(
            f"tool type {tool_type!r}: {target} has no `settings_model` (a pydantic model class); "
            "add one so its settings can be validated"
        )
    try:  # a bad `code_fence` fails here, at config time, not in the first episode
        code_fence_of(tool_class)
    except ToolConfigError as error:
        raise ToolConfigError(f"tool type {tool_type!r}: {error}") from None
    return tool_class


def validate_tool_settings(spec: Mapping[str, Any]) -> tuple[type, BaseModel]:
    """Resolve `spec["type"]` and validate the rest of the spec, without building the tool."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("type"), str):
        names = ", ".join(sorted(known_tools()))
        raise ToolConfigError(
            f"a tool spec must be a mapping with a string `type` "
            f"(one of: {names}, or 'package.module:Class'); "
            f"got {spec!r}"
        )
    tool_type = spec["type"]
    tool_class = resolve_tool_class(tool_type)
    model: type[BaseModel] = tool_class.settings_model
    values = {key: value for key, value in spec.items() if key != "type"}
    try:
        settings = model.model_validate(values)
    except ValidationError as error:
        raise ToolConfigError(describe_validation_error(tool_type, model, error)) from None
    return tool_class, settings


def build_tool(spec: Mapping[str, Any]) -> Tool:
    """The tool a spec describes, not yet started: use it as `async with build_tool(spec) as tool`."""
    tool_class, settings = validate_tool_settings(spec)
    return tool_class(settings)


def describe_validation_error(tool_type: str, model: type[BaseModel], error: ValidationError) -> str:
    """One line per problem: the field, the value given, what is wrong and how to fix it."""
    lines = [f"invalid settings for tool type {tool_type!r} ({len(error.errors())} problem(s)):"]
    for problem in error.errors():
        location = ".".join(str(part) for part in problem["loc"]) or "(settings)"
        if problem["type"] == "extra_forbidden":
            valid = ", ".join(name for name in _fields_at(model, problem["loc"][:-1]) if name != "type")
            fix = f"remove it or correct the spelling; valid fields: {valid}"
            value = f" = {problem['input']!r}"
        elif problem["type"] == "missing":
            fix, value = f"add it ({_field_doc(model, problem['loc']) or 'required'})", ""
        else:
            doc = _field_doc(model, problem["loc"])
            fix = f"use a valid value; the field is: {doc}" if doc else "use a valid value"
            value = f" = {problem['input']!r}"
        lines.append(f"  - {location}{value}: {problem['msg']}. Fix: {fix}")
    return "\n".join(lines)


def _walk(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The nested settings model at `loc` (for errors inside a sub-model), if there is one."""
    current: type[BaseModel] | None = model
    for part in loc:
        field = current.model_fields.get(str(part)) if current is not None else None
        annotation = field.annotation if field is not None else None
        current = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return current


def _fields_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    nested = _walk(model, loc)
    return list(nested.model_fields) if nested is not None else []


def _field_doc(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    if not loc:
        return ""
    nested = _walk(model, loc[:-1])
    field = nested.model_fields.get(str(loc[-1])) if nested is not None else None
    return " ".join((field.description or "").split()) if field is not None else ""
