"""Reading structured tool calls out of a model turn (`loop.tool_format: function_call`), no I/O.

A `ToolCallParser` turns a turn's text into `ParsedCall`s; one that cannot be read (bad JSON, no
name, arguments that are not an object, an unclosed tag) is still returned, with `error` set, so the
model is told what was wrong and the run counts it instead of stopping. Text inside a reasoning block
(`<think>…</think>`) is never parsed: `visible_text` removes it first.

Built-in parsers (`PARSERS`): `hermes`, the `<tool_call>{"name": …, "arguments": …}</tool_call>`
blocks of Hermes, Qwen2.5/Qwen3 and SmolLM3 templates. A task may name its own as
`package.module:Class` (a class with `parse(text) -> list[ParsedCall]`, built without arguments).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

REASONING_OPEN, REASONING_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ParsedCall:
    """One call the model wrote: a name and an arguments object, or the reason it could not be read."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the call could not be read (the model sees it); None for a well-formed call."""
    raw: str = ""
    """The call as written, for logs."""


@runtime_checkable
class ToolCallParser(Protocol):
    """Reads the calls of one turn's visible text (reasoning already removed)."""

    name: ClassVar[str]

    def parse(self, text: str) -> list[ParsedCall]: ...


class ParserConfigError(ValueError):
    """A task names a parser that does not exist or cannot be built."""


def visible_text(text: str, opening: str = REASONING_OPEN, closing: str = REASONING_CLOSE) -> str:
    """`text` without its reasoning: every `<think>…</think>` block, an unclosed `<think>` to the end,
    and everything before a `</think>` that has no opening tag (templates that open the reasoning block
    in the generation prompt, so the turn starts inside it)."""
    first_close, first_open = text.find(closing), text.find(opening)
    if first_close != -1 and (first_open == -1 or first_close < first_open):
        text = text[first_close + len(closing):]
    parts: list[str] = []
    while (start := text.find(opening)) != -1:
        parts.append(text[:start])
        end = text.find(closing, start + len(opening))
        if end == -1:
            return "".join(parts)
        text = text[end + len(closing):]
    return "".join(parts) + text


def call_from_json(payload: str, raw: str) -> ParsedCall:
    """A call from its JSON object `{"name": str, "arguments": object}` (also accepted: arguments as a
    JSON string holding an object, or under `parameters`, as some models write them)."""
    try:
        value = json.loads(payload)
    except json.JSONDecodeError as exc:
        return ParsedCall("", error=f"the call is not valid JSON ({exc.msg} at character {exc.pos}); write "
                          '{"name": "<tool>", "arguments": {...}}', raw=raw)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ParsedCall("", error='the call has no "name" string; write {"name": "<tool>", "arguments": '
                          "{...}}", raw=raw)
    name = value["name"]
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # not JSON: refused as not an object below
            arguments = json.loads(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return ParsedCall(name, error=f'the "arguments" of {name!r} are not a JSON object', raw=raw)
    return ParsedCall(name, arguments, raw=raw)


class HermesParser:
    """`<tool_call>` + one JSON object + `</tool_call>`, any number per turn (Hermes, Qwen, SmolLM3)."""

    name: ClassVar[str] = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> list[ParsedCall]:
        calls = []
        for match in self._BLOCK.finditer(text):
            body, closed = match.group(1).strip(), bool(match.group(2))
            if not closed:
                calls.append(ParsedCall("", error=f"a {self.OPEN} was not closed by {self.CLOSE}",
                                        raw=match.group(0)))
            else:
                calls.append(call_from_json(body, match.group(0)))
        return calls


PARSERS: dict[str, type] = {"hermes": HermesParser}


@functools.cache
def resolve_parser(spec: str) -> ToolCallParser:
    """The parser `loop.tool_parser` names: a built-in name or `package.module:Class`."""
    target: Any = PARSERS.get(spec)
    if target is None:
        module_name, _, attribute = spec.partition(":")
        if not attribute:
            raise ParserConfigError(f"unknown tool parser {spec!r}; built-in: {', '.join(sorted(PARSERS))}, "
                                    "or give an import path 'package.module:Class'")
        try:
            target = getattr(importlib.import_module(module_name), attribute, None)
        except ImportError as exc:
            raise ParserConfigError(f"tool parser {spec!r}: cannot import {module_name!r}: {exc}") from None
        if not isinstance(target, type):
            raise ParserConfigError(f"tool parser {spec!r}: {module_name!r} has no class {attribute!r}")
    parser = target()
    if not callable(getattr(parser, "parse", None)):
        raise ParserConfigError(f"tool parser {spec!r} has no parse(text) method")
    return parser
