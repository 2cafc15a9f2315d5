"""`vcpo bench async`: the same training workload at lag bounds k = 0, 1, 2, 4 — wall time and where it went.

Each k trains `steps` optimizer steps from the same initial weights, seed and data order, in a fresh
run directory, with the engine and learner built anew (their start-up, and the warm start, which is
cached after the first k, are excluded: the clock runs from the first admitted group to the last step's
weight sync). The split per k:
* learner side: train (the optimizer steps), weight_sync, idle_learner (waiting for a batch);
* rollout side: generate (≥ 1 group in flight) and idle_rollout (nothing admissible: the lag bound
  or the concurrency cap held generation back).
At k = 0 generation and training alternate; with k ≥ 1 they overlap, so the speedup over k = 0 is
what asynchrony buys on this machine. On a 2-core CPU both sides compete for the same cores, so
the overlap gains less than on a GPU box where the engine and learner own separate devices.

**Fill, drain and steady state.** With lag bound k the engine may start (k + 1) steps' groups at once, so
the first k + 1 steps are a pipeline fill (one large generation batch, then steps that find their data
waiting), and once the last step's groups are admitted the engine stops, so the last k steps train alone
(a drain). A long run pays both once. `steady_step_s` is the mean step between them, and
`steady_speedup_vs_k0` compares it with k = 0's: the rate a 100-step run sees. `wall_s` and
`speedup_vs_k0` include fill and drain and are only comparable between runs of the same length.

**A step's time depends on its data**: a step whose groups are all degenerate (every episode scored the
same; VCPO skips their gradient pass) is a fraction of one with informative groups, and each k draws its
own mix. `steady_step_s_on_k0_mix` is this k's steady mean per kind of step (its count of degenerate
groups) averaged over k = 0's steady steps (benchmarks/step_mix.py; None when this k never timed
a kind k = 0 had), and `mixed_speedup_vs_k0` the speedup on that common mix.

**Two things asynchrony can buy.** Overlap (the learner trains while the engine generates) and batching
(up to (k + 1) × groups_per_step groups decode together). `gen_tokens_per_s`, tokens per second of
generation, shows what the engine nets at each k beside the learner.

The most overlap can give (`overlap_bound`, from the k = 0 run's steady steps) is the smaller of
`by_overlap` = (generate + train + weight sync) ÷ max(generate, train + weight sync), both sides entirely
overlapped and neither slowed by the other, and `by_cores` = 1 / utilisation (CPU-seconds over wall ×
cores): the same CPU work cannot finish sooner than CPU-seconds ÷ cores. On a machine whose cores both
sides share, `by_cores` is the one that binds: docs/performance.md measured each side's busy time doubling
beside the other. It is an estimate, not a strict bound: CPU-seconds include OpenMP workers
spinning between parallel regions (up to ~300,000 iterations each while a process's teams fit its cores),
and overlap can turn part of that spin into work (141 CPU-seconds at k = 0, 102 at k = 4 for the same
steps once, on a workload without a gradient pass). `gap_to_bound` = bound ÷ measured speedup (the
mix-adjusted one where there is one). Per k, `pipeline_gap` = steady step ÷ the slower side's busy time
per steady step in that same run: 1 when the pipeline never waits on anything but its slower side.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.schema import AsyncBenchConfig
from benchmarks.step_mix import mean_by_kind, mix_adjusted_mean
from configs.loader import load_config
from configs.schema import RunConfig
from run.launch.host import host_description
from run.launch.training import run_training
from run.observability.metrics_log import read_metrics
from run.train.wiring import engine_settings, load_task

_SUMS = {"train_s": "time/train", "weight_sync_s": "time/weight_sync", "idle_learner_s": "time/idle_learner",
         "generate_s": "time/generate", "idle_rollout_s": "time/idle_rollout", "tokens": "tokens/generated",
         "cpu_s": "time/cpu", "step_wall_s": "time/step", "degenerate_groups": "train/degenerate_groups",
         "skipped_groups": "train/skipped_groups", "trained_tokens": "tokens/trained"}


def _sums(records: list[dict[str, Any]]) -> dict[str, float]:
    return {name: sum(float(r.get(key) or 0.0) for r in records) for name, key in _SUMS.items()}


def steady_window(lag: int, steps: int) -> tuple[int, int]:
    """(first, end) indices of the steady steps of a `steps`-step run at lag bound `lag`: after the fill
    (the first lag + 1 steps; k = 0's first step holds the engine's first, slower batch) and before the
    drain (the last `lag` steps), keeping at least one step."""
    first = max(0, min(lag + 1, steps - 1))
    end = max(first + 1, steps - lag) if steps else 0
    return first, min(end, steps)


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
    # the final checkpoint (~1.6 GB for the default model with AdamW state) and the exported policy
    # (~0.5 GB) are of no use to a timing
    for kept in ("checkpoints", "export"):
        shutil.rmtree(run_dir / kept, ignore_errors=True)
    return lag_row(lag, read_metrics(run_dir), summary.steps, summary.wall_s)


def lag_row(lag: int, records: list[dict[str, Any]], steps: int, wall_s: float) -> dict[str, Any]:
    """One k's row of the report from its run's per-step metrics."""
    records = sorted(records, key=lambda r: int(r.get("trainer_step") or 0))
    row: dict[str, Any] = {"max_lag": lag, "steps": steps, "wall_s": wall_s, **_sums(records)}
    row["tokens_per_s"] = row["tokens"] / max(wall_s, 1e-9)
    row["gen_tokens_per_s"] = row["tokens"] / max(row["generate_s"], 1e-9)
    row["cores"] = _cores()
    row["utilization"] = row["cpu_s"] / max(row["step_wall_s"] * row["cores"], 1e-9)
    row["reward_mean"] = sum(float(r.get("reward/mean") or 0.0) for r in records) / max(1, len(records))
    row["mean_lag"] = sum(float(r.get("staleness/mean") or 0.0) for r in records) / max(1, len(records))
    row["max_lag_seen"] = max((float(r.get("staleness/max") or 0.0) for r in records), default=0.0)
    first, end = steady_window(lag, len(records))
    steady = records[first:end]
    row["fill_steps"], row["drain_steps"] = first, len(records) - end
    row["steady"] = _sums(steady) | {"steps": len(steady)}
    row["steady_step_s_list"] = [float(r.get("time/step") or 0.0) for r in steady]
    row["steady_degenerate_groups_list"] = [float(r.get("train/degenerate_groups") or 0.0) for r in steady]
    row["steady_step_s_by_degenerate_groups"] = mean_by_kind(row["steady_step_s_list"],
                                                             row["steady_degenerate_groups_list"])
    steady_capacity = row["steady"]["step_wall_s"] * row["cores"]
    row["steady_utilization"] = row["steady"]["cpu_s"] / max(steady_capacity, 1e-9)
    n = max(1, len(steady))
    row["steady_step_s"] = row["steady"]["step_wall_s"] / n
    steady_learner = row["steady"]["train_s"] + row["steady"]["weight_sync_s"]
    slower_side = max(row["steady"]["generate_s"], steady_learner) / n
    row["pipeline_gap"] = row["steady_step_s"] / max(slower_side, 1e-9)
    return row


def run_async_bench(bench: AsyncBenchConfig, cache_dir: Path,
                    progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Measure every k in `bench.lags` (sequentially); JSON-able result with speedups over k = 0."""
    rows = []
    for lag in bench.lags:
        progress(f"[bench async] k={lag}: {bench.steps} steps ...")
        rows.append(_one_lag(bench, lag, cache_dir))
        progress(f"[bench async] k={lag}: {rows[-1]['wall_s']:.1f} s, "
                 f"steady step {rows[-1]['steady_step_s']:.1f} s")
    return {"benchmark": "async", "run_config": bench.run_config, "overrides": bench.overrides,
            "steps": bench.steps, "host": host_description(), **compare_lags(rows)}


def compare_lags(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows with their speedups over k = 0, and the overlap bound from the k = 0 row."""
    base = next((row for row in rows if row["max_lag"] == 0), None)
    bound = overlap_bound(base) if base else None
    for row in rows:
        row["speedup_vs_k0"] = base["wall_s"] / row["wall_s"] if base else None
        row["steady_speedup_vs_k0"] = base["steady_step_s"] / row["steady_step_s"] if base else None
        row["gen_speedup_vs_k0"] = row["gen_tokens_per_s"] / base["gen_tokens_per_s"] if base else None
        on_mix = (mix_adjusted_mean(row["steady_step_s_by_degenerate_groups"],
                                    base["steady_degenerate_groups_list"]) if base else None)
        row["steady_step_s_on_k0_mix"] = on_mix
        row["mixed_speedup_vs_k0"] = base["steady_step_s"] / on_mix if base and on_mix else None
        if bound is not None and row["max_lag"] > 0:
            measured = row["mixed_speedup_vs_k0"] or row["steady_speedup_vs_k0"]
            row["gap_to_bound"] = bound["speedup"] / measured
    return {"overlap_bound": bound, "rows": rows}


def overlap_bound(k0: dict[str, Any]) -> dict[str, float]:
    """The most speedup overlapping generation and training can give over the k = 0 run `k0`, from its
    steady steps: the smaller of (generate + train + sync) ÷ max(generate, train + sync) and 1 / its
    utilisation (see the module docstring for why the second is an estimate)."""
    steady = k0["steady"]
    learner = steady["train_s"] + steady["weight_sync_s"]
    by_overlap = (steady["generate_s"] + learner) / max(steady["generate_s"], learner, 1e-9)
    by_cores = 1.0 / max(k0["steady_utilization"], 1e-9)
    return {"by_overlap": by_overlap, "by_cores": by_cores, "speedup": min(by_overlap, by_cores)}


def _cores() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
