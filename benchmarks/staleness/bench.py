"""`vcpo bench staleness`: does an objective stay stable as the lag k grows? Methods × k × seeds.

Every run goes through the real pipeline of `vcpo train`: the rollout manager (in its stress mode
`rollout.saturate_lag`, so each batch lags by exactly min(k, step) — the worst case the bound
allows, independent of how fast engine and learner are), the HF engine, the agent loop, the reward,
the torch learner with the method's objective and step-size rule, weight sync by version.

Two presets (benchmarks/staleness/tasks.py has the tasks):

* `benchmarks/configs/staleness.yaml` (the default, "paper-like"): a ~0.55M-parameter byte-level Llama
  pre-taught to spell letter ranges ("d-k" → "d, e, f, g, h, i, j, k"; answers of 14–65 tokens) to
  an exact success probability of ~0.3 on held-out prompts; B = 64 trajectories per step in groups
  of 8; lrs capped where sequence TIS keeps a median ESS ratio ≥ 0.9 at k = 1 (small per-step moves,
  as in LLM RL); optional bf16 sampling engine against the fp32 learner (`numerics`), so w ≠ 1 even at k = 0.
* `benchmarks/configs/staleness_tiny.yaml`: "a+b=" → the sum (1–2 answer tokens), the CI smoke.

Per run we record the curves of `metrics.jsonl` (training reward, ESS ratio, lr scale, grad norm,
clipped and masked token fractions, lag, OPOB's weight concentration and b* − mean, corr(log w, R),
response length) and the final policy's exact success probability on the evaluation prompts: the
teacher-forced probability of the right answer followed by end-of-turn, averaged over the prompts
(no sampling noise). Collapse: the first step whose trailing-10-step training reward falls below
`collapse_fraction` × its first 10 steps' reward, or a non-finite loss / grad norm.

Finished runs are stored under `results_dir` (default `run_root/results/`) keyed by everything that
decides them, so an interrupted matrix resumes where it stopped and a rerun with other lags or methods
reuses what fits; pointing `results_dir` at a committed folder carries a long matrix across machines.

Learning rates: `mode: lr_sweep` first runs `cap_method` at k = 1 with every lr of `lr_grid` (the cap:
the largest lr whose median ESS ratio stays ≥ `ess_floor`), then every method at k = 0 (on policy,
where lag plays no part) with each lr up to the cap, on a seed not used by the matrix; the lr with the
best final success probability wins (ties → the smaller lr). The chosen values are fixed in the preset
before any lagged run is seen. `common_lr` reruns a matrix with one lr for every method.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from benchmarks.staleness import tasks as staleness_tasks
from benchmarks.staleness.schema import (
    StalenessBenchConfig,
    StalenessMatrixConfig,
    StalenessMethodConfig,
    StalenessTimedBenchConfig,
)
from configs.schema import RunConfig
from run.launch.host import host_description
from run.observability import metric_names as names
from vcpo import metrics as vcpo_metrics

WINDOW = 10
"""Steps averaged for the first/last reward and the collapse test."""

CURVE_KEYS = {
    "reward": names.REWARD_MEAN,
    "ess_ratio": names.IS_ESS_RATIO,
    "w_max": names.IS_W_MAX,
    "log_w_min": names.IS_LOG_W_MIN,
    "log_w_max": names.IS_LOG_W_MAX,
    "lr_scale": names.LR_SCALE,
    "grad_norm": names.GRAD_NORM,
    "clip_frac": names.PG_CLIP_FRAC,
    "masked_frac": names.PG_MASKED_FRAC,
    "lag": names.STALENESS_MEAN,
    "loss": names.TRAIN_LOSS,
    "omega_max_share": vcpo_metrics.OPOB_OMEGA_MAX_SHARE,
    "baseline_minus_mean": vcpo_metrics.OPOB_SIGNED_GAP,
    "log_w_reward_corr": vcpo_metrics.IS_LOG_W_REWARD_CORR,
    "response_tokens": names.ROLLOUT_RESPONSE_TOKENS_MEAN,
}
"""Curve name in the JSON → metrics.jsonl key (OPOB's only for the methods that have a b*)."""

Job = tuple[StalenessMethodConfig, int | str, int, str]
"""(method with its lr, lag k, seed, numerics)."""


def prepare(bench: StalenessBenchConfig, root: Path) -> tuple[Path, Path]:
    """The task file (its dataset written beside it) and the pre-taught policy (cached by settings).

    The policy is kept in `results_dir` too (`policy-<fingerprint>/`, ~2 MB) and taken from there when
    it is present: pre-teaching is deterministic on one software stack, but another torch/transformers
    release initialises or trains differently (one session's recipe stopped at step 900 with success
    0.36, the next one's at step 400 with 0.31), and stored runs are only comparable on one policy."""
    root.mkdir(parents=True, exist_ok=True)
    name = f"policy-{staleness_tasks.policy_fingerprint(bench)}"
    kept, model_dir = policy_store(bench) / name, root / staleness_tasks.policy_dir_name(bench)
    if (kept / "config.json").is_file() and not (model_dir / "config.json").is_file():
        tmp = model_dir.with_name(model_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(kept, tmp)
        os.replace(tmp, model_dir)
    model_dir = staleness_tasks.pretrained_policy(bench, root)
    if not (kept / "config.json").is_file():
        tmp = kept.with_name(f".{name}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(model_dir, tmp)
        os.replace(tmp, kept)
    return staleness_tasks.task_file(bench, root), model_dir


def policy_digest(model_dir: Path) -> str:
    """The starting policy's weights, hashed (read in blocks: a real model's file is ~0.5 GB): a stored run
    is reused only on the very same policy."""
    digest = hashlib.sha256()
    with open(model_dir / "model.safetensors", "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()[:12]


def success_probability(model_dir: Path, bench: StalenessBenchConfig) -> float:
    """The policy's exact success probability on the evaluation prompts (benchmarks/staleness/tasks.py)."""
    return staleness_tasks.success_probability(model_dir, bench)


# ---------------------------------------------------------------------------------------------
# One run (in a worker process)


def run_config_dict(bench: StalenessBenchConfig, method: StalenessMethodConfig, lag: int, seed: int,
                    numerics: str, model_dir: Path, task_path: Path, run_dir: Path) -> dict[str, Any]:
    """One run's config as a plain tree (the timed preset edits its rollout and trainer sections)."""
    # bf16_engine: the engine samples from a bf16 copy of the weights the fp32 learner trains, so the
    # behaviour log-probs differ from the learner's by bf16 rounding even at lag 0 (as on GPUs)
    engine_dtype = "bfloat16" if numerics == "bf16_engine" else "float32"
    return {
        "run_dir": str(run_dir),
        "seed": seed,
        "model": {"path": str(model_dir)},
        "task": str(task_path),
        "engine": {"backend": "hf", "max_batch_size": 256, "dtype": engine_dtype, "device": bench.device},
        "algo": {**method.algo, "group_size": bench.group_size},
        "optim": {"lr": method.lr, "grad_clip": 1.0},
        "rollout": {"max_lag": lag, "groups_per_step": bench.groups_per_step, "saturate_lag": True},
        "learner": {"device": bench.device, "micro_batch_tokens": 8192},
        "trainer": {"total_steps": bench.steps, "checkpoint_every": bench.steps, "keep_checkpoints": 1,
                    "use_tensorboard": False, "save_trajectories": False},
    }


def _run_config(bench: StalenessBenchConfig, method: StalenessMethodConfig, lag: int, seed: int,
                numerics: str, model_dir: Path, task_path: Path, run_dir: Path) -> RunConfig:
    return RunConfig.model_validate(run_config_dict(bench, method, lag, seed, numerics, model_dir, task_path,
                                                    run_dir))


def _worker_init() -> None:
    _exit_with_parent()
    import torch

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def _exit_with_parent() -> None:
    """Linux: a worker gets SIGTERM when the bench process dies, instead of training on as an orphan
    (ProcessPoolExecutor notices a dead parent only between tasks, and a run takes minutes)."""
    import contextlib
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        # without it an orphan finishes its run and then exits: nothing breaks, time is lost
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def run_one(bench: StalenessBenchConfig, method: StalenessMethodConfig, lag: int, seed: int, numerics: str,
            model_dir: Path, task_path: Path, run_dir: Path) -> dict[str, Any]:
    """Train one (method, k, seed, numerics) and return its curves and summary numbers."""
    started = time.perf_counter()
    config = _run_config(bench, method, lag, seed, numerics, model_dir, task_path, run_dir)
    summary, records = train_run(config, task_path, run_dir)
    curves = {name: [number(record.get(key)) for record in records] for name, key in CURVE_KEYS.items()}
    final = success_probability(run_dir / "export", bench)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # only the curves are kept
    shutil.rmtree(run_dir / "export", ignore_errors=True)
    return {"method": method.name, "lag": lag, "seed": seed, "numerics": numerics, "lr": method.lr,
            "steps": summary.steps, "wall_s": round(time.perf_counter() - started, 1), "final_success": final,
            "host": host_description(), "curves": curves, **summarize_curves(curves, bench.collapse_fraction)}


def train_run(config: RunConfig, task_path: Path, run_dir: Path) -> tuple[Any, list[dict[str, Any]]]:
    """`vcpo train` of `config` in this process, from an empty `run_dir`: its summary and metrics records."""
    from run.launch.training import run_training
    from run.observability.metrics_log import read_metrics
    from run.train.wiring import engine_settings, load_task

    shutil.rmtree(run_dir, ignore_errors=True)
    task, resolved_task = load_task(task_path)
    settings = engine_settings(config.engine, str(task_path))
    summary = asyncio.run(run_training(config, task, resolved_task, settings, run_dir / "cache", run_dir,
                                       progress=False))
    return summary, read_metrics(run_dir)


def number(value: Any) -> float | None:
    """A metric's value as a float (non-finite kept as nan), None where it was not logged."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else float("nan")


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize_curves(curves: dict[str, list[float | None]], collapse_fraction: float) -> dict[str, Any]:
    """first/last-10 reward, collapse step, ESS min / median / 10th percentile over steps, max grad norm,
    mean clipped/masked fraction, and the means of the diagnostics that explain a failure."""
    reward = [r for r in curves["reward"] if r is not None]

    def finite(name: str) -> list[float]:
        return [v for v in curves.get(name, []) if v is not None and math.isfinite(v)]

    def mean_of(name: str) -> float | None:
        values = finite(name)
        return statistics.fmean(values) if values else None

    first = statistics.fmean(reward[:WINDOW]) if reward else float("nan")
    collapse = None
    for step in range(len(reward)):
        bad = any(curves[name][step] is not None and not math.isfinite(curves[name][step])  # type: ignore[arg-type]
                  for name in ("loss", "grad_norm"))
        trailing = reward[max(0, step + 1 - WINDOW): step + 1]
        if bad or (step + 1 >= WINDOW and statistics.fmean(trailing) < collapse_fraction * first):
            collapse = step + 1
            break
    ess, grad = finite("ess_ratio"), finite("grad_norm")
    return {
        "reward_first10": first,
        "reward_last10": statistics.fmean(reward[-WINDOW:]) if reward else float("nan"),
        "collapse_step": collapse,
        "min_ess_ratio": min(ess) if ess else None,
        "median_ess_ratio": statistics.median(ess) if ess else None,
        "p10_ess_ratio": _quantile(ess, 0.1) if ess else None,
        "max_grad_norm": max(grad) if grad else None,
        "clip_frac_mean": mean_of("clip_frac"),
        "masked_frac_mean": mean_of("masked_frac"),
        "mean_lag": mean_of("lag"),
        "omega_max_share_mean": mean_of("omega_max_share"),
        "baseline_minus_mean_mean": mean_of("baseline_minus_mean"),
        "log_w_reward_corr_mean": mean_of("log_w_reward_corr"),
        "response_tokens_mean": mean_of("response_tokens"),
    }


# ---------------------------------------------------------------------------------------------
# Stored runs: an interrupted matrix resumes


def settings_digest(decided_by: dict[str, Any]) -> str:
    """12 hex digits naming everything in `decided_by` (JSON with sorted keys): the key of a stored row."""
    return hashlib.sha256(json.dumps(decided_by, sort_keys=True).encode()).hexdigest()[:12]


def _run_name(method: StalenessMethodConfig, lag: int, seed: int, numerics: str) -> str:
    return f"{method.name}-lr{method.lr:g}-k{lag}-s{seed}-{numerics}"


def run_key(bench: StalenessBenchConfig, job: Job, weights: str) -> str:
    """Everything that decides a run's outcome, hashed: the policy (its recipe and its weights'
    digest, `policy_digest`) and task, the run's shape, the method's algo and lr, k, the seed and the
    numerics."""
    method, lag, seed, numerics = job
    decided_by = {"policy": staleness_tasks.policy_fingerprint(bench), "weights": weights,
                  "steps": bench.steps,
                  "groups_per_step": bench.groups_per_step, "group_size": bench.group_size,
                  "algo": method.algo, "lr": method.lr, "lag": lag, "seed": seed, "numerics": numerics}
    if bench.device != "cpu":  # CPU runs keep the keys they were stored under
        decided_by["device"] = bench.device
    if isinstance(bench, StalenessTimedBenchConfig):  # the timeline and what is measured on it
        decided_by["timed"] = {"clock": bench.clock.model_dump(exclude={"seed"}),
                               "eval_every": bench.eval_every,
                               **({"auto_lag": bench.auto_lag.model_dump()} if lag == "auto" else {})}
    return f"{_run_name(method, lag, seed, numerics)}-{settings_digest(decided_by)}"


def policy_store(bench: StalenessBenchConfig) -> Path:
    """Where the pre-taught policy is kept: the timed preset shares the synthetic preset's (`policy_dir`)."""
    shared = getattr(bench, "policy_dir", None)
    return Path(shared) if shared is not None else results_dir(bench)


def results_dir(bench: StalenessMatrixConfig) -> Path:
    """Where finished runs are stored: `results_dir`, else `run_root/results`."""
    return Path(bench.results_dir) if bench.results_dir is not None else Path(bench.run_root) / "results"


def _stored(directory: Path, key: str) -> dict[str, Any] | None:
    path = directory / f"{key}.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a torn file (an interrupted write) is simply run again


def _store(directory: Path, key: str, row: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{key}.json.tmp"
    tmp.write_text(json.dumps(row, allow_nan=True))
    os.replace(tmp, directory / f"{key}.json")  # atomic: a run is stored whole or not at all


# ---------------------------------------------------------------------------------------------
# The matrix


def _matrix_jobs(bench: StalenessMatrixConfig) -> list[Job]:
    chosen = [m for m in bench.methods if bench.only is None or m.name in bench.only]
    if bench.common_lr is not None:
        chosen = [m.model_copy(update={"lr": bench.common_lr}) for m in chosen]
    # the largest lags first: the longest-waiting runs start early, so the pool's workers stay busy
    return [(m, lag, seed, numerics)
            for lag in sorted(bench.lags, reverse=True) for m in chosen for seed in bench.seeds
            for numerics in bench.numerics_at(lag)]


def run_jobs(bench: StalenessBenchConfig, jobs: list[Job], model_dir: Path, task_path: Path, root: Path,
             progress: Callable[[str], None], runner: Callable[..., dict[str, Any]] | None = None
             ) -> list[dict[str, Any]]:
    """Every job's row: a stored one where it exists, else a fresh run of `runner` (default `run_one`; a
    module-level function, as the workers are spawned) stored when it finishes."""
    runner = run_one if runner is None else runner
    rows: list[dict[str, Any]] = []
    todo = []
    weights = policy_digest(model_dir)
    for job in jobs:
        stored = _stored(results_dir(bench), run_key(bench, job, weights))
        if stored is not None:
            rows.append({**stored, "reused": True})
        else:
            todo.append(job)
    if rows:
        progress(f"[bench staleness] {len(rows)} of {len(jobs)} runs reused from {results_dir(bench)}")
    if not todo:
        return rows
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=bench.workers, mp_context=context, initializer=_worker_init) as pool:
        futures = {pool.submit(runner, bench, *job, model_dir, task_path,
                               root / "runs" / _run_name(*job)): job for job in todo}
        for future in as_completed(futures):
            method, lag, seed, numerics = futures[future]
            try:
                row = future.result()
                _store(results_dir(bench), run_key(bench, (method, lag, seed, numerics), weights), row)
            except Exception as exc:  # one broken run keeps its row with the error, the rest go on
                row = {"method": method.name, "lag": lag, "seed": seed, "numerics": numerics, "lr": method.lr,
                       "error": f"{type(exc).__name__}: {exc}"}
            rows.append(row)
            progress(f"[bench staleness] {len(rows)}/{len(jobs)} {method.name} lr={method.lr:g} k={lag} "
                     f"seed={seed} {numerics}: " + (row.get("error") or
                     f"final success {row['final_success']:.3f} ({row['wall_s']} s)"))
    return rows


def _lr_cap(bench: StalenessBenchConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """From the cap probe's rows: the median ESS ratio per lr, and the cap — the largest lr such that it
    and every smaller lr kept a median ESS ratio ≥ ess_floor *without collapsing*. A collapsed policy
    samples (nearly) deterministically, so its IS weights are 1 and its ESS says nothing: seq TIS at lr
    1e-3 collapsed at step 11 and then logged a median ESS ratio of 1.0000 (docs/results.md)."""
    good = {row["lr"]: row for row in rows if "error" not in row}
    qualifies = {lr: row.get("median_ess_ratio") is not None and row["median_ess_ratio"] >= bench.ess_floor
                 and row.get("collapse_step") is None for lr, row in good.items()}
    cap = None
    for lr in sorted(good):
        if not qualifies[lr]:
            break
        cap = lr
    return {"method": bench.cap_method, "lag": 1, "ess_floor": bench.ess_floor,
            "median_ess_ratio_per_lr": {f"{lr:g}": good[lr].get("median_ess_ratio") for lr in sorted(good)},
            "collapse_step_per_lr": {f"{lr:g}": good[lr].get("collapse_step") for lr in sorted(good)},
            "cap": cap}


def measured_properties(bench: StalenessBenchConfig, model_dir: Path, initial: float) -> dict[str, Any]:
    """The regime's properties, measured on the pre-taught policy (and checked against the paper-like
    targets: ≥ 0.5M parameters, median response ≥ 32 tokens with p90/p10 ≥ 3, success 0.2–0.4, B ≥ 64
    in groups ≥ 8, steps ≥ 2.5 × the largest lag)."""
    from transformers import AutoModelForCausalLM

    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    lengths = staleness_tasks.sampled_lengths(model_dir, bench)
    batch = bench.groups_per_step * bench.group_size
    largest = max(bench.lags) if bench.lags else 0
    train, held_out = staleness_tasks.problems(bench)
    return {
        "task": bench.task, "parameters": parameters, "train_prompts": len(train),
        "eval_prompts": len(held_out), "held_out_eval": bench.task != "addition",
        "initial_success": initial, "sampled_response_tokens": lengths,
        "batch_trajectories": batch, "group_size": bench.group_size, "steps": bench.steps,
        "largest_lag": largest,
        "targets_met": {
            "parameters >= 0.5M": parameters >= 500_000,
            "median response >= 32 tokens": lengths["median"] >= 32,
            "p90 / p10 response length >= 3": lengths["p90"] >= 3 * lengths["p10"],
            "0.2 <= initial success <= 0.4": 0.2 <= initial <= 0.4,
            "held-out evaluation prompts": bench.task != "addition",
            "B >= 64 in groups >= 8": batch >= 64 and bench.group_size >= 8,
            "steps >= 2.5 x largest lag": bench.steps >= 2.5 * largest,
        },
    }


def run_staleness_bench(bench: StalenessBenchConfig, progress: Callable[[str], None] = lambda _m: None
                        ) -> dict[str, Any]:
    """Run the matrix (or the lr sweep); JSON-able result with every run's curves and the summaries.
    Also writes `result.json`, `summary.json`, `summary.md` and the PNG plots into `bench.run_root`."""
    root = Path(bench.run_root)
    started = time.perf_counter()
    task_path, model_dir = prepare(bench, root)
    initial = success_probability(model_dir, bench)
    progress(f"[bench staleness] pre-taught policy: success probability {initial:.3f} (evaluation prompts)")
    properties = measured_properties(bench, model_dir, initial)
    progress(f"[bench staleness] regime: {json.dumps(properties['targets_met'])}")
    result: dict[str, Any] = {
        "benchmark": "staleness", "mode": bench.mode, "config": bench.model_dump(mode="json"),
        "initial_success": initial, "properties": properties, "cpu_count": os.cpu_count()}
    if bench.mode == "lr_sweep":
        cap_method = next(m for m in bench.methods if m.name == bench.cap_method)
        probe = [(cap_method.model_copy(update={"lr": lr}), 1, bench.sweep_seed, "matched")
                 for lr in bench.lr_grid]
        cap = _lr_cap(bench, run_jobs(bench, probe, model_dir, task_path, root, progress))
        progress(f"[bench staleness] lr cap: {json.dumps(cap)}")
        grid = [lr for lr in bench.lr_grid if cap["cap"] is not None and lr <= cap["cap"]]
        chosen = [m for m in bench.methods if bench.only is None or m.name in bench.only]
        jobs = [(m.model_copy(update={"lr": lr}), 0, bench.sweep_seed, "matched")
                for m in chosen for lr in grid]
        rows = run_jobs(bench, jobs, model_dir, task_path, root, progress)
        result.update(lr_cap=cap, runs=_sorted(bench, rows), chosen_lr=choose_lrs(rows))
    else:
        rows = run_jobs(bench, _matrix_jobs(bench), model_dir, task_path, root, progress)
        result.update(runs=_sorted(bench, rows), summary=summary_table(bench, rows))
        result["retention"] = retention_table(result["summary"], initial)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    (root / "result.json").write_text(json.dumps(result, indent=1, allow_nan=True))
    (root / "summary.md").write_text(format_summary(result))
    if bench.mode == "matrix":
        (root / "summary.json").write_text(json.dumps(compact_summary(result), indent=1, allow_nan=True))
        try:
            result["plots"] = [str(p) for p in plot_staleness(result, root)]
        except ImportError as exc:  # matplotlib is a dev extra: the figures are kept, the plots skipped
            result["plots"] = []
            result["plots_skipped"] = f"{exc}; pip install matplotlib to draw them"
    return result


def _sorted(bench: StalenessMatrixConfig, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    order = [m.name for m in bench.methods]
    return sorted(rows, key=lambda r: (order.index(r["method"]), r["lr"], r.get("numerics", "matched"),
                                       r["lag"], r["seed"]))


def choose_lrs(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per method: the lr with the best final success probability at k = 0 (ties → the smaller lr)."""
    best: dict[str, tuple[float, float]] = {}
    for row in rows:
        if "error" in row or row.get("lag", 0) != 0:
            continue
        score = row["final_success"]
        current = best.get(row["method"])
        is_tie = current is not None and abs(score - current[0]) <= 1e-9
        if current is None or score > current[0] + 1e-9 or (is_tie and row["lr"] < current[1]):
            best[row["method"]] = (score, row["lr"])
    return {name: lr for name, (_, lr) in best.items()}


T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Student's t 97.5% quantiles by degrees of freedom (≥ 10: 1.96 is close enough for a bench)."""


def mean_interval(values: list[float]) -> tuple[float, float | None, float | None]:
    """(mean, sd, half-width of the 95% t-interval of the mean); sd and interval None below 2 values."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None, None
    sd = statistics.stdev(values)
    return mean, sd, T_975.get(len(values) - 1, 1.96) * sd / math.sqrt(len(values))


def reward_collapsed(row: dict[str, Any]) -> bool:
    """The synthetic preset's collapse: the training reward's trailing mean fell below `collapse_fraction`
    of its start, or the loss / grad norm went non-finite (`collapse_step`)."""
    return row["collapse_step"] is not None


def summary_table(bench: StalenessMatrixConfig, rows: list[dict[str, Any]],
                  collapsed: Callable[[dict[str, Any]], bool] = reward_collapsed) -> list[dict[str, Any]]:
    """One row per (method, k, numerics): means over seeds; methods not run keep their rows. `collapsed`
    decides which runs the row counts as collapsed (`collapsed_runs`)."""
    table = []
    for method in bench.methods:
        lr = bench.common_lr or method.lr
        for lag in bench.lags:
            for numerics in bench.numerics_at(lag):
                runs = [r for r in rows if r["method"] == method.name and r["lag"] == lag
                        and r.get("numerics", "matched") == numerics]
                good = [r for r in runs if "error" not in r]
                entry: dict[str, Any] = {"method": method.name, "lag": lag, "numerics": numerics, "lr": lr,
                                         "seeds": len(good)}
                if not runs:
                    entry["status"] = "not run"
                elif not good:
                    entry["status"] = "error: " + runs[0]["error"]
                else:
                    entry["status"] = "ok"
                    for key in ("reward_first10", "reward_last10", "min_ess_ratio", "median_ess_ratio",
                                "p10_ess_ratio", "max_grad_norm", "clip_frac_mean", "masked_frac_mean",
                                "mean_lag", "omega_max_share_mean", "baseline_minus_mean_mean",
                                "log_w_reward_corr_mean", "response_tokens_mean"):
                        values = [r[key] for r in good if r.get(key) is not None]
                        entry[key] = statistics.fmean(values) if values else None
                    finals = [r["final_success"] for r in good]
                    mean, sd, half = mean_interval(finals)
                    entry.update(final_success=mean, final_success_sd=sd, final_success_ci95=half,
                                 final_success_per_seed=finals)
                    fallen = [r for r in good if collapsed(r)]
                    steps = [r["collapse_step"] for r in fallen if r.get("collapse_step") is not None]
                    entry["collapsed_runs"] = len(fallen)
                    entry["collapse_step_min"] = min(steps) if steps else None
                table.append(entry)
    return table


def _welch(a: list[float], b: list[float], weight_b: float = 1.0) -> tuple[float, float | None]:
    """(mean(a) − w·mean(b), half-width of its 95% Welch interval); None below 2 values on a side."""
    diff = statistics.fmean(a) - weight_b * statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return diff, None
    va, vb = statistics.variance(a) / len(a), weight_b**2 * statistics.variance(b) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return diff, 0.0
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))  # Welch–Satterthwaite
    return diff, T_975.get(max(1, math.floor(dof)), 1.96) * se


def retention_table(summary: list[dict[str, Any]], initial: float | None = None) -> list[dict[str, Any]]:
    """Per (method, numerics, k > 0): the final score as a share of the same method's k = 0 score
    (`retention`, with a delta-method 95% interval), and the plain answers, decided on the seeds:
    `loses_more_than_5pct` when the k score's mean is below 0.95 × the k = 0 mean, `resolved` when the
    95% Welch interval of (k score − 0.95 × k = 0 score) excludes 0; `loses_at_least_20pct` likewise
    with 0.80 (`resolved_20pct`). With the pre-taught policy's score `initial`, also the share of the
    k = 0 run's *gain* over it that the k run kept (`gain_retention`): a policy that never moved keeps
    0 of the gain while keeping initial/score_0 of the score."""
    cell = {(e["method"], e["numerics"], e["lag"]): e for e in summary if e["status"] == "ok"}
    out = []
    for (method, numerics, lag), entry in cell.items():
        base = cell.get((method, numerics, 0))
        if lag == 0 or base is None or not base["final_success"]:
            continue
        ratio = entry["final_success"] / base["final_success"]
        half = None
        if entry["final_success_ci95"] is not None and base["final_success_ci95"] is not None:
            relative = math.hypot(entry["final_success_ci95"] / max(entry["final_success"], 1e-12),
                                  base["final_success_ci95"] / base["final_success"])
            half = ratio * relative
        seeds_k, seeds_0 = entry["final_success_per_seed"], base["final_success_per_seed"]
        margin_5, half_5 = _welch(seeds_k, seeds_0, 0.95)
        margin_20, half_20 = _welch(seeds_k, seeds_0, 0.80)
        difference, difference_half = _welch(seeds_k, seeds_0)
        row = {"method": method, "numerics": numerics, "lag": lag, "retention": ratio,
               "retention_ci95": half, "loses_more_than_5pct": ratio < 0.95,
               "loses_at_least_20pct": ratio <= 0.80,
               "resolved": half_5 is not None and abs(margin_5) > half_5,
               "resolved_20pct": half_20 is not None and abs(margin_20) > half_20,
               "difference_vs_k0": difference, "difference_ci95": difference_half}
        if initial is not None and base["final_success"] - initial > 1e-9:
            row["gain_retention"] = (entry["final_success"] - initial) / (base["final_success"] - initial)
        out.append(row)
    return sorted(out, key=lambda r: (r["method"], r["numerics"], r["lag"]))


def compact_summary(result: dict[str, Any]) -> dict[str, Any]:
    """What `docs/results/staleness.json` keeps: per method, k and numerics, the final score's mean, sd and
    95% interval and the ESS ratio's min and median; plus the regime's properties and the retention."""
    keep = ("method", "lag", "numerics", "lr", "seeds", "status", "final_success", "final_success_sd",
            "final_success_ci95", "final_success_per_seed", "min_ess_ratio", "median_ess_ratio",
            "p10_ess_ratio", "collapsed_runs")
    return {"benchmark": "staleness", "properties": result["properties"],
            "config": {k: result["config"][k] for k in ("task", "lags", "seeds", "steps", "groups_per_step",
                                                         "group_size", "numerics", "common_lr")
                       if k in result["config"]},
            "summary": [{k: e.get(k) for k in keep} for e in result["summary"]],
            "retention": result["retention"]}


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return format(value, spec) if math.isfinite(value) else str(value)
    return str(value)


def mean_ci_text(entry: dict[str, Any]) -> str:
    """A (method, k) cell's mean final success and its 95% interval as text (0.430 ± 0.011), or its status."""
    if entry["status"] != "ok":
        return entry["status"]
    half = entry.get("final_success_ci95")
    return _fmt(entry["final_success"], ".3f") + (f" ± {half:.3f}" if half is not None else "")


def format_summary(result: dict[str, Any]) -> str:
    """Markdown: the regime, then the summary table (matrix) or the lr cap and sweep (lr_sweep)."""
    props = result["properties"]
    length = props["sampled_response_tokens"]
    lines = [f"task {props['task']}, {props['parameters']:,} parameters; initial success probability "
             f"{result['initial_success']:.3f} on {props['eval_prompts']} evaluation prompts; sampled "
             f"response tokens median {length['median']:g} (p10 {length['p10']:g}, p90 {length['p90']:g}); "
             f"B = {props['batch_trajectories']} in groups of {props['group_size']}, {props['steps']} steps",
             "", "regime targets: " + ", ".join(f"{k}: {'yes' if v else 'NO'}"
                                                for k, v in props["targets_met"].items()), ""]
    if result["mode"] == "lr_sweep":
        cap = result["lr_cap"]
        lines += [f"lr cap ({cap['method']} at k = 1, median ESS ratio ≥ {cap['ess_floor']}): "
                  + ", ".join(f"lr {lr}: {_fmt(ess)}" for lr, ess in cap["median_ess_ratio_per_lr"].items())
                  + f" → cap {cap['cap']}", "",
                  "| method | lr | final success (k=0) | last-10 reward |", "|---|---|---|---|"]
        for row in result["runs"]:
            lines.append(f"| {row['method']} | {row['lr']:g} | {_fmt(row.get('final_success'))} | "
                         f"{_fmt(row.get('reward_last10'))} |")
        lines += ["", "chosen: " + ", ".join(f"{m}={lr:g}" for m, lr in result["chosen_lr"].items())]
        return "\n".join(lines) + "\n"
    return "\n".join(lines + matrix_tables(result)) + "\n"


def matrix_tables(result: dict[str, Any]) -> list[str]:
    """Markdown lines of a matrix's tables: final score per (method, k), retention, per-cell diagnostics."""
    lines: list[str] = []
    summary = result["summary"]
    lags = sorted({e["lag"] for e in summary})
    columns = [(lag, n) for lag in lags
               for n in dict.fromkeys(e["numerics"] for e in summary if e["lag"] == lag)]
    methods = list(dict.fromkeys(e["method"] for e in summary))
    cell = {(e["method"], e["lag"], e["numerics"]): e for e in summary}
    lines += [f"Final policy's {result.get('score', 'success probability on the evaluation prompts')}, "
              "mean ± 95% interval over seeds:",
              "",
              "| method | " + " | ".join(f"k={lag}" + ("" if n == "matched" else f" ({n})")
                                         for lag, n in columns) + " |", "|---|" + "---|" * len(columns)]
    for method in methods:
        cells = " | ".join(mean_ci_text(cell[(method, lag, n)]) for lag, n in columns)
        lines.append(f"| {method} | {cells} |")
    lines += ["", "Retention (final score ÷ the same method's k = 0 score, 95% interval):", "",
              "| method | numerics | k | retention | loses > 5% | resolved |", "|---|---|---|---|---|---|"]
    for r in result["retention"]:
        lines.append(f"| {r['method']} | {r['numerics']} | {r['lag']} | {_fmt(r['retention'])}"
                     + (f" ± {r['retention_ci95']:.3f}" if r["retention_ci95"] is not None else "")
                     + f" | {'yes' if r['loses_more_than_5pct'] else 'no'}"
                     + f" | {'yes' if r['resolved'] else 'no'} |")
    lines += ["", "Per (method, k, numerics): means over seeds.", "",
              "| method | k | numerics | lr | final | reward first→last 10 | collapsed | "
              "ESS min / p10 / median | max grad norm | clipped | masked | ω max share | b* − mean | "
              "corr(log w, R) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in summary:
        if e["status"] != "ok":
            lines.append(f"| {e['method']} | {e['lag']} | {e['numerics']} | {e['lr']:g} | {e['status']} |"
                         + " |" * 9)
            continue
        collapsed = f"{e['collapsed_runs']}/{e['seeds']}" + (
            f" ({e['collapse_step_min']})" if e["collapse_step_min"] is not None else "")
        lines.append(
            f"| {e['method']} | {e['lag']} | {e['numerics']} | {e['lr']:g} | {_fmt(e['final_success'])} | "
            f"{_fmt(e['reward_first10'], '.2f')}→{_fmt(e['reward_last10'], '.2f')} | {collapsed} | "
            f"{_fmt(e['min_ess_ratio'], '.2f')} / {_fmt(e['p10_ess_ratio'], '.2f')} / "
            f"{_fmt(e['median_ess_ratio'], '.2f')} | {_fmt(e['max_grad_norm'], '.2f')} | "
            f"{_fmt(e['clip_frac_mean'])} | {_fmt(e['masked_frac_mean'])} | "
            f"{_fmt(e['omega_max_share_mean'], '.2f')} | "
            f"{_fmt(e['baseline_minus_mean_mean'], '.3f')} | {_fmt(e['log_w_reward_corr_mean'], '.2f')} |")
    return lines


def plot_staleness(result: dict[str, Any], out_dir: Path, score: str = "success probability") -> list[Path]:
    """Per lag: training reward and ESS ratio vs step, one line per method (mean over seeds); plus
    the final `score` (mean over seeds, each seed a dot) vs k per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if "error" not in r]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    lags = sorted({r["lag"] for r in runs})
    colors = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(methods)}
    paths = []
    for lag in lags:
        fig, axes = plt.subplots(1, 2, figsize=(14, 5))
        for method in methods:
            mine = [r for r in runs if r["method"] == method and r["lag"] == lag]
            if not mine:
                continue
            for ax, curve in zip(axes, ("reward", "ess_ratio"), strict=True):
                series = _mean_curve([r["curves"][curve] for r in mine])
                smooth = _moving_average(series, 5) if curve == "reward" else series
                style = "-" if method.startswith("vcpo") else "--"
                ax.plot(range(1, len(smooth) + 1), smooth, style, color=colors[method], label=method, lw=1.4)
        axes[0].set(title=f"training reward (5-step mean), k={lag}", xlabel="step", ylim=(-0.02, 1.02))
        axes[1].set(title=f"ESS ratio of the minibatch, k={lag}", xlabel="step", ylim=(0, 1.05))
        axes[1].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out_dir / f"staleness_k{lag}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(8, 5))
    for m_index, method in enumerate(methods):
        points = []
        # each seed's own score as a faint dot beside the mean, so a mean pulled by one seed shows as such
        offset = 0.04 * (m_index - (len(methods) - 1) / 2)
        for position, lag in enumerate(lags):
            finals = [r["final_success"] for r in runs if r["method"] == method and r["lag"] == lag]
            if finals:
                points.append((position, statistics.fmean(finals)))
                ax.scatter([position + offset] * len(finals), finals, s=12, alpha=0.45, color=colors[method])
        ax.plot([p[0] for p in points], [p[1] for p in points],
                "o-" if method.startswith("vcpo") else "s--", color=colors[method], label=method)
    ax.set_xticks(range(len(lags)), [str(lag) for lag in lags])
    if result["initial_success"] is not None:
        ax.axhline(result["initial_success"], color="grey", lw=0.8, ls=":", label="starting policy")
    ax.set(title=f"final policy: {score} vs lag k (line: mean; dots: seeds)", xlabel="k", ylabel=score,
           ylim=(0, 1.02))
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out_dir / "staleness_final_vs_lag.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    paths.append(path)
    return paths


def _mean_curve(curves: list[list[float | None]]) -> list[float]:
    length = min(len(c) for c in curves)
    out = []
    for step in range(length):
        values = [c[step] for c in curves if c[step] is not None and math.isfinite(c[step])]  # type: ignore[arg-type]
        out.append(statistics.fmean(values) if values else float("nan"))
    return out


def _moving_average(values: list[float], width: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - width): i + 1]) for i in range(len(values))]
