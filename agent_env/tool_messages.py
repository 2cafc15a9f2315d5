"""Tool results as the chat template's own tool messages, appended as tokens (function calling).

Token-in/token-out means the episode's ids are never re-rendered: after a turn that called tools, the
loop appends only what the template would put between the end of the model's text and the next
assistant turn — the end-of-turn marker the model did not sample, the tool messages, the generation
prompt. `ToolMessageRenderer` finds that text by rendering a short conversation whose assistant content
is a marker string and taking everything after the marker; the end-of-turn token the model sampled
(its EOS) is not repeated. Those appended tokens are context (loss mask 0); what the model sampled is
kept as sampled.

`check_tools_template` refuses, at set-up, a template that ignores `tools=` (the model would never see
the schemas) or does not render tool messages. Templates that need each tool message to answer a
`tool_call_id` of the assistant message (Mistral's) are not supported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_MARKER = "VCPO_ASSISTANT_TURN_MARKER"
"""Stands for the model's turn in the rendered conversation; only the text after it is used."""


class ToolTemplateError(ValueError):
    """The chat template cannot carry function calling (ignores `tools=`, drops tool messages)."""


def tool_message(name: str, content: str) -> dict[str, Any]:
    """One result as a chat message (`role: tool`, the function's name, the text the model sees)."""
    return {"role": "tool", "name": name, "content": content}


class ToolMessageRenderer:
    """The token ids to append after a turn for `messages` (the turn's tool results)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, tools: Sequence[dict[str, Any]]) -> None:
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self._special_ids = set(getattr(tokenizer, "all_special_ids", ()) or ())

    def suffix_text(self, messages: Sequence[dict[str, Any]]) -> str:
        """What the template writes after the assistant's content: end of turn, `messages`, the next
        assistant turn's opening."""
        conversation = [{"role": "user", "content": "-"}, {"role": "assistant", "content": _MARKER},
                        *messages]
        text = self.tokenizer.apply_chat_template(conversation, tools=self.tools or None, tokenize=False,
                                                  add_generation_prompt=True)
        at = text.rfind(_MARKER)
        if at == -1:
            raise ToolTemplateError("the chat template drops the assistant's content of a turn before tool "
                                    "messages; set prompt.chat_template to a template that keeps it")
        return text[at + len(_MARKER):]

    def ids(self, messages: Sequence[dict[str, Any]], last_sampled: int | None) -> list[int]:
        """Ids to append after a turn whose last sampled token is `last_sampled`: the template's text
        after the turn, less the end-of-turn token when the model sampled it (its EOS)."""
        suffix = self.suffix_text(messages)
        if last_sampled is not None and last_sampled in self._special_ids:
            sampled = self.tokenizer.decode([last_sampled], skip_special_tokens=False)
            if sampled and suffix.startswith(sampled):
                suffix = suffix[len(sampled):]
        return list(self.tokenizer.encode(suffix, add_special_tokens=False))


def check_tools_template(tokenizer: PreTrainedTokenizerBase, tools: Sequence[dict[str, Any]]) -> None:
    """Raise ToolTemplateError, saying what to do, when the tokenizer's chat template cannot carry
    function calling for `tools` (see the module docstring)."""
    conversation = [{"role": "user", "content": "-"}]
    try:
        with_tools = tokenizer.apply_chat_template(conversation, tools=list(tools), tokenize=False,
                                                   add_generation_prompt=True)
        without = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        probe = ToolMessageRenderer(tokenizer, tools).suffix_text([tool_message("probe", "PROBE-RESULT")])
    except ToolTemplateError:
        raise
    except Exception as exc:  # jinja's raise_exception, a missing variable: the template's own words
        raise ToolTemplateError(f"the chat template fails on tools or tool messages ({type(exc).__name__}: "
                                f"{exc}); set prompt.chat_template to a template with tool support") from None
    fix = ("use a model whose chat template supports tools (Qwen2.5/Qwen3, Llama 3.1+, SmolLM3, Hermes), or "
           "set prompt.chat_template to a Jinja file that does (examples/mcp_tool/hermes_tools.jinja)")
    if with_tools == without:
        raise ToolTemplateError(f"the model's chat template ignores tools=, so the model would never see "
                                f"the tools' schemas; {fix}")
    if "PROBE-RESULT" not in probe:
        raise ToolTemplateError(f"the model's chat template does not render tool messages; {fix}")
