"""Demonstrations written through the real agent loop: a solver's turns, as the model would see them.

A warm start (run/train/warm_start.py) teaches a small model a task's tool protocol from episodes a
solver writes. For a task whose context the loop edits (`loop.context`: reasoning stripped, history
compacted or summarised), a demonstration must show each turn after exactly the context the loop
will give the model — which only the loop itself knows. So the solver plays the policy: its turns are
replies of a scripted engine, the task's real tool runs the code, `run_episode` renders the contexts,
and every segment of the resulting trajectory is one supervised sequence (its context masked, the
solver's turns trained) — what the learner will train on later, segment for segment.

A solver is `SolverPolicy`: for each sample, the next turn's text given how many turns it has written,
and a summary when the loop asks for one (`loop.context.compaction: summarize`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agent_env.loop import prompt_tools, run_episode
from agent_env.prompts import render_messages, render_prompt_ids
from agent_env.runtime import episode_settings
from rollout.fakes import ScriptedEngine, ScriptedReply
from tools.registry import build_tool

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from agent_env.samples import Sample
    from configs.task_schema import TaskConfig
    from rollout.trajectory import Trajectory
    from rollout.types import GenerationRequest

Demonstration = tuple[list[int], list[bool]]
"""A supervised sequence: token ids and which of them are trained."""


@dataclass(frozen=True)
class SolverPolicy:
    """What a solver writes for a sample: `turns(sample)` are its model turns in order (the last one
    answers); `summary(sample, turns_done)` is its summary after that many turns."""

    turns: Callable[[Sample], list[str]]
    summary: Callable[[Sample, int], str] | None = None


def _script(policy: SolverPolicy, sample: Sample, tokenizer: PreTrainedTokenizerBase,
            summary_request: str) -> Callable[[GenerationRequest], ScriptedReply]:
    turns = policy.turns(sample)
    written = [0]
    request_tail = tokenizer.encode(summary_request, add_special_tokens=False)

    def script(request: GenerationRequest) -> ScriptedReply:
        context = list(request.prompt_token_ids)
        if request_tail and context[-len(request_tail):] == request_tail:
            if policy.summary is None:
                raise ValueError("the task's loop asks for a summary, but this solver writes none")
            text, end = policy.summary(sample, written[0]), [tokenizer.eos_token_id]
        else:
            index = min(written[0], len(turns) - 1)
            written[0] += 1
            is_last = index == len(turns) - 1
            text, end = turns[index], [tokenizer.eos_token_id] if is_last else []
        return ScriptedReply([*tokenizer.encode(text, add_special_tokens=False), *end], logprobs=None)

    return script


async def _solver_episodes(task: TaskConfig, samples: Sequence[Sample], tokenizer: PreTrainedTokenizerBase,
                          policy: SolverPolicy) -> AsyncIterator[tuple[Sample, Trajectory]]:
    """The solver's episode of each sample in turn, through the task's loop and its real tool."""
    settings = episode_settings(task)
    specs = task.tool_specs()
    if task.loop.tool_format != "code_fence" or len(specs) != 1:
        raise ValueError("scripted demonstrations run code-fence tasks with one tool; this task has "
                         f"tool_format {task.loop.tool_format!r} and {len(specs)} tools")
    async with build_tool(specs[0]) as tool:
        for sample in samples:
            engine = ScriptedEngine(_script(policy, sample, tokenizer, settings.context.summary_request),
                                    eos_token_id=tokenizer.eos_token_id,
                                    decode=lambda ids: tokenizer.decode(list(ids)))
            messages = render_messages(task.prompt.system, task.prompt.user, sample)
            prompt = render_prompt_ids(tokenizer, messages, prompt_tools(tool, settings))
            async with engine:
                episode = await run_episode(engine, tokenizer, prompt, settings, lambda _text: _Unscored(),
                                            tool=tool, trajectory_id=f"demo-{sample.sample_id}",
                                            group_id="demo")
            yield sample, episode.trajectory


async def _demonstrate(task: TaskConfig, samples: Sequence[Sample], tokenizer: PreTrainedTokenizerBase,
                       policy: SolverPolicy, count: int) -> list[Demonstration]:
    out: list[Demonstration] = []
    episodes = 0
    if count <= 0:
        return out
    async for _sample, trajectory in _solver_episodes(task, samples, tokenizer, policy):
        if trajectory.task.is_truncated:
            continue  # the budget cut it: not a demonstration of the task done
        episodes += 1
        for start, stop in trajectory.segments:
            out.append((list(trajectory.token_ids[start:stop]), list(trajectory.loss_mask[start:stop])))
        if episodes >= count:
            break
    return out


async def _finishes(task: TaskConfig, samples: Sequence[Sample], tokenizer: PreTrainedTokenizerBase,
                    policy: SolverPolicy) -> dict[str, bool]:
    return {sample.sample_id: not trajectory.task.is_truncated
            async for sample, trajectory in _solver_episodes(task, samples, tokenizer, policy)}


@dataclass(frozen=True)
class _Unscored:
    score: float = 0.0


def scripted_demonstrations(task: TaskConfig, samples: Sequence[Sample], tokenizer: PreTrainedTokenizerBase,
                            policy: SolverPolicy, count: int) -> list[Demonstration]:
    """Every segment of up to `count` solver episodes over `samples` (in order), run through the task's loop
    and tool; an episode the budget truncated is left out. Runs its own event loop: call it from a thread
    that has none (the warm start runs in one)."""
    return asyncio.run(_demonstrate(task, samples, tokenizer, policy, count))


def solver_finishes(task: TaskConfig, samples: Sequence[Sample], tokenizer: PreTrainedTokenizerBase,
                    policy: SolverPolicy) -> dict[str, bool]:
    """Per sample id: whether the solver's episode ends inside the task's token budget (not truncated) —
    the most a policy that writes as the solver does can solve under this loop, e.g. without compaction.
    Runs its own event loop, as `scripted_demonstrations`."""
    return asyncio.run(_finishes(task, samples, tokenizer, policy))


def describe(demonstrations: Sequence[Demonstration]) -> dict[str, Any]:
    """Sizes, for the warm start's report."""
    lengths = [len(ids) for ids, _ in demonstrations]
    return {"sequences": len(lengths), "tokens": sum(lengths), "longest": max(lengths, default=0)}
