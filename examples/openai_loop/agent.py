"""The main job's Countdown agent as a plain `openai`-SDK loop: the same episode as vcpo's built-in loop,
written as a user writes an agent.

The loop is the program's own: ask the model; if its turn ends with a complete ```python block, run it in the
bubblewrap sandbox and put the output into the same assistant turn; ask again, continuing that turn; stop
at an answer, a turn without code, the turn limit or the token budget. The text it shows the model is what
the built-in loop shows (the task's prompt, the ```output block), so the default run's warm start teaches
this agent too and the two can be compared on the same seeds and budget (examples/openai_loop/README.md).

Two requests of vLLM's OpenAI server that vcpo's endpoint speaks too: `include_stop_str_in_output` (the
closing fence comes back with the text) and `continue_final_message` with `add_generation_prompt: false`
(the next call continues the assistant's turn instead of opening a new one). With them the program sends
back exactly what it was given, and each call's context extends the last: the episode stays one segment
where the tokenizer reads the joined text as it was sampled (where it does not, a new segment starts: still
exact, at the cost of repeating the context).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai

from agent_env.prompts import render_messages
from agent_env.turns import PYTHON_FENCE, decide_turn, format_observation, observation_body, turn_needs_more
from configs.task_schema import load_task_config
from tools.base import ToolCall
from tools.registry import build_tool

TASK = load_task_config(Path(__file__).resolve().parents[2] / "configs" / "tasks" / "countdown.yaml")
"""The task's prompt, tool and answer format: the built-in loop's, so the model reads the same text."""
MAX_TURNS = 2
"""Model turns an episode may take: one tool call, then the answer (the default run's loop.max_turns)."""
MAX_CONTINUATIONS = 4
"""Calls one turn may take when the model stopped on a fence that did not close a code block."""
MAX_OBSERVATION_CHARS = 512


async def _ask(client: openai.AsyncOpenAI, messages: list[dict[str, Any]], turn: str) -> tuple[str, str]:
    """(text, finish reason) of one call: a new assistant turn, or the open `turn` continued."""
    continuing = {"continue_final_message": True, "add_generation_prompt": False} if turn else {}
    history = [*messages, {"role": "assistant", "content": turn}] if turn else messages
    reply = await client.chat.completions.create(
        model="policy", messages=history, stop=list(PYTHON_FENCE.stops),
        extra_body={"include_stop_str_in_output": True, **continuing})
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason


async def solve(base_url: str, sample: Any) -> str:
    """One episode; returns the assistant's whole turn, which the task's reward scores (its boxed answer)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = render_messages(TASK.prompt.system, TASK.prompt.user, sample)
    turn = ""  # the assistant's open turn: everything it wrote, and the outputs of its code
    async with build_tool(TASK.tool_specs()[0]) as sandbox:
        for index in range(MAX_TURNS):
            written = ""
            try:
                for _ in range(MAX_CONTINUATIONS):
                    text, finish = await _ask(client, messages, turn + written)
                    written += text
                    if not (finish == "stop" and turn_needs_more(written)):
                        break
            except openai.BadRequestError as exc:
                if getattr(exc, "code", None) != "context_length_exceeded":
                    raise
                return turn + written  # the episode's token budget is spent: scored as it stands
            turn += written
            decision = decide_turn(written, TASK.answer.pattern)
            if decision.kind != "tool_call" or finish == "length" or index == MAX_TURNS - 1:
                break
            result = await sandbox.run(ToolCall(code=decision.code or ""))
            turn += format_observation(observation_body(result, MAX_OBSERVATION_CHARS), "markdown")
    return turn
