"""What the model reads at each turn when the context is managed, not only appended (`loop.context`).

The plain loop appends: every turn's context is the previous context plus the turn and its observation,
so an episode is one growing token sequence. A long-horizon agent, or a thinking model served the way it
is deployed, reads something else:

* `think: strip` — earlier turns' reasoning (`<think>…</think>`) is removed before the next turn, as
  chat templates such as Qwen3's drop it when the history is rendered again; the reasoning still trains
  where it was sampled, and the context stops growing by it;
* `compaction: keep_last` — once the context passes `compact_at_tokens`, only the prompt and the last
  `keep_last_turns` turns (each with its observation) stay.

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

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class ContextPolicy:
    """How the context of each turn is made (`loop.context` in a task file); the default appends."""

    think: Literal["keep", "strip"] = "keep"
    think_open: str = "<think>"
    think_close: str = "</think>"
    compaction: Literal["none", "keep_last"] = "none"
    compact_at_tokens: int | None = None
    """keep_last: compact once the next turn's context would pass this many tokens."""
    keep_last_turns: int = 2
    """keep_last: turns kept (with their observations) after the prompt."""

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
        self.compactions = 0
        """Times the history was cut to its last turns."""
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

    def next_context(self) -> list[int]:
        """The tokens the next turn is generated after; compacts first if the policy says so."""
        context = self._render(self.turns)
        policy = self.policy
        if (policy.compaction == "keep_last" and policy.compact_at_tokens is not None
                and len(context) > policy.compact_at_tokens and len(self.turns) > policy.keep_last_turns):
            self.turns = self.turns[-policy.keep_last_turns:] if policy.keep_last_turns else []
            self.compactions += 1
            context = self._render(self.turns)
        return context

    def _render(self, turns: list[_Turn]) -> list[int]:
        context = list(self.prompt)
        for turn in turns:
            context += turn.shown + turn.observation
        return context
