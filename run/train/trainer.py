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
checkpoint with the same lag bound, and no group is lost or used twice (rollout/manager.py). With
`rollout.max_lag: auto` the bound follows the measured ESS (rollout/lag_control.py): after each step the
controller judges the batch and moves the manager's bound; its state is checkpointed with the rest.
With `rollout.simulated_clock` (benchmarks) the admissions follow a simulated timeline
(rollout/sim_clock.py): the lags, the learner's waiting that the controller acts on and the `sim/*` metrics
are the timeline's, the learning is real.

What it does not do: read config files (the CLI does), run episodes or groups (agent_env/runtime.py)
or know any engine/tool/task specifics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from agent_env.evaluation.heldout import HeldoutChange, HeldoutEvaluator, HeldoutResult
from agent_env.runtime import RolloutRuntime
from configs.schema import RunConfig
from configs.task_schema import TaskConfig
from learner.backends.torch_learner import StepInput
from rollout.errors import EngineUnavailable
from rollout.lag_control import ROLLOUT_MAX_LAG, LagController, LagControlSettings, idle_fraction
from rollout.manager import GroupTicket, RolloutManager
from rollout.openmp import release_openmp_threads
from rollout.sim_clock import ClockSettings, SimulatedClock
from rollout.trajectory import Trajectory
from run.observability import metric_names as names
from run.observability.live_activity import LiveActivity, ticking
from run.observability.metrics_log import MetricsLogger
from run.observability.progress import ProgressLine
from run.observability.trajectory_log import TrajectoryLog
from run.observability.trend import LearningSignal
from run.train.checkpointing import (
    latest_checkpoint,
    load_checkpoint,
    restore_rng_state,
    rng_state,
    save_checkpoint,
)
from run.train.evaluations import EvalSetRun, Evaluations
from run.train.step_resources import process_cpu_seconds, step_and_trim
from tools.base import ToolUnavailableError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


class Learner(Protocol):
    """What `train` needs of a learner: `TorchLearner`, or the Ray launcher's proxy of learner actors."""

    device: torch.device

    def step(self, batch: StepInput) -> dict[str, Any]: ...

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def save_pretrained(self, path: Path) -> None: ...


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
            lags.append(ticket.lag_of(trajectory, version))
            is_void = task.filters.mask_void_turns and trajectory.task.void_turns > 0
            is_cut = task.filters.remove_truncated and trajectory.task.is_truncated
            trained.append(not (is_void or is_cut))
    return StepInput(trajectories, group_ids, lags, trained)


def simulated_clock(config: RunConfig) -> SimulatedClock | None:
    """The timeline of `rollout.simulated_clock` (rollout/sim_clock.py); None = real time."""
    clock = config.rollout.simulated_clock
    if clock is None:
        return None
    # the schema's section documents and validates the owner's settings field for field (a test keeps them
    # the same names), so it converts whole
    seed = config.seed if clock.seed is None else clock.seed
    settings = ClockSettings(**{**clock.model_dump(), "seed": seed})
    return SimulatedClock(settings, groups_per_batch=config.rollout.groups_per_step,
                          group_size=config.algo.group_size, total_batches=config.trainer.total_steps)


def lag_controller(config: RunConfig) -> LagController | None:
    """The controller of `rollout.max_lag: auto` (rollout/lag_control.py); None with a fixed bound."""
    rollout = config.rollout
    if rollout.max_lag != "auto":
        return None
    return LagController(LagControlSettings(**rollout.auto_lag.model_dump()))  # the same fields (a test)


def segment_lags(trajectory: Trajectory, version: int) -> list[int]:
    """The lag of each segment that sampled a token: `version` minus the version its first sampled token
    came from. An episode that compacts its history over many policy versions has fresh later segments
    beside a stale first one; the episode's lag (`staleness/*`) is its first segment's."""
    per_token = trajectory.versions.per_token
    if per_token is None:
        return [version - trajectory.versions.start] if trajectory.num_sampled_tokens else []
    lags = []
    for start, stop in trajectory.segments:
        sampled = [per_token[t] for t in range(start, stop) if trajectory.loss_mask[t]]
        if sampled:
            lags.append(version - min(sampled))
    return lags


def rollout_metrics(batch: StepInput, version: int) -> dict[str, float]:
    """Episode statistics of a minibatch (rollout/*, tokens/generated, staleness/segment_*)."""
    trajectories = batch.trajectories
    n = max(1, len(trajectories))
    lags = [lag for trajectory in trajectories for lag in segment_lags(trajectory, version)]
    return {
        names.ROLLOUT_SEGMENTS_MEAN: sum(len(t.segment_starts) for t in trajectories) / n,
        names.ROLLOUT_COMPACTIONS_MEAN: sum(t.task.compactions for t in trajectories) / n,
        names.STALENESS_SEGMENT_MEAN: sum(lags) / max(1, len(lags)),
        names.STALENESS_SEGMENT_MAX: float(max(lags, default=0)),
        "rollout/turns_mean": sum(t.task.turns for t in trajectories) / n,
        "rollout/tool_calls_mean": sum(t.task.tool_calls for t in trajectories) / n,
        "rollout/tool_errors_mean": sum(t.task.tool_errors for t in trajectories) / n,
        "rollout/truncated_frac": sum(t.task.is_truncated for t in trajectories) / n,
        "rollout/void_turn_frac": sum(t.task.void_turns > 0 for t in trajectories) / n,
        "rollout/response_tokens_mean": sum(t.num_sampled_tokens for t in trajectories) / n,
        "rollout/filtered_frac": sum(not kept for kept in batch.is_trained) / n,
        "tokens/generated": float(sum(t.num_sampled_tokens for t in trajectories)),
        names.TOKENS_LEARNER_INPUT: float(sum(len(t.token_ids) for t in trajectories)),
        "tool/parse_errors": float(sum(t.task.tool_parse_errors for t in trajectories)),
        "tool/unknown": float(sum(t.task.tool_unknown for t in trajectories)),
    }


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
    eval_sets: dict[str, list[HeldoutResult]] = field(default_factory=dict)
    """Each eval set's evaluations of this process (trainer.eval_sets)."""
    eval_set_changes: dict[str, HeldoutChange] = field(default_factory=dict)
    """Each eval set's first evaluation → its last, paired by prompt (where both exist)."""
















async def train(config: RunConfig, runtime: RolloutRuntime, learner: Learner, run_dir: Path, *,
                progress: bool = True, stop_after_step: int | None = None,
                heldout: HeldoutEvaluator | None = None,
                eval_sets: Sequence[EvalSetRun] = ()) -> TrainSummary:
    """Train `config.trainer.total_steps` steps (resuming from run_dir's newest checkpoint if any); with
    `heldout`, evaluate the held-out prompts at the versions `is_eval_version` names, and each of `eval_sets`
    before the first step, when it is due and after the last."""
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer, rollout = config.trainer, config.rollout
    lag_control = lag_controller(config)
    manager = _rollout_manager(config, runtime, lag_control)
    start_step = await _resume(run_dir, learner, manager, lag_control)
    evals = Evaluations(heldout, trainer.eval_every, eval_sets, trainer.total_steps)
    evals.discard_after(start_step)  # a resumed run retrains the versions after its checkpoint
    rewards: list[float] = []
    signal = LearningSignal(run_dir, start_step)
    shown_trend: dict[str, float] = {}
    is_finished = False
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        learner_thread, trajectory_log, metrics_log, display, live = _step_loop_outputs(
            stack, config, runtime, run_dir, start_step, progress)
        async with manager, ticking(live):
            if evals.any and metrics_log.last_step is None:
                # the policy RL starts from (after the warm start), logged as trainer_step 0
                metrics_log.log(0, 0, await evals.run(0, live, display))
            last_busy, last_wall = manager.busy_seconds(), time.perf_counter()
            last_cpu = process_cpu_seconds()
            for step in range(start_step, trainer.total_steps):
                if stop_after_step is not None and step >= stop_after_step:
                    break  # --stop-after-step 0: the evaluations of the starting policy, no RL step
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
                metrics = await asyncio.get_running_loop().run_in_executor(learner_thread, step_and_trim,
                                                                           learner, batch)
                train_s = time.perf_counter() - tick
                if manager.clock is not None:  # the timeline's step, not the machine's
                    metrics.update(manager.clock.metrics(step))
                # before the push: a lowered bound admits nothing more first
                metrics.update(await _judge_lag(lag_control, manager, metrics, groups, step,
                                                idle_learner, train_s))
                if live is not None:
                    live.begin(step + 1, "weight push")
                tick = time.perf_counter()
                await manager.sync_weights(learner.named_weights(), step + 1)
                sync_s = time.perf_counter() - tick
                now, busy, cpu = time.perf_counter(), manager.busy_seconds(), process_cpu_seconds()
                metrics.update(rollout_metrics(batch, step))
                metrics.update({
                    "time/train": train_s, "time/weight_sync": sync_s, "time/idle_learner": idle_learner,
                    "time/generate": busy - last_busy,
                    "time/idle_rollout": (now - last_wall) - (busy - last_busy),
                    "time/step": now - last_wall, "time/cpu": cpu - last_cpu,
                    "perf/tokens_per_s": metrics["tokens/generated"] / max(1e-9, now - last_wall),
                    "rollout/failed_groups": manager.counters.groups_failed})
                trained_rewards = [t.reward for t in batch.trajectories]
                if rollout.dynamic_sampling:
                    metrics.update(_refill_metrics(manager, trained_rewards))
                metrics.update(runtime.counters())
                trend = signal.update(step + 1, trained_rewards)
                metrics.update(trend)
                shown_trend = trend or shown_trend  # the line keeps the latest trend between updates
                falling = signal.warning(step + 1, trend)
                if falling is not None:
                    if display is not None:
                        display.message(falling)
                    log.warning("%s", falling)
                evaluated = await evals.run(step + 1, live, display)
                if evaluated:  # the evaluations' wall time is their own (time/eval), not the next step's
                    metrics.update(evaluated)
                    now, busy, cpu = time.perf_counter(), manager.busy_seconds(), process_cpu_seconds()
                last_busy, last_wall, last_cpu = busy, now, cpu
                metrics_log.log(step + 1, step + 1, metrics)
                rewards.append(float(metrics.get("reward/mean", 0.0)))
                if display is not None:
                    display.update(step + 1, {**shown_trend, **metrics})
                is_last = is_finished = step + 1 == trainer.total_steps
                if (step + 1) % trainer.checkpoint_every == 0 or is_last:
                    _checkpoint(config, run_dir, step + 1, learner, manager, lag_control)
                if stop_after_step is not None and step + 1 >= stop_after_step:
                    break
    if is_finished:
        export_model(learner, runtime.tokenizer, run_dir / "export")
    return _summary(rewards, time.perf_counter() - started, run_dir, evals)


def _step_loop_outputs(stack: contextlib.ExitStack, config: RunConfig, runtime: RolloutRuntime, run_dir: Path,
                       start_step: int, progress: bool) -> tuple[ThreadPoolExecutor, TrajectoryLog | None,
                                                                 MetricsLogger, ProgressLine | None,
                                                                 LiveActivity | None]:
    """What the step loop writes to and runs on, closed by `stack`: the learner's thread, the trajectory and
    metrics logs (resumed at `start_step`), the progress line and its live activity."""
    trainer = config.trainer
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
        live = LiveActivity(display, runtime, config.rollout.groups_per_step * config.algo.group_size)
    return learner_thread, trajectory_log, metrics_log, display, live


def _summary(rewards: list[float], wall_s: float, run_dir: Path, evals: Evaluations) -> TrainSummary:
    eval_s = evals.seconds()
    phases = {"RL": wall_s - eval_s, **({"held-out eval": eval_s} if eval_s else {})}
    block = min(10, max(1, len(rewards) // 2))  # a short run compares its halves, not itself with itself
    return TrainSummary(len(rewards), rewards[:block], rewards[-block:], wall_s, run_dir,
                        heldout=evals.heldout_results, heldout_change=evals.heldout_change(), phases=phases,
                        eval_sets=evals.set_results, eval_set_changes=evals.set_changes())


def _rollout_manager(config: RunConfig, runtime: RolloutRuntime, lag_control: LagController | None
                     ) -> RolloutManager:
    """The run's rollout manager: its lag bound (the controller's, when `max_lag: auto`), admission,
    retries, dynamic sampling and (for simulations) the clock."""
    rollout = config.rollout
    return RolloutManager(
        runtime.engine, runtime.group_runner(config.algo.group_size, config.seed),
        groups_per_batch=rollout.groups_per_step,
        max_lag=lag_control.bound if lag_control is not None else rollout.lag_ceiling,
        max_concurrent_groups=(rollout.max_concurrent_groups
                               or rollout.groups_per_step * (rollout.lag_ceiling + 1)),
        max_attempts=rollout.max_group_attempts, fatal_errors=(EngineUnavailable, ToolUnavailableError),
        total_batches=config.trainer.total_steps, saturate=rollout.saturate_lag,
        accept=has_signal if rollout.dynamic_sampling else None, max_refills=rollout.max_refills_per_step,
        clock=simulated_clock(config))


async def _resume(run_dir: Path, learner: Learner, manager: RolloutManager,
                  lag_control: LagController | None) -> int:
    """Restore run_dir's newest checkpoint (learner, RNG, rollout state, the lag bound in force when it was
    written) and push its weights; the step to start from (0 without one)."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return 0
    state, meta = load_checkpoint(checkpoint, map_location=learner.device)
    learner.load_state_dict(state["learner"])
    restore_rng_state(state["rng"])
    manager.restore(state["rollout"])
    if lag_control is not None and "lag_control" in state:
        lag_control.restore(state["lag_control"])
        await manager.set_max_lag(lag_control.bound)
    start_step = int(meta["step"])
    log.info("resuming from %s (step %d)", checkpoint, start_step)
    await manager.sync_weights(learner.named_weights(), start_step)
    return start_step


async def _judge_lag(lag_control: LagController | None, manager: RolloutManager, metrics: dict[str, Any],
                     groups: Sequence[Any], step: int, idle_learner: float, train_s: float
                     ) -> dict[str, float]:
    """With `max_lag: auto`, let the controller judge the step (ESS, the learner's waiting share, the
    groups' bounds) and apply its bound; its metrics. Otherwise the fixed bound as a metric."""
    if lag_control is None:
        return {ROLLOUT_MAX_LAG: float(manager.max_lag)}
    waited_share = (manager.clock.step(step).idle_fraction if manager.clock is not None
                    else idle_fraction(idle_learner, train_s))
    ess = metrics.get(names.IS_ESS_RATIO)
    mismatch = metrics.get(names.IS_MISMATCH_ESS_RATIO)
    move = lag_control.update(float("nan") if ess is None else float(ess), waited_share,
                              [ticket.lag_bound for ticket, _ in groups],
                              None if mismatch is None else float(mismatch))
    await manager.set_max_lag(move.bound)
    return lag_control.metrics(move, waited_share)


def _refill_metrics(manager: RolloutManager, trained_rewards: list[float]) -> dict[str, float]:
    """Dynamic sampling's step: refills, groups refilled, their tokens, episodes dropped, and the mean
    reward of everything generated (trained and dropped)."""
    dropped = manager.last_batch_dropped_rewards
    generated = trained_rewards + dropped
    return {names.ROLLOUT_REFILLS: manager.last_batch_refills,
            names.ROLLOUT_REFILLED_GROUPS: manager.counters.groups_refilled,
            names.ROLLOUT_REFILL_TOKENS: manager.counters.refill_tokens,
            names.ROLLOUT_DROPPED_EPISODES: len(dropped),
            names.ROLLOUT_REWARD_MEAN_GENERATED: sum(generated) / len(generated)}


def _checkpoint(config: RunConfig, run_dir: Path, version: int, learner: Learner, manager: RolloutManager,
                lag_control: LagController | None) -> None:
    save_checkpoint(run_dir, version, {"learner": learner.state_dict(), "rng": rng_state(),
                                       "rollout": manager.state(),
                                       **({"lag_control": lag_control.state()} if lag_control is not None
                                          else {})},
                    {"version": version, "config": config.model_dump(mode="json")},
                    keep=config.trainer.keep_checkpoints)
