"""One episode's calls, recorded at token level as one segmented trajectory.

Each call is a context (the program's messages rendered by the chat template) and what the engine sampled
after it. A call whose context extends everything the episode's current segment holds — its context and
the tokens sampled in it — continues that segment (only the new tokens are stored: the tool results or
the next user message between the calls); any other context (the program dropped a message, rewrote a
tool result, summarised its history) starts a new segment. So the trained tokens are exactly the sampled
ones, each after exactly the context the model read (rollout/trajectory.py's `TrajectoryBuilder`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout.trajectory import TaskInfo, Trajectory, TrajectoryBuilder, TrajectoryTimings
from rollout.types import GenerationResult


@dataclass
class EpisodeRecorder:
    """The calls of one episode, in the order they were answered (a program's concurrent calls are
    answered one at a time, each after the previous one's tokens are recorded)."""

    version_at_start: int
    max_total_tokens: int
    """The most tokens one call's context and its answer may hold (the task's `loop.max_total_tokens`)."""
    builder: TrajectoryBuilder | None = None
    calls: int = 0
    texts: list[str] = field(default_factory=list)
    """Each call's reply as the program received it (what is scored when the program returns no reward)."""
    finish_reason: str = "stop"
    is_truncated: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    settings: Any = None
    """The endpoint's sampling and budgets for this episode (`EndpointSettings`); None = the endpoint's."""

    def room(self, context_ids: Sequence[int]) -> int:
        """Tokens a call after `context_ids` may still generate within the budget (≤ 0: none)."""
        return self.max_total_tokens - len(context_ids)

    def record(self, context_ids: Sequence[int], result: GenerationResult) -> None:
        """A call's context and the engine's answer: appended to the current segment when the context
        extends it, else a new segment."""
        if self.builder is None:
            self.builder = TrajectoryBuilder(context_ids, version_at_start=self.version_at_start)
        else:
            self.builder.start_segment(context_ids)
        self.builder.add_generation(result)
        self.calls += 1
        self.finish_reason = result.finish_reason
        self.is_truncated = self.is_truncated or result.finish_reason == "length"

    def build(self, trajectory_id: str, group_id: str, reward: float, *, tool_calls: int = 0,
              name: str = "", sample_id: str = "", total_s: float = 0.0) -> Trajectory | None:
        """The episode's trajectory; None when the program never called the endpoint."""
        if self.builder is None:
            return None
        task = TaskInfo(turns=self.calls, tool_calls=tool_calls, finish_reason=self.finish_reason,  # type: ignore[arg-type]
                        is_truncated=self.is_truncated, name=name, sample_id=sample_id)
        timings = TrajectoryTimings(generate_s=self.builder.generate_s, total_s=total_s)
        return self.builder.build(trajectory_id, group_id, reward=reward, task=task, timings=timings)
