"""`vcpo train`: the loop that joins rollout stream → learner → weight sync, in one process.

Local mode (docs/architecture.md): the engine and the agent loops run on this asyncio loop (the engine's
forward passes on its own thread), the learner step runs on a worker thread, and weights are
copied in memory into the engine (in place for vLLM) with the new policy version. The rollout
manager admits groups under the lag bound `k`, so generation for step `v + 1 … v + k` overlaps the
learner's step `v`.

Per step: wait for the batch slot (idle_learner), apply the task's loss filters, train (train),
push weights (weight_sync), log every docs/algorithm.md metric to metrics.jsonl/TensorBoard, show progress,
and every `checkpoint_every` steps write an atomic checkpoint (model, optimizer, step, RNG, data
position, unconsumed groups and slots in flight). A resumed run restarts from the newest complete
checkpoint with the same lag bound, and no group is lost or used twice (rollout/manager.py).

What it does not do: read config files (the CLI does) or know any engine/tool/task specifics.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import random
import resource
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from agent_env.heldout import HeldoutChange, HeldoutEvaluator, HeldoutResult, falling_warning, paired_change
from agent_env.loop import Episode, EpisodeSettings, run_episode
from agent_env.prompts import render_messages, render_prompt_ids
from agent_env.samples import Sample
from configs.schema import RunConfig
from configs.task_schema import TaskConfig
from learner.backends.torch_learner import StepInput
from learner.observability import metric_names as names
from learner.observability.metrics_log import MetricsLogger
from learner.observability.progress import ProgressLine, format_activity
from learner.observability.trend import LearningSignal
from learner.train.checkpointing import (
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    rng_state,
    save_checkpoint,
)
from rollout.base import InferenceEngine
from rollout.errors import EngineUnavailable
from rollout.manager import GroupTicket, RolloutManager, RunGroup, WeightTarget
from rollout.openmp import release_openmp_threads
from rollout.progress import SAMPLED_TOKENS
from rollout.trajectory import Trajectory
from tools.base import Tool, ToolUnavailableError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


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
    )


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
    tool: Tool | None
    skipped_samples: int = 0
    reward_errors: int = 0
    """Episodes whose reward function failed (scored 0, counted, never fatal)."""
    prompt_cache: dict[str, list[int]] = field(default_factory=dict)
    episodes_running: int = 0
    episodes_finished: int = 0

    def prompt_ids(self, sample: Sample) -> list[int]:
        if sample.sample_id not in self.prompt_cache:
            messages = render_messages(self.task.prompt.system, self.task.prompt.user, sample)
            self.prompt_cache[sample.sample_id] = render_prompt_ids(self.tokenizer, messages)
        return self.prompt_cache[sample.sample_id]

    async def episode(self, sample: Sample, settings: EpisodeSettings, trajectory_id: str,
                      group_id: str) -> Episode:
        self.episodes_running += 1
        try:
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
        return {"rollout/skipped_samples": self.skipped_samples, "rollout/reward_errors": self.reward_errors}


class RolloutRuntime(Protocol):
    """What `train` needs of the rollout side: a `TaskRuntime` here, or the Ray launcher's pool of
    rollout actors (learner/launch/ray_launcher.py)."""

    task: TaskConfig
    tokenizer: PreTrainedTokenizerBase

    @property
    def engine(self) -> WeightTarget: ...

    def group_runner(self, group_size: int, seed: int) -> RunGroup: ...

    def counters(self) -> dict[str, float]: ...

    def live_counts(self) -> LiveCounts | None:
        """Running totals for the live progress line; None where they are not known here (Ray)."""
        ...


class Learner(Protocol):
    """What `train` needs of a learner: `TorchLearner`, or the Ray launcher's proxy of learner actors."""

    device: torch.device

    def step(self, batch: StepInput) -> dict[str, Any]: ...

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_pretrained(self, path: Path) -> None: ...


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


class LiveActivity:
    """Between step lines, the progress line shows what the current step is doing (`activity` ticks
    every `tick_s`): waiting for rollouts — episodes finished and running, tokens sampled since the
    phase began — or the learner step, or the weight push. A step of a long-horizon task can take
    many minutes on a CPU, and a display that moves only when a step ends looks hung."""

    def __init__(self, display: ProgressLine, runtime: RolloutRuntime, episodes_per_step: int,
                 tick_s: float = 1.0) -> None:
        self.display, self.runtime, self.tick_s = display, runtime, tick_s
        self.episodes_per_step = episodes_per_step
        self.step, self.phase = 0, "starting"
        self._since = time.monotonic()
        self._start_counts: LiveCounts | None = self._counts()

    def _counts(self) -> LiveCounts | None:
        return self.runtime.live_counts()

    def begin(self, step: int, phase: str) -> None:
        self.step, self.phase, self._since = step, phase, time.monotonic()
        self._start_counts = self._counts()

    def text(self) -> str:
        since = time.monotonic() - self._since
        now, start = self._counts(), self._start_counts
        if self.phase != "rollouts" or now is None or start is None:
            return format_activity(self.step, phase=self.phase, since_s=since)
        return format_activity(self.step, phase="rollouts", since_s=since,
                               episodes_done=now.episodes_finished - start.episodes_finished,
                               episodes_total=self.episodes_per_step, episodes_running=now.episodes_running,
                               tokens=now.tokens_sampled - start.tokens_sampled)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            self.display.activity(self.text())


class TrajectoryLog:
    """run_dir/trajectories.jsonl: one line per trajectory the learner consumed, written (and fsynced)
    at each step; on resume from step S the lines of later steps and a torn last line are dropped."""

    def __init__(self, path: Path, tokenizer: PreTrainedTokenizerBase, resume_from_step: int) -> None:
        self.path, self.tokenizer = path, tokenizer
        kept = []
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break
                if record["step"] <= resume_from_step:
                    kept.append(line)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def write(self, step: int, groups: Sequence[tuple[GroupTicket, list[Trajectory]]], version: int) -> None:
        for ticket, members in groups:
            for trajectory in members:
                mask = trajectory.loss_mask
                first = mask.index(True) if any(mask) else len(trajectory.token_ids)
                self._file.write(json.dumps({
                    "step": step, "group": ticket.group_index, "prompt_position": ticket.prompt_position,
                    "sample_id": trajectory.task.sample_id, "reward": trajectory.reward,
                    "lag": version - trajectory.versions.start,
                    "versions": [trajectory.versions.start, trajectory.versions.end],
                    "turns": trajectory.task.turns, "tool_calls": trajectory.task.tool_calls,
                    "tool_errors": trajectory.task.tool_errors, "truncated": trajectory.task.is_truncated,
                    "text": self.tokenizer.decode(trajectory.token_ids[first:], skip_special_tokens=False),
                }) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def has_signal(trajectories: Sequence[Trajectory]) -> bool:
    """Whether a group's episodes did not all score alike (dynamic sampling keeps it): the exact-equality
    rule of `vcpo.groups.degenerate_groups`, so a dropped group is one VCPO would give no gradient."""
    return len({t.reward for t in trajectories}) > 1


def step_input(
    groups: Sequence[tuple[GroupTicket, list[Trajectory]]], version: int, task: TaskConfig
) -> StepInput:
    """The learner's minibatch: lags at consumption and the task's loss filters."""
    trajectories, group_ids, lags, trained = [], [], [], []
    for ticket, members in groups:
        for trajectory in members:
            trajectories.append(trajectory)
            group_ids.append(ticket.group_index)
            lags.append(version - trajectory.versions.start)
            is_void = task.filters.mask_void_turns and trajectory.task.void_turns > 0
            is_cut = task.filters.remove_truncated and trajectory.task.is_truncated
            trained.append(not (is_void or is_cut))
    return StepInput(trajectories, group_ids, lags, trained)


def rollout_metrics(batch: StepInput) -> dict[str, float]:
    """Episode statistics of a minibatch (rollout/*, tokens/generated)."""
    trajectories = batch.trajectories
    n = max(1, len(trajectories))
    return {
        "rollout/turns_mean": sum(t.task.turns for t in trajectories) / n,
        "rollout/tool_calls_mean": sum(t.task.tool_calls for t in trajectories) / n,
        "rollout/tool_errors_mean": sum(t.task.tool_errors for t in trajectories) / n,
        "rollout/truncated_frac": sum(t.task.is_truncated for t in trajectories) / n,
        "rollout/void_turn_frac": sum(t.task.void_turns > 0 for t in trajectories) / n,
        "rollout/response_tokens_mean": sum(t.num_sampled_tokens for t in trajectories) / n,
        "rollout/filtered_frac": sum(not kept for kept in batch.is_trained) / n,
        "tokens/generated": float(sum(t.num_sampled_tokens for t in trajectories)),
    }


def process_cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process's threads and its finished children
    (sandboxed tool calls): `time/cpu` per step, against `time/step` × cores, says how busy the
    machine was — what overlap (k > 0) can still gain (`vcpo bench async`)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _step_and_trim(learner: Learner, batch: StepInput) -> dict[str, Any]:
    """One learner step, then hand freed heap pages back to the OS (glibc `malloc_trim`; a no-op
    elsewhere): a step's transient activations are GBs the engine may need before the next step; and end
    this thread's docked OpenMP team, which would throttle the engine's while the learner waits
    (rollout/openmp.py)."""
    try:
        return learner.step(batch)
    finally:
        _malloc_trim()
        release_openmp_threads()


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def export_model(learner: Learner, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> Path:
    """The trained policy as an HF directory (safetensors + tokenizer) for `vcpo eval --model`, any
    engine or the hub; written beside and renamed into place, so a reader never sees half of it."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    learner.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


@contextlib.asynccontextmanager
async def _ticking(live: LiveActivity | None) -> Any:
    """Run `live`'s ticker for the duration of the block (nothing when there is no display)."""
    if live is None:
        yield
        return
    task = asyncio.create_task(live.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@dataclass
class TrainSummary:
    steps: int
    first_rewards: list[float]
    last_rewards: list[float]
    wall_s: float
    run_dir: Path
    heldout: list[HeldoutResult] = field(default_factory=list)
    """The held-out evaluations of this process (a resumed run's earlier ones are in metrics.jsonl)."""
    heldout_change: HeldoutChange | None = None
    """The first evaluation (the policy RL started from) → the last, paired by prompt; None without both."""
    phases: dict[str, float] = field(default_factory=dict)
    """Wall seconds by phase ("warm start", "startup", "RL", "held-out eval"), for the closing summary."""


def is_eval_version(version: int, every: int, total_steps: int) -> bool:
    """Whether the held-out set is evaluated at `version`: 0, every `every` versions, and the last."""
    return every > 0 and (version % every == 0 or version == total_steps)


def heldout_metrics(result: HeldoutResult) -> dict[str, float]:
    """The `eval/*` metrics (and `time/eval`) of one held-out evaluation."""
    return {names.EVAL_SUCCESS: result.success, names.EVAL_SUCCESS_LOW: result.low,
            names.EVAL_SUCCESS_HIGH: result.high, names.EVAL_PROMPTS: float(len(result.per_prompt)),
            names.EVAL_NO_ANSWER_FRAC: float(result.summary["no_answer_frac"]),
            names.EVAL_TOOL_CALLS_MEAN: float(result.summary["tool_calls_mean"]),
            names.EVAL_TRUNCATED_FRAC: float(result.summary["truncated_frac"]),
            names.EVAL_RESPONSE_TOKENS_MEAN: float(result.summary["response_tokens_mean"]),
            names.TIME_EVAL: result.seconds}


async def _evaluate(heldout: HeldoutEvaluator, version: int, live: LiveActivity | None,
                    display: ProgressLine | None) -> HeldoutResult:
    if live is not None:
        live.begin(version, "held-out eval")
    result = await heldout.run(version)
    lines = [result.line()]
    falling = falling_warning(heldout.stored(0) if version > 0 else None, result)
    if falling is not None:
        lines.append(falling)
    for line in lines:
        if display is not None:
            display.message(line)
        else:
            log.info("%s", line)
    return result


async def train(config: RunConfig, runtime: RolloutRuntime, learner: Learner, run_dir: Path, *,
                progress: bool = True, stop_after_step: int | None = None,
                heldout: HeldoutEvaluator | None = None) -> TrainSummary:
    """Train `config.trainer.total_steps` steps (resuming from run_dir's newest checkpoint if any); with
    `heldout`, evaluate the held-out prompts at the versions `is_eval_version` names."""
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer, rollout = config.trainer, config.rollout
    run_group = runtime.group_runner(config.algo.group_size, config.seed)
    manager = RolloutManager(
        runtime.engine, run_group, groups_per_batch=rollout.groups_per_step,
        max_lag=rollout.max_lag,
        max_concurrent_groups=(rollout.max_concurrent_groups
                               or rollout.groups_per_step * (rollout.max_lag + 1)),
        max_attempts=rollout.max_group_attempts, fatal_errors=(EngineUnavailable, ToolUnavailableError),
        total_batches=trainer.total_steps, saturate=rollout.saturate_lag,
        accept=has_signal if rollout.dynamic_sampling else None, max_refills=rollout.max_refills_per_step)
    start_step = 0
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:
        state, meta = load_checkpoint(checkpoint, map_location=learner.device)
        learner.load_state_dict(state["learner"])
        restore_rng_state(state["rng"])
        manager.restore(state["rollout"])
        start_step = int(meta["step"])
        log.info("resuming from %s (step %d)", checkpoint, start_step)
        await manager.sync_weights(learner.named_weights(), start_step)
    if heldout is not None:  # a resumed run retrains the versions after its checkpoint
        heldout.discard_after(start_step)
    rewards: list[float] = []
    signal = LearningSignal(run_dir, start_step)
    shown_trend: dict[str, float] = {}
    evaluations: list[HeldoutResult] = []
    is_finished = False
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        # One dedicated learner thread: glibc gives each thread its own malloc arena and keeps what a
        # thread freed for that thread, so learner steps hopping between pool threads each pinned a
        # step's worth of activations (the default run grew 12 → 24 GB in 7 steps and was OOM-killed).
        learner_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")
        # not waited for on the way out: a cancelled run (Ctrl-C) unwinds at once, and the step on the
        # thread, if any, ends on its own (the checkpoints it could touch are written atomically)
        stack.callback(learner_thread.shutdown, wait=False, cancel_futures=True)
        trajectory_log = None
        if trainer.save_trajectories:
            trajectory_log = TrajectoryLog(run_dir / "trajectories.jsonl", runtime.tokenizer, start_step)
            stack.callback(trajectory_log.close)
        metrics_log = stack.enter_context(MetricsLogger(
            run_dir, resume_from_step=start_step,
            use_tensorboard=trainer.use_tensorboard, use_wandb=trainer.use_wandb))
        display = stack.enter_context(ProgressLine(trainer.total_steps)) if progress else None
        live = None
        if display is not None:
            live = LiveActivity(display, runtime, rollout.groups_per_step * config.algo.group_size)
        async with manager, _ticking(live):
            if heldout is not None and trainer.eval_every > 0 and metrics_log.last_step is None:
                # the policy RL starts from (after the warm start), logged as trainer_step 0
                evaluations.append(await _evaluate(heldout, 0, live, display))
                metrics_log.log(0, 0, heldout_metrics(evaluations[-1]))
            last_busy, last_wall = manager.busy_seconds(), time.perf_counter()
            last_cpu = process_cpu_seconds()
            for step in range(start_step, trainer.total_steps):
                if live is not None:
                    live.begin(step + 1, "rollouts")
                # This (event-loop) thread's OpenMP team — from loading or warm-starting the model, or
                # any tensor work here — idles from now on: end it (rollout/openmp.py).
                release_openmp_threads()
                waited = time.perf_counter()
                groups = await manager.next_batch()
                idle_learner = time.perf_counter() - waited
                batch = step_input(groups, step, runtime.task)
                if trajectory_log is not None:
                    trajectory_log.write(step + 1, groups, step)
                if live is not None:
                    live.begin(step + 1, "learner step")
                tick = time.perf_counter()
                metrics = await asyncio.get_running_loop().run_in_executor(learner_thread, _step_and_trim,
                                                                           learner, batch)
                train_s = time.perf_counter() - tick
                if live is not None:
                    live.begin(step + 1, "weight push")
                tick = time.perf_counter()
                await manager.sync_weights(learner.named_weights(), step + 1)
                sync_s = time.perf_counter() - tick
                now, busy, cpu = time.perf_counter(), manager.busy_seconds(), process_cpu_seconds()
                metrics.update(rollout_metrics(batch))
                metrics.update({
                    "time/train": train_s, "time/weight_sync": sync_s, "time/idle_learner": idle_learner,
                    "time/generate": busy - last_busy,
                    "time/idle_rollout": (now - last_wall) - (busy - last_busy),
                    "time/step": now - last_wall, "time/cpu": cpu - last_cpu,
                    "perf/tokens_per_s": metrics["tokens/generated"] / max(1e-9, now - last_wall),
                    "rollout/failed_groups": manager.counters.groups_failed})
                trained_rewards = [t.reward for t in batch.trajectories]
                if rollout.dynamic_sampling:
                    dropped = manager.last_batch_dropped_rewards
                    generated = trained_rewards + dropped
                    metrics.update({names.ROLLOUT_REFILLS: manager.last_batch_refills,
                                    names.ROLLOUT_REFILLED_GROUPS: manager.counters.groups_refilled,
                                    names.ROLLOUT_REFILL_TOKENS: manager.counters.refill_tokens,
                                    names.ROLLOUT_DROPPED_EPISODES: len(dropped),
                                    names.ROLLOUT_REWARD_MEAN_GENERATED: sum(generated) / len(generated)})
                metrics.update(runtime.counters())
                trend = signal.update(step + 1, trained_rewards)
                metrics.update(trend)
                shown_trend = trend or shown_trend  # the line keeps the latest trend between updates
                falling = signal.warning(step + 1, trend)
                if falling is not None:
                    if display is not None:
                        display.message(falling)
                    log.warning("%s", falling)
                if heldout is not None and is_eval_version(step + 1, trainer.eval_every, trainer.total_steps):
                    evaluations.append(await _evaluate(heldout, step + 1, live, display))
                    metrics.update(heldout_metrics(evaluations[-1]))
                    # the evaluation's wall time is its own (time/eval), not the next step's
                    now, busy, cpu = time.perf_counter(), manager.busy_seconds(), process_cpu_seconds()
                last_busy, last_wall, last_cpu = busy, now, cpu
                metrics_log.log(step + 1, step + 1, metrics)
                rewards.append(float(metrics.get("reward/mean", 0.0)))
                if display is not None:
                    display.update(step + 1, {**shown_trend, **metrics})
                is_last = is_finished = step + 1 == trainer.total_steps
                if (step + 1) % trainer.checkpoint_every == 0 or is_last:
                    save_checkpoint(run_dir, step + 1, {"learner": learner.state_dict(), "rng": rng_state(),
                                                        "rollout": manager.state()},
                                    {"version": step + 1, "config": config.model_dump(mode="json")},
                                    keep=trainer.keep_checkpoints)
                if stop_after_step is not None and step + 1 >= stop_after_step:
                    break
    if is_finished:
        export_model(learner, runtime.tokenizer, run_dir / "export")
    steps_done = len(rewards)
    change = None
    if heldout is not None and evaluations:
        first = heldout.stored(0)
        if first is not None and evaluations[-1].version > 0:
            change = paired_change(first, evaluations[-1])
    wall_s = time.perf_counter() - started
    eval_s = sum(result.seconds for result in evaluations)
    phases = {"RL": wall_s - eval_s, **({"held-out eval": eval_s} if evaluations else {})}
    block = min(10, max(1, len(rewards) // 2))  # a short run compares its halves, not itself with itself
    return TrainSummary(steps_done, rewards[:block], rewards[-block:], wall_s, run_dir,
                        heldout=evaluations, heldout_change=change, phases=phases)
