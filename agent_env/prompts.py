"""Prompt rendering: a sample's fields into the task's system/user text, then the model's chat template.

Tokenised exactly once per episode (docs/agent_loop.md step 1); the agent loop never re-tokenises it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_env.samples import Sample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class PromptError(ValueError):
    """A sample lacks a field its task's prompt template uses."""


def render_messages(system: str | None, user: str, sample: Sample) -> list[dict[str, str]]:
    """Chat messages for one sample: the optional system text and the user template filled in."""
    try:
        content = user.format(**sample.fields)
    except (KeyError, IndexError) as exc:
        raise PromptError(f"sample {sample.sample_id!r} has no field {exc} used by prompt.user; fields: "
                          f"{sorted(sample.fields)} (map it in the task's fields.template_fields)") from None
    messages = [{"role": "system", "content": system}] if system else []
    return [*messages, {"role": "user", "content": content}]


def render_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
                      tools: list[dict[str, Any]] | None = None, *,
                      continue_final_message: bool = False) -> list[int]:
    """Token ids of `messages` with the model's chat template and the assistant turn opened; `tools`
    (function calling) are the JSON schemas the template shows the model. `continue_final_message`: the
    last message is an assistant turn left open, to be continued (no new turn is opened)."""
    extra: dict[str, Any] = {"tools": tools} if tools else {}  # no key without tools: renders as before
    if continue_final_message:
        extra["continue_final_message"] = True
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=not continue_final_message,
                                        tokenize=True, **extra)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]
