"""What the model reads at each turn when the context is managed, not only appended (`loop.context`).

The plain loop appends: every turn's context is the previous context plus the turn and its observation,
so an episode is one growing token sequence. A long-horizon agent, or a thinking model served the way it
is deployed, reads something else:

* `think: strip` — earlier turns' reasoning (`<think>…</think>`) is removed before the next turn, as
  chat templates such as Qwen3's drop it when the history is rendered again; the reasoning still trains
  where it was sampled, and the context stops growing by it;
* `compaction: keep_last` — once the context passes `compact_at_tokens`, only the prompt and the last
  `keep_last_turns` turns (each with its observation) stay;
* `compaction: summarize` — at the same point the policy is asked (`summary_request`, appended to the
  context it has read) to write a summary of its work; the summary is sampled and trained with the
  episode's reward where it was written, and the next context is the prompt, the summary (after
  `summary_prefix`) and the last `keep_last_turns` turns.

`ContextView` keeps the episode's pieces — the prompt, then per turn its sampled tokens, its text and
its observation — and renders the context of the next turn from them. A rendered context that no longer
extends the one the model read so far starts a new segment of the trajectory (rollout/trajectory.py:
`TrajectoryBuilder.start_segment`); one that does is appended, so an episode whose context is never
edited stays one segment, token for token as the plain loop builds it. A turn whose reasoning is stripped
is shown as its visible text tokenised again — what a server rendering the history would feed — while
its sampled tokens stay in the segment where they were sampled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from configs.task_schema import DEFAULT_SUMMARY_PREFIX, DEFAULT_SUMMARY_REQUEST

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ContextPolicy:
    """How the context of each turn is made (`loop.context` in a task file); the default appends."""

    think: Literal["keep", "strip"] = "keep"
    think_open: str = "<think>"
    think_close: str = "</think>"
    compaction: Literal["none", "keep_last", "summarize"] = "none"
    compact_at_tokens: int | None = None
    """Compact once the next turn's context would pass this many tokens."""
    keep_last_turns: int = 2
    """Turns kept (with their observations) after the prompt (and the summary)."""
    summary_request: str = DEFAULT_SUMMARY_REQUEST
    """summarize: the text appended to the context to ask for the summary."""
    summary_prefix: str = DEFAULT_SUMMARY_PREFIX
    """summarize: the text the summary follows in the next context."""
    summary_max_tokens: int = 256
    """summarize: most tokens of one summary."""

    @property
    def manages(self) -> bool:
        return self.think == "strip" or self.compaction != "none"

    def without_reasoning(self, text: str) -> str | None:
        """`text` without its complete reasoning blocks (and the blank space after each); None when it holds
        none (the turn's own tokens then stay as they were sampled)."""
        pattern = re.escape(self.think_open) + r".*?" + re.escape(self.think_close) + r"\s*"
        stripped, count = re.subn(pattern, "", text, flags=re.DOTALL)
        return stripped if count else None


@dataclass
class _Turn:
    sampled: list[int]
    shown: list[int]
    """What later turns read of it: its sampled tokens, or its visible text tokenised again."""
    observation: list[int] = field(default_factory=list)


class ContextView:
    """The pieces of one episode and the context they render to (module docstring)."""

    def __init__(self, policy: ContextPolicy, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int]
                 ) -> None:
        self.policy, self.tokenizer, self.prompt = policy, tokenizer, list(prompt_ids)
        self.turns: list[_Turn] = []
        self.summary: list[int] = []
        """summarize: how the latest summary is shown (prefix and text, tokenised), after the prompt."""
        self.compactions = 0
        """Times the history was cut (to its last turns, or to a summary and its last turns)."""
        self.stripped_turns = 0
        """Turns whose reasoning later turns did not see."""

    def add_turn(self, sampled: list[int]) -> None:
        """A generated turn (its sampled tokens, as the engine returned them)."""
        shown = sampled
        if self.policy.think == "strip":
            text = self.tokenizer.decode(sampled, skip_special_tokens=False)
            visible = self.policy.without_reasoning(text)
            if visible is not None:
                shown = self.tokenizer.encode(visible, add_special_tokens=False)
                self.stripped_turns += 1
        self.turns.append(_Turn(list(sampled), list(shown)))

    def add_observation(self, observation_ids: list[int]) -> None:
        self.turns[-1].observation = list(observation_ids)

    def render(self) -> list[int]:
        """The context as it stands: the prompt, the summary if any, then every kept turn."""
        context = [*self.prompt, *self.summary]
        for turn in self.turns:
            context += turn.shown + turn.observation
        return context

    def needs_compaction(self) -> bool:
        """Whether the context passed `compact_at_tokens` with more turns than compaction keeps."""
        policy = self.policy
        return (policy.compaction != "none" and policy.compact_at_tokens is not None
                and len(self.turns) > policy.keep_last_turns
                and len(self.render()) > policy.compact_at_tokens)

    def summary_request_ids(self) -> list[int]:
        """summarize: the tokens appended to the current context to ask for the summary."""
        return self.tokenizer.encode(self.policy.summary_request, add_special_tokens=False)

    def compact(self, summary_text: str | None = None) -> None:
        """Cut the history to its last `keep_last_turns` turns, after `summary_text` when one was written
        (the previous summary, if any, is replaced: the new one was written having read it)."""
        keep = self.policy.keep_last_turns
        self.turns = self.turns[-keep:] if keep else []
        if summary_text is not None:
            shown = f"{self.policy.summary_prefix}\n{summary_text.strip()}\n\n"
            self.summary = self.tokenizer.encode(shown, add_special_tokens=False)
        self.compactions += 1

    def next_context(self) -> list[int]:
        """keep_last: the tokens the next turn is generated after, compacted first when needed."""
        if self.policy.compaction == "keep_last" and self.needs_compaction():
            self.compact()
        return self.render()
