"""Running a task's episodes and groups for the rollout manager: which sample a data position draws
(`data_index`), the agent loop's settings from a task (`episode_settings`), one task's runtime
(`TaskRuntime`: samples, reward, tokenizer, engine, tool) and the group runner the manager calls for
each ticket. `RolloutRuntime` is what the training loop needs of the rollout side: a `TaskRuntime` in
one process, or the Ray launcher's pool of rollout actors (run/launch/ray_launcher.py).

What it does not do: admit groups, bound the lag or retry (rollout/manager.py), or train.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from agent_env.context import ContextPolicy
from agent_env.loop import Episode, EpisodeSettings, prompt_tools, run_episode
from agent_env.prompts import render_messages, render_prompt_ids
from agent_env.samples import Sample
from configs.task_schema import TaskConfig
from rollout.base import InferenceEngine
from rollout.manager import GroupTicket, RunGroup, WeightTarget
from rollout.request_record import SAMPLED_TOKENS
from rollout.trajectory import Trajectory
from tools.base import Tool
from tools.functions import Toolbox

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

def data_index(position: int, num_samples: int, seed: int) -> int:
    """The sample used at data position `position`: a fresh seeded permutation per epoch."""
    epoch, offset = divmod(position, num_samples)
    order = list(range(num_samples))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[offset]


def episode_settings(task: TaskConfig, seed: int | None = None, *, for_eval: bool = False) -> EpisodeSettings:
    """The agent loop's settings from a task (training, or its eval overrides)."""
    loop = task.loop
    return EpisodeSettings(
        max_turns=task.eval.max_turns if for_eval else loop.max_turns,
        max_total_tokens=(task.eval.max_total_tokens or loop.max_total_tokens) if for_eval
        else loop.max_total_tokens,
        max_new_tokens_per_turn=loop.max_new_tokens_per_turn,
        temperature=task.eval.temperature if for_eval else loop.temperature,
        top_p=task.eval.top_p if for_eval else loop.top_p,
        answer_pattern=task.answer.pattern,
        observation_format=loop.observation_format,
        max_observation_chars=loop.max_observation_chars,
        preamble=loop.preamble,
        use_session=loop.use_session,
        seed=seed,
        tool_format=loop.tool_format,
        tool_parser=loop.tool_parser,
        max_parallel_calls=loop.max_parallel_calls,
        context=ContextPolicy(**loop.context.model_dump()),
    )


class ProgramEpisodes(Protocol):
    """Episodes run by the user's agent program instead of the built-in loop (agent_env/programs/)."""

    async def episode(self, sample: Sample, settings: EpisodeSettings, trajectory_id: str, group_id: str,
                      task_name: str) -> Episode: ...

    def counters(self) -> dict[str, float]: ...


@dataclass(frozen=True)
class LiveCounts:
    """What the rollout side has done so far in this process (running totals)."""

    episodes_finished: int
    episodes_running: int
    tokens_sampled: int


@dataclass
class TaskRuntime:
    """Everything needed to run episodes of one task (built by the composition root)."""

    task: TaskConfig
    samples: Sequence[Sample]
    reward: Callable[[str, Sample], Any]
    tokenizer: PreTrainedTokenizerBase
    engine: InferenceEngine
    tool: Tool | Toolbox | None
    """The one tool of a code-fence task, or every tool as a toolbox for function calling."""
    skipped_samples: int = 0
    reward_errors: int = 0
    """Episodes whose reward function failed (scored 0, counted, never fatal)."""
    prompt_cache: dict[str, list[int]] = field(default_factory=dict)
    episodes_running: int = 0
    episodes_finished: int = 0
    program: ProgramEpisodes | None = None
    """`loop.program`'s runner: every episode is one run of the user's program."""

    def prompt_ids(self, sample: Sample) -> list[int]:
        if sample.sample_id not in self.prompt_cache:
            messages = render_messages(self.task.prompt.system, self.task.prompt.user, sample)
            tools = prompt_tools(self.tool, episode_settings(self.task))
            self.prompt_cache[sample.sample_id] = render_prompt_ids(self.tokenizer, messages, tools)
        return self.prompt_cache[sample.sample_id]

    async def episode(self, sample: Sample, settings: EpisodeSettings, trajectory_id: str,
                      group_id: str) -> Episode:
        self.episodes_running += 1
        try:
            if self.program is not None:
                episode = await self.program.episode(sample, settings, trajectory_id, group_id,
                                                     self.task.name)
            else:
                episode = await run_episode(
                    self.engine, self.tokenizer, self.prompt_ids(sample), settings,
                    lambda text: self.reward(text, sample), tool=self.tool, trajectory_id=trajectory_id,
                    group_id=group_id, task_name=self.task.name, sample_id=sample.sample_id)
        finally:
            self.episodes_running -= 1
        self.episodes_finished += 1
        if getattr(episode.reward_info, "error", None):
            self.reward_errors += 1
        return episode

    def live_counts(self) -> LiveCounts:
        """Episodes finished and running, tokens sampled: for the live progress line, not a metric."""
        return LiveCounts(self.episodes_finished, self.episodes_running, SAMPLED_TOKENS.count)

    def group_runner(self, group_size: int, seed: int) -> RunGroup:
        """The rollout manager's `run_group`: `group_size` episodes of the ticket's prompt, here."""
        return _group_runner(self, group_size, seed)

    def counters(self) -> dict[str, float]:
        """Running totals logged every step."""
        counts = {"rollout/skipped_samples": self.skipped_samples,
                  "rollout/reward_errors": self.reward_errors}
        return {**counts, **(self.program.counters() if self.program is not None else {})}


class RolloutRuntime(Protocol):
    """What the training loop (`run.train.trainer.train`) needs of the rollout side: a `TaskRuntime`
    in its process, or the Ray launcher's pool of rollout actors (run/launch/ray_launcher.py)."""

    task: TaskConfig
    tokenizer: PreTrainedTokenizerBase

    @property
    def engine(self) -> WeightTarget: ...

    def group_runner(self, group_size: int, seed: int) -> RunGroup: ...

    def counters(self) -> dict[str, float]: ...

    def live_counts(self) -> LiveCounts | None:
        """Running totals for the live progress line; None where they are not known here (Ray)."""
        ...


def _refill_tag(ticket: GroupTicket) -> str:
    """'' for a slot's own group, 'rN' for the N-th refill of its batch (dynamic sampling): distinct ids."""
    return f"r{ticket.refill}" if ticket.refill else ""


def _group_runner(runtime: TaskRuntime, group_size: int, seed: int) -> RunGroup:
    settings = episode_settings(runtime.task)

    async def run_group(ticket: GroupTicket) -> list[Trajectory]:
        sample = runtime.samples[data_index(ticket.prompt_position, len(runtime.samples), seed)]
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(runtime.episode(
                sample, settings, f"g{ticket.group_index}.{ticket.attempt}{_refill_tag(ticket)}.{member}",
                str(ticket.group_index))) for member in range(group_size)]
        return [task.result().trajectory for task in tasks]

    return run_group
