"""The run's evaluators on the engine that serves its policy — the local engine, or launcher=ray's rollout
workers through the driver: the task's held-out set (`trainer.eval_every`) and each of `trainer.eval_sets`.
Both launchers build them here, so their prompts, sampling, files and resume are the same."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

from agent_env.datasets import load_samples
from agent_env.evaluation.heldout import HeldoutEvaluator, select_heldout
from agent_env.loop import EpisodeSettings
from agent_env.runtime import TaskRuntime, episode_settings
from configs.loader import ConfigError
from configs.schema import EvalSetConfig, RunConfig
from configs.task_schema import TaskConfig
from run.train.trainer import EvalSetRun
from run.train.wiring import eval_set_parts

log = logging.getLogger(__name__)


async def run_evaluators(stack: contextlib.AsyncExitStack, config: RunConfig, runtime: TaskRuntime,
                         task_path: Path, run_dir: Path) -> tuple[HeldoutEvaluator | None, list[EvalSetRun]]:
    """The held-out evaluator (None when trainer.eval_every is 0) and one per `trainer.eval_sets` entry,
    evaluating `runtime`'s engine; an eval set's own tools start on `stack`."""
    heldout = heldout_evaluator(config, runtime, task_path, run_dir) if config.trainer.eval_every else None
    eval_sets = [EvalSetRun(spec.name, spec.every, await eval_set_evaluator(
                     stack, spec, config, runtime, task_path, run_dir, heldout))
                 for spec in config.trainer.eval_sets]
    return heldout, eval_sets


def heldout_evaluator(config: RunConfig, runtime: TaskRuntime, task_path: Path, run_dir: Path
                      ) -> HeldoutEvaluator:
    """The trainer's held-out evaluation of `runtime`'s task: the task's heldout_dataset less every
    training prompt, the first `trainer.eval_samples`, sampled as the training rollouts are (or at
    `trainer.eval_temperature`), with one fixed seed per (prompt, sample) across versions."""
    task, trainer = runtime.task, config.trainer
    loaded = load_samples(task, which="heldout", task_dir=task_path.parent)
    chosen = select_heldout(loaded.samples, runtime.samples, task.prompt.system, task.prompt.user,
                            trainer.eval_samples, source=loaded.source)
    log.info("held-out evaluation: %d prompts of %s (%d overlapping training prompts dropped), k = %d, "
             "every %d steps", len(chosen.samples), chosen.source, chosen.overlapping, trainer.eval_k,
             trainer.eval_every)
    settings = _heldout_settings(config, task)
    return HeldoutEvaluator(chosen, engine=runtime.engine, tokenizer=runtime.tokenizer, tool=runtime.tool,
                            system=task.prompt.system, user=task.prompt.user, reward=runtime.reward,
                            settings=settings, k=trainer.eval_k, out_dir=run_dir / "eval",
                            concurrency=trainer.eval_concurrency, task_name=task.name,
                            program=getattr(runtime, "program", None))


async def eval_set_evaluator(stack: contextlib.AsyncExitStack, spec: EvalSetConfig, config: RunConfig,
                             runtime: TaskRuntime, task_path: Path, run_dir: Path,
                             heldout: HeldoutEvaluator | None) -> HeldoutEvaluator:
    """The evaluator of `trainer.eval_sets` entry `spec` on the live engine (`EvalSetConfig`): its prompts
    less the training prompts and the held-out set's, the first `spec.samples`; a task of its own is sampled
    by its `eval` section, the run's task as its held-out set is; files under run_dir/eval/<name>/."""
    parts = await eval_set_parts(stack, spec, runtime, task_path, runtime.tokenizer)
    if parts.own_task and parts.task.loop.program is not None:
        raise ConfigError(f"trainer.eval_sets[{spec.name}]", [
            f"its task {parts.task.name} is an agent program (loop.program): an eval set with a task of its "
            "own runs the built-in loop; evaluate the program with `vcpo eval` on its task file"])
    prompt = parts.task.prompt
    exclude = [*runtime.samples, *(heldout.heldout.samples if heldout is not None else ())]
    try:
        chosen = select_heldout(parts.samples, exclude, prompt.system, prompt.user,
                                spec.samples or len(parts.samples), source=parts.source)
    except ValueError as exc:
        raise ConfigError(f"trainer.eval_sets[{spec.name}]", [str(exc)]) from None
    if parts.own_task:
        settings = episode_settings(parts.task, seed=config.seed, for_eval=True)
        k = spec.k or parts.task.eval.k
    else:
        settings, k = _heldout_settings(config, parts.task), spec.k or config.trainer.eval_k
    log.info("eval set %s: %d prompts of %s (%d overlapping training or held-out prompts dropped), k = %d, "
             "every %s", spec.name, len(chosen.samples), chosen.source, chosen.overlapping, k,
             f"{spec.every} steps" if spec.every else "run (before the first step and after the last)")
    return HeldoutEvaluator(chosen, engine=runtime.engine, tokenizer=runtime.tokenizer, tool=parts.tool,
                            system=prompt.system, user=prompt.user, reward=parts.reward, settings=settings,
                            k=k, out_dir=run_dir / "eval" / spec.name,
                            concurrency=config.trainer.eval_concurrency, task_name=parts.task.name,
                            label=spec.name,
                            program=None if parts.own_task else getattr(runtime, "program", None))


def _heldout_settings(config: RunConfig, task: TaskConfig) -> EpisodeSettings:
    """The held-out evaluation's sampling: the training rollouts', at trainer.eval_temperature if set."""
    settings = episode_settings(task, seed=config.seed)
    if config.trainer.eval_temperature is not None:
        settings = dataclasses.replace(settings, temperature=config.trainer.eval_temperature)
    return settings
