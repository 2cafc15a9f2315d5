"""One training run in this process (`launcher: local`): engine, tool, rollout manager and learner side by
side (`run.train.trainer.train`), with the evaluations of the live engine (`run.launch.evaluators`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from configs.schema import RunConfig
from configs.task_schema import TaskConfig
from run.launch.evaluators import run_evaluators
from run.observability.live_activity import heartbeat
from run.train.learner_setup import build_learner
from run.train.trainer import TrainSummary, train
from run.train.wiring import task_runtime

log = logging.getLogger(__name__)


async def run_local(
    config: RunConfig, task: TaskConfig, task_path: Path, settings: Any, cache_dir: Path, run_dir: Path, *,
    progress: bool = True, stop_after_step: int | None = None, report: Callable[[str], None] = log.info,
) -> TrainSummary:
    """Train `config` on `task` in this process (`launcher: local`); resumes when run_dir has a checkpoint.
    `report`: where the start-up's heartbeat lines go (the engine may compile for minutes)."""
    from rollout.models import load_tokenizer, resolve_model

    started = time.perf_counter()
    async with contextlib.AsyncExitStack() as stack:
        with heartbeat(report, "starting the rollout engine, the learner and the tool sandbox"):
            resolved = resolve_model(config.model.path, cache_dir)
            tokenizer = load_tokenizer(config.model.path, cache_dir)
            learner = build_learner(config, task, cache_dir)
            runtime = await stack.enter_async_context(task_runtime(
                task, task_path, model_dir=resolved.name_or_path, tokenizer=tokenizer, settings=settings,
                which="train"))
        heldout, eval_sets = await run_evaluators(stack, config, runtime, task_path, run_dir)
        startup_s = time.perf_counter() - started
        summary = await train(config, runtime, learner, run_dir, progress=progress,
                              stop_after_step=stop_after_step, heldout=heldout, eval_sets=eval_sets)
    summary.phases = {"startup": startup_s, **summary.phases}
    return summary
