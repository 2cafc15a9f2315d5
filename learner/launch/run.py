"""`run_training`: one training run from its validated config — the cold-start SFT first when the config
asks for it, then the run itself in this process (`launcher: local`) or across a Ray cluster
(`launcher: ray`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from configs.loader import ConfigError
from configs.schema import RunConfig
from configs.task_schema import TaskConfig
from learner.observability.console import terminal
from learner.train.checkpointing import resume_conflicts
from learner.train.trainer import TrainSummary

log = logging.getLogger(__name__)


async def run_training(
    config: RunConfig, task: TaskConfig, task_path: Path, settings: Any, cache_dir: Path, run_dir: Path, *,
    progress: bool = True, stop_after_step: int | None = None,
) -> TrainSummary:
    """Train `config` on `task` with the engine `settings`; resumes when run_dir has a checkpoint (refused
    up front, before any model loads, when the config changed what the checkpoint's batches depend on)."""
    conflicts = resume_conflicts(run_dir, config.model_dump(mode="json"))
    if conflicts:
        raise ConfigError(f"(resuming {run_dir})", conflicts)
    if config.warm_start.enabled:  # cold-start SFT first (cached); RL then starts from that model
        from learner.train.warm_start import run_warm_start

        report = (lambda line: print(line, file=terminal(), flush=True)) if progress else log.info
        warm = run_warm_start(config, task, task_path, cache_dir, report)
        config = config.model_copy(update={"model": config.model.model_copy(update={"path": str(warm)})})
    if config.launcher == "ray":
        from learner.launch.ray_launcher import run_training_ray

        return await run_training_ray(config, task, task_path, settings, cache_dir, run_dir,
                                      progress=progress, stop_after_step=stop_after_step)
    from learner.train.build import run_local

    return await run_local(config, task, task_path, settings, cache_dir, run_dir, progress=progress,
                           stop_after_step=stop_after_step)
