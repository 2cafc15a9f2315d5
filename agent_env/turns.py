"""What one model turn asks for, decided from its text alone (no I/O): run code, answer, or neither.

SimpleTIR-style turns (docs/agent_loop.md): the model writes reasoning and at most one fenced
```` ```python ```` block per turn; generation stops at the block's closing fence. The fence
language is the tool's (`CodeFence`: python unless the tool declares `code_fence`, e.g. ```` ```sql ````
for a SQL tool). A turn
* with a complete block in that language asks for a tool call (the first complete block —
  generation stopped at its closing fence, so there is at most one);
* else with a final answer (the task's answer pattern, e.g. the last `\\boxed{...}`) ends the episode;
* else is a *void turn* (counted; `mask_void_turns` may drop the trajectory from the loss).

Also the observation text the model sees after a tool call. Tokenisation and execution live in
`agent_env/loop.py`; this module is pure so the decisions can be tested without engines or sandboxes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from tools.base import ToolResult

CLOSING_FENCE_STOPS = ("```\n",)
"""Stop strings that end a turn at a closing fence. An opening fence with a language tag
(```` ```python ````, ```` ```sql ````) never contains them; a bare ```` ``` ```` line can, so a stop
without a complete block just continues the turn (`turn_needs_more`)."""

_FENCE_ALIASES = {"python": ("python", "py")}
"""Tags that open a block of a fence language besides its own name (models write ```` ```py ```` too)."""


@dataclass(frozen=True)
class CodeFence:
    """The fenced block that asks for a tool call: its language tag, the regex of a complete block
    (group 1 is the code) and the stop strings that end a turn at its closing fence. Build it with
    `code_fence(language)`."""

    language: str
    block: re.Pattern[str]
    stops: tuple[str, ...] = CLOSING_FENCE_STOPS
    """The same for every language: a closing fence is a bare ```` ``` ````."""


def code_fence(language: str) -> CodeFence:
    """The fence of a tool that reads `language` blocks (`tools.base.code_fence_of(tool)`)."""
    tags = "|".join(re.escape(tag) for tag in _FENCE_ALIASES.get(language, (language,)))
    return CodeFence(language, re.compile(rf"```(?:{tags})[ \t]*\n(.*?)\n?```", re.DOTALL))


PYTHON_FENCE = code_fence("python")
"""The default fence: ```` ```python ```` or ```` ```py ```` blocks (every built-in tool)."""

CODE_BLOCK = PYTHON_FENCE.block
"""A complete fenced python block; group 1 is the code."""

TRUNCATION_MARKER = "…[truncated]"


@dataclass(frozen=True)
class TurnDecision:
    """kind: `tool_call` (code to run), `answer` (final answer found, episode ends) or `void`."""

    kind: Literal["tool_call", "answer", "void"]
    code: str | None = None
    answer: str | None = None


def find_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    while start != -1:
        depth, index = 0, start + len("\\boxed")
        for index in range(start + len("\\boxed"), len(text)):
            char = text[index]
            depth += (char == "{") - (char == "}")
            if depth == 0:
                return text[start + len("\\boxed{") : index]
        start = text.rfind("\\boxed{", 0, start)  # unbalanced: try an earlier one
    return None


def find_answer(text: str, pattern: str) -> str | None:
    """The final answer: `pattern="boxed"` → last `\\boxed{}`, else the regex's group 1 (last match)."""
    if pattern == "boxed":
        return find_boxed(text)
    matches = re.findall(pattern, text, flags=re.DOTALL)
    return matches[-1] if matches else None


def decide_turn(text: str, answer_pattern: str, fence: CodeFence = PYTHON_FENCE) -> TurnDecision:
    """What the turn `text` asks for (see the module docstring); code blocks are `fence`'s."""
    block = fence.block.search(text)
    if block is not None:
        return TurnDecision("tool_call", code=block.group(1))
    answer = find_answer(text, answer_pattern)
    if answer is not None:
        return TurnDecision("answer", answer=answer)
    return TurnDecision("void")


def turn_needs_more(text: str, fence: CodeFence = PYTHON_FENCE) -> bool:
    """True when a stop string fired on a fence that did not close a block of `fence`'s language
    (e.g. an opening bare ```` ``` ````): the turn goes on."""
    return fence.block.search(text) is None and text.rstrip().endswith("```")


def _truncate(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + TRUNCATION_MARKER


def observation_body(result: ToolResult, max_chars: int) -> str:
    """What the model learns from one execution: stdout; on error the exception line; on a limit one line."""
    if result.status in ("timeout", "memory"):
        return result.message or f"Execution stopped: {result.status} limit reached."
    if result.status == "error":
        lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
        detail = lines[-1] if lines else (result.message or f"exit code {result.exit_code}")
        if not result.stdout:
            return _truncate(detail, max_chars)
        head = _truncate(result.stdout.rstrip("\n"), max_chars // 2)
        return head + "\n" + _truncate(detail, max_chars // 2)
    if result.is_session_reset and result.message:  # answered, but on a fresh session: say so
        return _truncate(result.message + "\n" + result.stdout, max_chars)
    return _truncate(result.stdout, max_chars)


def format_observation(body: str, style: Literal["markdown", "simpletir"]) -> str:
    """The appended observation text: ```` ```output ```` block, or SimpleTIR's one-liner."""
    if style == "simpletir":
        return f"\nCode execution result: {body}\n"
    return f"\n```output\n{body.rstrip(chr(10))}\n```\n"
