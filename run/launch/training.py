"""`run_training`: one training run from its validated config — the cold-start SFT first when the config
asks for it, then the run itself in this process (`launcher: local`) or across a Ray cluster
(`launcher: ray`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_env.evaluation.heldout import HeldoutChange, HeldoutResult
from configs.loader import ConfigError
from configs.schema import RunConfig
from configs.task_schema import TaskConfig
from run.observability.console import terminal
from run.observability.metrics_log import atomic_write_text
from run.train.checkpointing import resume_conflicts
from run.train.trainer import TrainSummary

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
    phases: dict[str, float] = {}
    run_started = time.perf_counter()
    report = (lambda line: print(line, file=terminal(), flush=True)) if progress else log.info
    if config.warm_start.enabled:  # cold-start SFT first (cached); RL then starts from that model
        started = time.perf_counter()
        warm = await _warm_start_in_thread(config, task, task_path, cache_dir, report)
        phases["warm start"] = time.perf_counter() - started
        config = config.model_copy(update={"model": config.model.model_copy(update={"path": str(warm)})})
    backend = getattr(settings, "backend", "auto")
    report(f"starting the rollout engine ({backend}), the learner and the tool sandbox")
    if config.launcher == "ray":
        from run.launch.ray_launcher import run_training_ray

        summary = await run_training_ray(config, task, task_path, settings, cache_dir, run_dir,
                                         progress=progress, stop_after_step=stop_after_step, report=report)
    else:
        from run.launch.local import run_local

        summary = await run_local(config, task, task_path, settings, cache_dir, run_dir, progress=progress,
                                  stop_after_step=stop_after_step, report=report)
    summary.phases = {**phases, **summary.phases}
    write_run_summary(run_dir, summary, time.perf_counter() - run_started)
    return summary


SUMMARY_FILE = "summary.json"


def write_run_summary(run_dir: Path, summary: TrainSummary, wall_s: float) -> Path:
    """`run_dir/summary.json` (written atomically): what this process did — steps, wall seconds in all and by
    phase, the host, every held-out evaluation with its interval and the start → end change (and the same for
    each of trainer.eval_sets). A resumed run
    rewrites it with its own process's figures (earlier evaluations stay in metrics.jsonl)."""
    from run.launch.host import host_description

    def evaluation(result: HeldoutResult) -> dict[str, Any]:
        return {"step": result.version, "success": result.success, "low": result.low, "high": result.high,
                "prompts": len(result.per_prompt), "seconds": result.seconds}

    def paired(change: HeldoutChange | None) -> dict[str, Any] | None:
        if change is None:
            return None
        return {"start_step": change.start.version, "end_step": change.end.version, "gain": change.gain,
                "low": change.low, "high": change.high}

    record = {
        "steps_this_process": summary.steps, "wall_s": wall_s, "phases_s": summary.phases,
        "host": host_description(),
        "heldout": [evaluation(result) for result in summary.heldout],
        "heldout_change": paired(summary.heldout_change),
    }
    if summary.eval_sets:
        record["eval_sets"] = {name: {"evaluations": [evaluation(result) for result in results],
                                      "change": paired(summary.eval_set_changes.get(name))}
                               for name, results in summary.eval_sets.items()}
    path = run_dir / SUMMARY_FILE
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    return path


async def _warm_start_in_thread(config: RunConfig, task: TaskConfig, task_path: Path, cache_dir: Path,
                                report: Callable[[str], None]) -> Path:
    """`run_warm_start` off the event loop, so that a cancelled run (Ctrl-C: asyncio cancels the main
    task at its next await) stops it within one SFT step instead of after the whole warm start."""
    from run.train.warm_start import WarmStartStopped, run_warm_start

    stop = threading.Event()
    future = asyncio.get_running_loop().run_in_executor(
        None, functools.partial(run_warm_start, config, task, task_path, cache_dir, report, stop.is_set))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        stop.set()
        with contextlib.suppress(WarmStartStopped):
            await future
        raise
