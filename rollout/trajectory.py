"""The Trajectory: the one data contract between rollout and learner (docs/architecture.md).

A trajectory is a prompt plus every turn, as the exact token ids the engine consumed and produced
(never re-tokenised), with per-token alignment:

* `loss_mask[t]` is true only for tokens the model sampled (never prompt or tool-output tokens,
  hence never the first token);
* `behavior_logprobs[t]` is the engine's log-probability of token t where `loss_mask[t]`, and
  exactly 0.0 elsewhere (so the tensor is NaN-free and a masked sum needs no special case);
* `versions.per_token[t]` (optional) is the policy version that sampled token t where
  `loss_mask[t]`, and -1 elsewhere.

An episode whose turns do not all extend one growing context — earlier turns' reasoning stripped as a
thinking model's chat template does, a history compacted into a summary, a program that edits its
messages — is a list of *segments*: `segment_starts` are the token indices where a new context begins, each
segment its own context followed by what was sampled in it, with the same per-token alignment. The token
arrays are the segments end to end; turns that extend the previous context stay in one segment, so no token
is stored twice. The episode, not the segment, is the unit of everything per trajectory: its reward, its
sequence log-ratio (over every sampled token of every segment), its group, its staleness. A one-segment
episode (`segment_starts == (0,)`, the default) is stored and trained exactly as before.

It serialises to msgpack (the stream, replay) and to one JSON line (debugging); both round-trip
exactly. `TrajectoryBuilder` assembles one from context tokens and GenerationResults. Rewards,
filters and the agent loop live elsewhere (agent_env/).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Literal

import msgpack
from pydantic import Field, model_validator

from rollout.settings import StrictFrozenModel
from rollout.types import FinishReason, GenerationResult

NOT_SAMPLED_VERSION = -1
"""`versions.per_token` value of tokens the model did not sample (prompt, tool output)."""


class TrajectoryVersions(StrictFrozenModel):
    """Which policy versions produced the trajectory."""

    start: int = Field(ge=0)
    """Version when its first generation started (lag at consumption = learner version − start); 0 when
    nothing was generated (its lag is then its group's: `rollout.manager.GroupTicket.lag_of`)."""
    end: int = Field(ge=0)
    """Newest version that sampled any of its tokens (= start when nothing was sampled)."""
    per_token: tuple[int, ...] | None = None
    """Version per token (aligned to token_ids; -1 where loss_mask is false); None = not recorded."""


class TaskInfo(StrictFrozenModel):
    """What happened in the episode (metrics and filters read these)."""

    turns: int = Field(0, ge=0)
    """Model turns (generate calls)."""
    tool_calls: int = Field(0, ge=0)
    """Tool executions."""
    tool_errors: int = Field(0, ge=0)
    """Tool executions that failed (error, timeout, memory limit), and function calls refused for their
    arguments or for being over a turn's limit."""
    tool_parse_errors: int = Field(0, ge=0)
    """Function calls that could not be read (bad JSON, no name, an unclosed tag)."""
    tool_unknown: int = Field(0, ge=0)
    """Function calls of a tool name the task does not offer."""
    void_turns: int = Field(0, ge=0)
    """Turns with neither a tool call nor a final answer."""
    compactions: int = Field(0, ge=0)
    """Times the loop cut the history to its last turns (`loop.context.compaction`)."""
    finish_reason: FinishReason = "stop"
    """finish_reason of the last generation."""
    is_truncated: bool = False
    """The token budget ran out before the episode ended."""
    name: str = ""
    """Task name (e.g. 'countdown')."""
    sample_id: str = ""
    """Dataset sample / generated problem id."""


class TrajectoryTimings(StrictFrozenModel):
    """Wall-clock seconds spent on the trajectory."""

    generate_s: float = Field(0.0, ge=0)
    """Sum over turns of the engine's total_s."""
    tool_s: float = Field(0.0, ge=0)
    """Time in tool executions."""
    total_s: float = Field(0.0, ge=0)
    """From the first generate call to the end of the episode."""


class Trajectory(StrictFrozenModel):
    """One episode, token-aligned (see the module docstring)."""

    kind: Literal["trajectory"] = "trajectory"
    """Message tag on the trajectory stream."""
    trajectory_id: str
    """Unique id."""
    group_id: str
    """Trajectories sampled for the same prompt share it (GRPO groups)."""
    token_ids: tuple[int, ...] = Field(min_length=1)
    """Prompt + every turn, exactly as the engine consumed and produced them."""
    loss_mask: tuple[bool, ...]
    """True only for model-sampled tokens."""
    behavior_logprobs: tuple[float, ...]
    """Engine logprob per token where loss_mask, 0.0 elsewhere."""
    versions: TrajectoryVersions
    """Policy versions that produced it."""
    reward: float = 0.0
    """Scalar episode reward."""
    task: TaskInfo = Field(default_factory=TaskInfo)
    """Episode metadata."""
    timings: TrajectoryTimings = Field(default_factory=TrajectoryTimings)
    """Wall-clock timings."""
    segment_starts: tuple[int, ...] = (0,)
    """Token index of each segment's first token (module docstring): 0 first, increasing; a segment starts
    with context, never with a sampled token."""

    @model_validator(mode="after")
    def _check(self) -> Trajectory:
        n = len(self.token_ids)
        for name, values in (
            ("loss_mask", self.loss_mask),
            ("behavior_logprobs", self.behavior_logprobs),
            ("versions.per_token", self.versions.per_token),
        ):
            if values is not None and len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} token_ids; give one per token")
        if self.loss_mask[0]:
            raise ValueError("loss_mask[0] is true, but the first token has no context to be sampled from")
        for t, (is_sampled, logprob) in enumerate(zip(self.loss_mask, self.behavior_logprobs, strict=True)):
            if is_sampled and not (math.isfinite(logprob) and logprob <= 1e-3):
                raise ValueError(f"behavior_logprobs[{t}]={logprob} is not a finite log-probability")
            if not is_sampled and logprob != 0.0:
                raise ValueError(f"behavior_logprobs[{t}]={logprob} where loss_mask is false; it must be 0.0")
        if not math.isfinite(self.reward):
            raise ValueError(f"reward={self.reward} must be finite")
        self._check_segments()
        self._check_versions()
        return self

    def _check_segments(self) -> None:
        starts = self.segment_starts
        if not starts or starts[0] != 0:
            raise ValueError(f"segment_starts={starts} must begin with 0 (the first segment starts the "
                             "episode)")
        if any(b <= a for a, b in itertools.pairwise(starts)) or starts[-1] >= len(self.token_ids):
            raise ValueError(f"segment_starts={starts} must increase and stay below the "
                             f"{len(self.token_ids)} tokens")
        sampled = [start for start in starts if self.loss_mask[start]]
        if sampled:
            raise ValueError(f"segments starting at {sampled} start with a sampled token; a segment's first "
                             "token is context (nothing precedes it to sample it from)")

    @property
    def segments(self) -> list[tuple[int, int]]:
        """Each segment's `[start, end)` token range."""
        ends = [*self.segment_starts[1:], len(self.token_ids)]
        return list(zip(self.segment_starts, ends, strict=True))

    def _check_versions(self) -> None:
        versions = self.versions
        if versions.end < versions.start:
            raise ValueError(f"versions.end={versions.end} < versions.start={versions.start}")
        if versions.per_token is None:
            return
        for t, (is_sampled, version) in enumerate(zip(self.loss_mask, versions.per_token, strict=True)):
            if is_sampled and not versions.start <= version <= versions.end:
                raise ValueError(
                    f"versions.per_token[{t}]={version} lies outside [start, end]="
                    f"[{versions.start}, {versions.end}]"
                )
            if not is_sampled and version != NOT_SAMPLED_VERSION:
                raise ValueError(
                    f"versions.per_token[{t}]={version} where loss_mask is false; it must be "
                    f"{NOT_SAMPLED_VERSION}"
                )

    @property
    def num_sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self.model_dump(mode="python"), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes) -> Trajectory:
        return cls.model_validate(msgpack.unpackb(data, raw=False))

    def to_json_line(self) -> str:
        """One line of JSON (no newline inside), for JSONL files."""
        return self.model_dump_json()

    @classmethod
    def from_json_line(cls, line: str) -> Trajectory:
        return cls.model_validate_json(line)


class TrajectoryBuilder:
    """Assembles a Trajectory turn by turn: context tokens (prompt, tool output) are not sampled;
    each GenerationResult appends its tokens with their logprobs and versions."""

    def __init__(self, prompt_token_ids: Sequence[int], version_at_start: int = 0) -> None:
        """`version_at_start`: the engine's policy version when the episode began — its `versions.start`
        should it never generate (a prompt that fills the token budget), so its lag is measured from when
        it ran, not from version 0."""
        self.version_at_start = version_at_start
        self.token_ids: list[int] = []
        self._loss_mask: list[bool] = []
        self._logprobs: list[float] = []
        self._versions: list[int] = []
        self._version_start: int | None = None
        self._finish_reason: FinishReason = "stop"
        self._turns = 0
        self._generate_s = 0.0
        self._segment_starts: list[int] = [0]
        self._segment_length = 0
        """Tokens of the current segment (its context and what was sampled in it)."""
        self.add_context(prompt_token_ids)

    def context_ids(self) -> list[int]:
        """The current segment's tokens: what the model reads at the next turn."""
        return self.token_ids[len(self.token_ids) - self._segment_length:]

    def start_segment(self, context_ids: Sequence[int]) -> None:
        """A new context that does not extend the current one (earlier reasoning stripped, a compacted
        history): the next turns are sampled after `context_ids` alone. A context that does extend the
        current segment's is appended to it instead (no token stored twice)."""
        current = self.context_ids()
        if list(context_ids[:len(current)]) == current:
            self.add_context(context_ids[len(current):])
            return
        if not context_ids:
            raise ValueError("a new segment needs at least one context token")
        self._segment_starts.append(len(self.token_ids))
        self._segment_length = 0
        self.add_context(context_ids)

    @property
    def segment_count(self) -> int:
        return len(self._segment_starts)

    def add_context(self, token_ids: Sequence[int]) -> None:
        """Tokens the model did not sample (prompt, tool observation)."""
        self._segment_length += len(token_ids)
        self.token_ids.extend(token_ids)
        self._loss_mask.extend([False] * len(token_ids))
        self._logprobs.extend([0.0] * len(token_ids))
        self._versions.extend([NOT_SAMPLED_VERSION] * len(token_ids))

    def add_generation(self, result: GenerationResult) -> None:
        """A model turn: its sampled tokens, logprobs and per-token versions."""
        if not result.has_logprobs:
            raise ValueError(
                f"request {result.request_id!r} came without logprobs (an evaluation-only server); "
                "trajectories for training need an engine that reports them"
            )
        if self._version_start is None:
            self._version_start = result.version_start
        self.token_ids.extend(result.token_ids)
        self._segment_length += len(result.token_ids)
        self._loss_mask.extend([True] * len(result.token_ids))
        self._logprobs.extend(result.logprobs)
        self._versions.extend(result.versions)
        self._finish_reason = result.finish_reason
        self._turns += 1
        self._generate_s += result.timings.total_s

    @property
    def generate_s(self) -> float:
        """Sum of the engine's total_s over the generations added so far."""
        return self._generate_s

    def build(
        self,
        trajectory_id: str,
        group_id: str,
        reward: float,
        task: TaskInfo | None = None,
        timings: TrajectoryTimings | None = None,
    ) -> Trajectory:
        """Freeze. `task.turns`/`finish_reason` and `timings.generate_s` default to what was added."""
        start = self.version_at_start if self._version_start is None else self._version_start
        sampled = [v for v in self._versions if v != NOT_SAMPLED_VERSION]
        task = task or TaskInfo(turns=self._turns, finish_reason=self._finish_reason)
        return Trajectory(
            trajectory_id=trajectory_id,
            group_id=group_id,
            token_ids=tuple(self.token_ids),
            loss_mask=tuple(self._loss_mask),
            behavior_logprobs=tuple(self._logprobs),
            versions=TrajectoryVersions(
                start=start, end=max([start, *sampled]), per_token=tuple(self._versions)
            ),
            reward=reward,
            task=task,
            timings=timings or TrajectoryTimings(generate_s=self._generate_s),
            segment_starts=tuple(self._segment_starts),
        )
