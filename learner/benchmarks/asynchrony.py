"""`vcpo bench async`: the same training workload at lag bounds k = 0, 1, 2, 4 — wall time and where it went.

Each k trains `steps` optimizer steps from the same initial weights, seed and data order, in a fresh
run directory, with the engine and learner built anew (their start-up is excluded: the clock runs
from the first admitted group to the last step's weight sync). The split per k:
* learner side: train (the optimizer steps), weight_sync, idle_learner (waiting for a batch);
* rollout side: generate (≥ 1 group in flight) and idle_rollout (nothing admissible: the lag bound
  or the concurrency cap held generation back).
At k = 0 generation and training alternate; with k ≥ 1 they overlap, so the speedup over k = 0 is
what asynchrony buys on this machine. On a 2-core CPU both sides compete for the same cores, so
the overlap gains less than on a GPU box where the engine and learner own separate devices.

The most overlap can give (`overlap_bound`, from the k = 0 run): with the same work on the same cores no
schedule beats its CPU-seconds ÷ cores, so at most 1 / utilisation (the k = 0 run's CPU-seconds,
`time/cpu`, over wall × cores); and with the two sides fully overlapped at most
(generate + train) / max(generate, train). The bound is the smaller; `gap` = bound ÷ measured speedup.
The first is only as good as "the same CPU work": CPU-seconds include OpenMP workers spinning between
parallel regions (up to ~300,000 iterations each while a process's teams fit its cores), and overlap turns
part of that spin into work, so a measured speedup can pass `by_cores` (`gap` < 1). Issue #19 measured
it on 2 cores: 141 CPU-seconds at k = 0, 102 at k = 4, for the same steps (docs/results.md).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from configs.loader import load_config
from configs.schema import AsyncBenchConfig, RunConfig
from learner.benchmarks.host import host_description
from learner.launch.run import run_training
from learner.observability.metrics_log import read_metrics
from learner.train.compose import engine_settings, load_task

_SUMS = {"train_s": "time/train", "weight_sync_s": "time/weight_sync", "idle_learner_s": "time/idle_learner",
         "generate_s": "time/generate", "idle_rollout_s": "time/idle_rollout", "tokens": "tokens/generated",
         "cpu_s": "time/cpu", "step_wall_s": "time/step"}


def _one_lag(bench: AsyncBenchConfig, lag: int, cache_dir: Path) -> dict[str, Any]:
    run_dir = Path(bench.run_root) / f"k{lag}"
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [*bench.overrides, f"rollout.max_lag={lag}", f"trainer.total_steps={bench.steps}",
                 f"run_dir={run_dir}", "trainer.checkpoint_every=1000000", "trainer.use_tensorboard=false"]
    config = load_config(bench.run_config, RunConfig, overrides)
    task, task_path = load_task(config.task, config.task_overrides,
                                relative_to=Path(bench.run_config).parent)
    settings = engine_settings(config.engine, bench.run_config)
    summary = asyncio.run(run_training(config, task, task_path, settings, cache_dir, run_dir, progress=False))
    records = read_metrics(run_dir)
    row: dict[str, Any] = {"max_lag": lag, "steps": summary.steps, "wall_s": summary.wall_s}
    for name, key in _SUMS.items():
        row[name] = sum(float(r.get(key) or 0.0) for r in records)
    row["tokens_per_s"] = row["tokens"] / max(summary.wall_s, 1e-9)
    row["cores"] = _cores()
    row["utilization"] = row["cpu_s"] / max(row["step_wall_s"] * row["cores"], 1e-9)
    row["reward_mean"] = sum(float(r.get("reward/mean") or 0.0) for r in records) / max(1, len(records))
    row["mean_lag"] = sum(float(r.get("staleness/mean") or 0.0) for r in records) / max(1, len(records))
    row["max_lag_seen"] = max((float(r.get("staleness/max") or 0.0) for r in records), default=0.0)
    return row


def run_async_bench(bench: AsyncBenchConfig, cache_dir: Path,
                    progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Measure every k in `bench.lags` (sequentially); JSON-able result with speedups over k = 0."""
    rows = []
    for lag in bench.lags:
        progress(f"[bench async] k={lag}: {bench.steps} steps ...")
        rows.append(_one_lag(bench, lag, cache_dir))
        progress(f"[bench async] k={lag}: {rows[-1]['wall_s']:.1f} s")
    base = next((row for row in rows if row["max_lag"] == 0), None)
    bound = overlap_bound(base) if base else None
    for row in rows:
        row["speedup_vs_k0"] = base["wall_s"] / row["wall_s"] if base else None
        if bound is not None and row["max_lag"] > 0:
            row["gap_to_bound"] = bound["speedup"] / row["speedup_vs_k0"]
    return {"benchmark": "async", "run_config": bench.run_config, "overrides": bench.overrides,
            "steps": bench.steps, "host": host_description(), "overlap_bound": bound, "rows": rows}


def overlap_bound(k0: dict[str, Any]) -> dict[str, float]:
    """The most speedup overlapping generation and training can give over the k = 0 run `k0`: the
    smaller of 1 / utilisation (the same CPU work on the same cores) and (generate + train) ÷
    max(generate, train) (both sides entirely overlapped)."""
    by_cores = 1.0 / max(k0["utilization"], 1e-9)
    by_overlap = (k0["generate_s"] + k0["train_s"]) / max(k0["generate_s"], k0["train_s"], 1e-9)
    return {"by_cores": by_cores, "by_overlap": by_overlap, "speedup": min(by_cores, by_overlap)}


def _cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
