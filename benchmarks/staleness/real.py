"""`vcpo bench staleness --config benchmarks/configs/staleness_real.yaml`: the staleness matrix on a real
language model doing the main job's agent task (SmolLM2-135M-Instruct, Countdown with the sandboxed Python
tool), where the synthetic preset (benchmarks/staleness/bench.py) uses a 0.55M-parameter toy.

Every run is `vcpo train` of the preset's `run_config` in a fresh process, started from one shared
warm-started policy (trained once with `warm_start_seed`, cached), with the method's `algo`, one lr for
every method, and the rollout manager in its stress mode (`rollout.saturate_lag`): every batch lags by
exactly min(k, step). The score is the final policy's held-out success (the task's held-out prompts,
never trained on, sampled as the rollouts are), evaluated by the trainer after the last step; the same
evaluation of the starting policy gives each run's paired gain over the start.

The starting policy's evaluation depends only on the seed (fixed per-(prompt, sample) sampling seeds),
the starting weights and the evaluation's settings (the run config, the overrides, `eval_samples`), so it
is made once per such start — by the first run of it — kept in `results_dir/start/` under a name keyed by
all of them, and placed into every later run of it before it starts, where the trainer finds it finished
and reuses it. A start with other settings finds no file and evaluates for itself; a stored file that turns
out to be of other settings all the same (its key does not cover the task file) is set aside by the trainer,
which evaluates afresh, and that evaluation replaces it in the store.

Finished runs are stored as small JSON rows in `results_dir` keyed by everything that decides them (the
run config and overrides, the method, lr, k, seed, steps, batch), each recording its starting weights'
digest: a seed's runs share one start (`seed_starts`: hosts' warm starts differ in their last bits); an
interrupted run resumes from its newest checkpoint, an interrupted matrix from its stored rows. The
tables, retention and plots are the synthetic preset's (benchmarks/staleness/bench.py).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_env.evaluation.heldout import paired_change, result_from_file
from benchmarks.staleness.bench import (
    CURVE_KEYS,
    _sorted,
    _store,
    _stored,
    compact_summary,
    matrix_tables,
    plot_staleness,
    policy_digest,
    results_dir,
    retention_table,
    settings_digest,
    summarize_curves,
    summary_table,
)
from benchmarks.staleness.bench import (
    number as metric_value,
)
from benchmarks.staleness.schema import StalenessMethodConfig, StalenessRealBenchConfig
from configs.loader import load_config
from configs.schema import RunConfig
from run.observability.metrics_log import read_metrics

Job = tuple[StalenessMethodConfig, int, int]
"""(method with its lr, lag k, seed)."""

START_DIR = "start"
"""Under results_dir: the starting policy's held-out evaluations (`start_store`)."""


def base_config(bench: StalenessRealBenchConfig, repo_root: Path) -> RunConfig:
    """`run_config` with the preset's overrides: what every run shares (validated here, once)."""
    return load_config(repo_root / bench.run_config, RunConfig, bench.overrides)


def prepare_policy(bench: StalenessRealBenchConfig, repo_root: Path, cache_dir: Path,
                   progress: Callable[[str], None]) -> Path:
    """The model every run starts from: the run config's warm-started one (trained once with
    `warm_start_seed`, then cached) when it warm-starts, else its `model.path` as it is."""
    from rollout.models import resolve_model
    from run.train.warm_start import run_warm_start
    from run.train.wiring import load_task

    config = base_config(bench, repo_root).model_copy(update={"seed": bench.warm_start_seed})
    if not config.warm_start.enabled:
        return Path(resolve_model(config.model.path, cache_dir).name_or_path)
    task, task_path = load_task(config.task, config.task_overrides,
                                relative_to=(repo_root / bench.run_config).parent)
    return run_warm_start(config, task, task_path, cache_dir, progress)


def matrix_jobs(bench: StalenessRealBenchConfig) -> list[Job]:
    """k = 0 first (the lr was fixed there, and a k = 0 row shows at once whether it learns), then the
    largest k (with k = 0 it answers the question: a matrix carried across sessions answers it halfway
    through), then the k between; within a k, seed by seed, so that each seed's starting evaluation is
    made once and reused."""
    chosen = [m for m in bench.methods if bench.only is None or m.name in bench.only]
    if bench.common_lr is not None:
        chosen = [m.model_copy(update={"lr": bench.common_lr}) for m in chosen]
    lags = sorted(bench.lags)
    order = lags[:1] + lags[-1:] + lags[1:-1] if len(lags) > 1 else lags
    return [(m, lag, seed) for lag in order for seed in bench.seeds for m in chosen]


def run_name(job: Job) -> str:
    method, lag, seed = job
    return f"{method.name}-lr{method.lr:g}-k{lag}-s{seed}"


def run_key(bench: StalenessRealBenchConfig, job: Job, repo_root: Path) -> str:
    """Everything in the configs that decides a run: the run config's text and the overrides, the run's
    shape, the method's algo and lr, k and the seed. The starting weights are not in the key (a summary is
    recomputed where the policy is absent): each row records their digest, checked before it is reused."""
    method, lag, seed = job
    decided_by = {"run_config": (repo_root / bench.run_config).read_text(), "overrides": bench.overrides,
                  "steps": bench.steps, "groups_per_step": bench.groups_per_step,
                  "group_size": bench.group_size, "eval_samples": bench.eval_samples,
                  "algo": method.algo, "lr": method.lr, "lag": lag, "seed": seed}
    return f"{run_name(job)}-{settings_digest(decided_by)}"


def start_store(bench: StalenessRealBenchConfig, seed: int, weights: str, repo_root: Path) -> Path:
    """Where the starting policy's evaluation for `seed` is kept: named by everything that decides it
    (the run config's text and the overrides, the number of held-out prompts, the seed, the weights), so
    that a run never reuses an evaluation made with other settings."""
    decided_by = {"run_config": (repo_root / bench.run_config).read_text(), "overrides": bench.overrides,
                  "eval_samples": bench.eval_samples, "seed": seed, "weights": weights}
    return results_dir(bench) / START_DIR / f"seed_{seed}-{settings_digest(decided_by)}.jsonl"


def run_overrides(bench: StalenessRealBenchConfig, job: Job, policy: Path, run_dir: Path) -> list[str]:
    """The `vcpo train` overrides of one run (after the preset's own): the method's algo keys replace the
    run config's, the rest pins what the matrix varies or fixes."""
    method, lag, seed = job
    return [*bench.overrides,
            f"seed={seed}", f"run_dir={run_dir}", f"model.path={policy}", "warm_start.enabled=false",
            f"optim.lr={method.lr}", f"rollout.max_lag={lag}", "rollout.saturate_lag=true",
            f"rollout.groups_per_step={bench.groups_per_step}", f"algo.group_size={bench.group_size}",
            *(f"algo.{key}={json.dumps(value)}" for key, value in method.algo.items()),
            f"trainer.total_steps={bench.steps}", f"trainer.eval_every={bench.steps}",
            f"trainer.eval_samples={bench.eval_samples}",
            f"trainer.checkpoint_every={bench.checkpoint_every}",
            "trainer.keep_checkpoints=1", "trainer.use_tensorboard=false"]


def code_version(repo_root: Path) -> str | None:
    """The commit the run's code is at (`+dirty` with uncommitted changes); None outside a git checkout.
    A matrix is carried across sessions, so each row says which code made it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo_root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo_root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def _version_file(run_dir: Path, version: int) -> Path:
    return run_dir / "eval" / f"version_{version:06d}.jsonl"


def _copy_atomically(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, target)


def _meta_line(path: Path) -> str:
    """An evaluation file's first line (its meta: the settings it was made with)."""
    with open(path, encoding="utf-8") as handle:
        return handle.readline()


def run_one(bench: StalenessRealBenchConfig, job: Job, policy: Path, weights: str, repo_root: Path,
            run_dir: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    """Train one (method, k, seed) with `vcpo train` (resuming its run directory if it holds a checkpoint)
    and return its row: curves, final and starting held-out success, the paired gain, time."""
    method, lag, seed = job
    stored_start = start_store(bench, seed, weights, repo_root)
    start_file = _version_file(run_dir, 0)
    if stored_start.is_file() and not (run_dir / "checkpoints").is_dir():
        _copy_atomically(stored_start, start_file)  # the trainer finds it finished and reuses it
    command = [sys.executable, "-m", "cli", "train", str(repo_root / bench.run_config), "--no-progress",
               *run_overrides(bench, job, policy, run_dir)]
    run_dir.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with open(run_dir / "bench.log", "a", encoding="utf-8") as log_file:
        finished = subprocess.run(command, cwd=repo_root, stdout=log_file, stderr=subprocess.STDOUT,
                                  check=False)
    wall_s = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if finished.returncode != 0:
        raise RuntimeError(f"`vcpo train` exited with {finished.returncode} (log: {run_dir / 'bench.log'}); "
                           "the run resumes from its newest checkpoint on the next call")
    if not stored_start.is_file() or _meta_line(stored_start) != _meta_line(start_file):
        # the trainer set a stored start of other eval settings aside and evaluated afresh: keep its
        # evaluation as the seed's start from now on (the old one stays beside it, renamed)
        if stored_start.is_file():
            stored_start.rename(stored_start.with_name(f"{stored_start.stem}.other-settings{stored_start.suffix}"))
        _copy_atomically(start_file, stored_start)
    start, final = result_from_file(start_file), result_from_file(_version_file(run_dir, bench.steps))
    change = paired_change(start, final)
    records = read_metrics(run_dir)
    curves = {name: [metric_value(record.get(key)) for record in records if record.get("trainer_step", 1) > 0]
              for name, key in CURVE_KEYS.items()}
    summary = json.loads((run_dir / "summary.json").read_text())
    row = {"method": method.name, "lag": lag, "seed": seed, "numerics": bench.numerics_at(lag)[0],
           "lr": method.lr, "weights": weights, "code": code_version(repo_root),
           "steps": len(curves["reward"]), "wall_s": round(wall_s, 1),
           "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
           "phases_s": {name: round(seconds, 1) for name, seconds in summary["phases_s"].items()},
           "final_success": final.success, "final_low": final.low, "final_high": final.high,
           "start_success": start.success, "gain": change.gain, "gain_low": change.low,
           "gain_high": change.high,
           "final_per_prompt": {prompt: round(v, 4) for prompt, v in final.per_prompt.items()},
           "host": summary["host"], "curves": curves, **summarize_curves(curves, bench.collapse_fraction)}
    progress(f"[bench staleness] {run_name(job)}: held-out {start.success:.3f} → {final.success:.3f} "
             f"({wall_s:.0f} s)")
    return row


def run_real_staleness_bench(bench: StalenessRealBenchConfig, repo_root: Path, cache_dir: Path,
                             progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Run (or reuse) every (method, k, seed) and summarize; writes result.json, summary.json, summary.md
    and the plots into `run_root`. A failed run keeps its row with the error; the others go on. With
    `run: false` nothing trains: the summary is recomputed from the stored rows (missing ones: not run)."""
    root = Path(bench.run_root)
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    base_config(bench, repo_root)  # a bad preset fails here, before any training
    policy = weights = None
    if bench.run:
        policy = prepare_policy(bench, repo_root, cache_dir, progress)
        weights = policy_digest(policy)
    jobs = matrix_jobs(bench)
    starts = seed_starts(results_dir(bench))
    rows: list[dict[str, Any]] = []
    for number, job in enumerate(jobs, 1):
        key = run_key(bench, job, repo_root)
        stored = _stored(results_dir(bench), key)
        if stored is not None:
            rows.append({**stored, "reused": True})
            continue
        if policy is None or weights is None:
            continue  # run: false — the cell shows as not run
        seed = job[2]
        if starts.get(seed, weights) != weights:
            progress(f"[bench staleness] {run_name(job)}: not run here — seed {seed}'s stored runs started "
                     f"from weights {starts[seed]}, this machine's warm start gives {weights} (hosts' "
                     f"numerics differ); run it where the warm start gives {starts[seed]}, or remove seed "
                     f"{seed}'s rows to rerun the seed whole")
            continue
        starts[seed] = weights
        run_dir = root / "runs" / run_name(job)
        progress(f"[bench staleness] {number}/{len(jobs)} {run_name(job)}: training "
                 f"(log {run_dir / 'bench.log'})")
        try:
            row = run_one(bench, job, policy, weights, repo_root, run_dir, progress)
            _store(results_dir(bench), key, row)
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the row keeps what the tables need
            shutil.rmtree(run_dir / "export", ignore_errors=True)
        except Exception as exc:  # one broken run keeps its row with the error, the rest go on
            method, lag, seed = job
            row = {"method": method.name, "lag": lag, "seed": seed, "numerics": bench.numerics_at(lag)[0],
                   "lr": method.lr, "error": f"{type(exc).__name__}: {exc}"}
            progress(f"[bench staleness] {run_name(job)}: {row['error']}")
        rows.append(row)
    return summarize(bench, rows, root, time.perf_counter() - started)


def _weights_per_seed(rows: list[dict[str, Any]], where: Path | str) -> dict[int, str]:
    """Each seed's starting weights digest; a seed whose rows name two is refused."""
    found: dict[int, set[str]] = {}
    for row in rows:
        if "weights" in row and "seed" in row:
            found.setdefault(int(row["seed"]), set()).add(row["weights"])
    mixed = {seed: sorted(digests) for seed, digests in found.items() if len(digests) > 1}
    if mixed:
        raise ValueError(f"{where}: runs of one seed started from different weights {mixed}; "
                         "a seed's runs share one starting policy — remove the stale rows")
    return {seed: next(iter(digests)) for seed, digests in sorted(found.items())}


def seed_starts(directory: Path) -> dict[int, str]:
    """Each seed's starting weights, as its stored runs record them. The warm start is deterministic on one
    kind of host but not across hosts (their bf16 kernels round differently), so a seed — its runs at every
    method and k, and its starting evaluation — is the unit that shares one starting policy; different seeds
    may start from different hosts' warm starts, like any other per-seed randomness. Every stored row is read
    (not only the selected cells'), so a partial rerun (`only=…`, `seeds=…`) keeps to its seeds' starts; the
    rows a run then reuses or adds keep to them too, so the matrix's rows need no second check."""
    rows = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            rows.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # a torn row is run again
    return _weights_per_seed(rows, directory)


def summarize(bench: StalenessRealBenchConfig, rows: list[dict[str, Any]], root: Path,
              wall_s: float) -> dict[str, Any]:
    """The result of a real-model matrix from its rows (fresh or stored), written into `root`."""
    good = [r for r in rows if "error" not in r]
    starts = {r["seed"]: r["start_success"] for r in good}
    initial = sum(starts.values()) / len(starts) if starts else None
    result: dict[str, Any] = {
        "benchmark": "staleness", "mode": "matrix", "preset": "real", "config": bench.model_dump(mode="json"),
        "score": "held-out success (the task's held-out prompts, sampled as the rollouts are)",
        "weights_per_seed": {str(seed): digest for seed, digest in _weights_per_seed(good, root).items()},
        "initial_success": initial,
        "initial_success_per_seed": {str(s): v for s, v in sorted(starts.items())},
        "properties": properties(bench, good), "runs": _sorted(bench, rows),
        "wall_s": round(wall_s, 1), "cpu_s": round(sum(r.get("cpu_s", 0.0) for r in good), 1)}
    result["summary"] = summary_table(bench, rows, collapsed=ended_below_start)
    result["retention"] = retention_table(result["summary"], initial)
    (root / "result.json").write_text(json.dumps(result, indent=1, allow_nan=True))
    (root / "summary.md").write_text(format_real_summary(result))
    compact = compact_summary(result)
    compact.update(preset="real", weights_per_seed=result["weights_per_seed"], initial_success=initial,
                   cpu_s=result["cpu_s"], initial_success_per_seed=result["initial_success_per_seed"])
    (root / "summary.json").write_text(json.dumps(compact, indent=1, allow_nan=True))
    try:
        result["plots"] = [str(p) for p in plot_staleness(result, root, score="held-out success")]
    except ImportError as exc:  # matplotlib is a dev extra: the figures are kept, the plots skipped
        result["plots"], result["plots_skipped"] = [], f"{exc}; pip install matplotlib to draw them"
    return result


def ended_below_start(row: dict[str, Any]) -> bool:
    """A real-model run collapsed when its final policy is worse on the held-out prompts than the policy
    it started from: the paired 95% interval of (final − start) lies below 0. Not the synthetic preset's
    training-reward rule (`collapse_step`, still stored per run): under a lag k the training reward is the
    reward of the policy k steps back, so it trails a collapse by k steps, and a start of ~10% success
    over 4 episodes a step trips a "fell below half the first 10 steps' reward" rule on noise alone."""
    return row["gain_high"] < 0


def properties(bench: StalenessRealBenchConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The regime as run: batch, steps against the largest k, response length and time per run."""
    largest = max(bench.lags) if bench.lags else 0
    lengths = [r["response_tokens_mean"] for r in rows if r.get("response_tokens_mean") is not None]
    batch = bench.groups_per_step * bench.group_size
    return {"task": "main job (run_config)", "run_config": bench.run_config, "overrides": bench.overrides,
            "batch_trajectories": batch, "group_size": bench.group_size, "steps": bench.steps,
            "largest_lag": largest, "eval_prompts": bench.eval_samples,
            "response_tokens_mean": sum(lengths) / len(lengths) if lengths else None,
            "run_wall_s_mean": (sum(r["wall_s"] for r in rows) / len(rows)) if rows else None,
            "targets_met": {"steps >= 2.5 x largest lag": bench.steps >= 2.5 * largest}}


def format_real_summary(result: dict[str, Any]) -> str:
    """Markdown: the regime line, then the matrix's tables."""
    props = result["properties"]
    initial = result["initial_success"]
    lines = [f"real model, {props['run_config']} with {' '.join(props['overrides']) or 'no overrides'}; "
             f"B = {props['batch_trajectories']} in groups of {props['group_size']}, {props['steps']} steps; "
             f"held-out prompts {props['eval_prompts']}; starting policy's held-out success "
             + (f"{initial:.3f}" if initial is not None else "–")
             + f"; CPU {result['cpu_s'] / 3600:.2f} h in the runs of this result; collapsed: the final "
             "held-out success below the start's (paired 95% interval)", ""]
    return "\n".join(lines + matrix_tables(result)) + "\n"
