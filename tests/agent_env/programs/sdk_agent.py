"""Agent programs for the tests: a plain `openai`-SDK loop, as a user writes one. Test support only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import openai

CRASH_MARKER = "VCPO_TEST_PROGRAM_CRASH_ONCE"


async def two_calls(base_url: str, sample: Any) -> None:
    """Ask, then ask again with the answer in the history; the last reply is scored by the task's reward.
    With $VCPO_TEST_PROGRAM_CRASH_ONCE naming a file that does not exist yet, the first run creates it and
    raises (a program that crashes once)."""
    marker = os.environ.get(CRASH_MARKER)
    if marker and not Path(marker).exists():
        Path(marker).write_text("crashed")
        raise RuntimeError("the agent program crashed on purpose")
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Make {sample.fields['target']}."}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Check it."}]
    await client.chat.completions.create(model="policy", messages=messages)


async def ask_once(base_url: str, sample: Any) -> None:
    """One call: the task's question under a fixed system prompt ("Use python.", the memorised model's);
    the reply is scored by the task's reward."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "Use python."},
                {"role": "user", "content": str(sample.fields["question"])}]
    await client.chat.completions.create(model="policy", messages=messages)
