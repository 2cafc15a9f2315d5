"""`vcpo bench staleness --config benchmarks/configs/staleness_timed.yaml`: what a lag bound buys in time.

The synthetic preset saturates the lag (every batch exactly min(k, step) stale) to ask whether a method
survives staleness. Asynchrony's point is time, and the right bound trades it against staleness; this
preset asks that on a simulated clock (rollout/sim_clock.py), where the two CPU cores that run engine and
learner side by side cannot. Every run is the synthetic preset's (same task, pre-taught policy, pipeline,
exact success probability as the score) with `rollout.simulated_clock`: episode generation times drawn
from a lognormal fitted to the main job's real episodes, a fixed learner step, an engine of
`concurrent_groups` slots. The timeline decides which policy version each group is generated with (its
lag ≤ k, no longer saturated) and how long the learner waited — what `max_lag: auto` acts on.

Per run the score is measured every `eval_every` steps (the run's checkpoints, scored afterwards) against
the step's simulated time. Per (method, k), over seeds: the final score (mean, 95% interval) and the time
to score — the first measurement at or above `target_fraction` × the method's k = 0 final score (mean
over seeds; a run that never reaches it counts as never). The goal, per method: `auto`'s final score
within `score_tolerance` of the best fixed k's, at most `time_tolerance` × the fastest fixed k's time to
score. Reported whichever way it comes out.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.staleness import bench as staleness_bench
from benchmarks.staleness import tasks as staleness_tasks
from benchmarks.staleness.schema import StalenessMethodConfig, StalenessTimedBenchConfig
from configs.schema import RunConfig
from rollout.lag_control import ROLLOUT_LAG_JUDGED_ESS, ROLLOUT_LAG_MISMATCH_ESS, ROLLOUT_MAX_LAG
from rollout.sim_clock import SIM_IDLE_FRACTION, SIM_TIME
from run.launch.host import host_description
from vcpo.metrics import IS_MISMATCH_ESS_RATIO, IS_MISMATCH_LOG_W_MEAN


def learner_seconds(episode_median_s: float, episode_sigma: float, episodes_per_batch: int) -> float:
    """The learner step that equals the median generation time of a synchronous batch — the longest of its
    n lognormal episodes, whose median is median · exp(σ · Φ⁻¹(0.5^(1/n))): at k = 0 a run then waits
    for generation about half of its time."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.5 ** (1.0 / episodes_per_batch))
    return episode_median_s * math.exp(episode_sigma * z)


EPISODE_TOKENS = Path(__file__).resolve().parents[1] / "data" / "main_job_episode_tokens.json"
"""The main job's real episode lengths (tokens after the prompt), with where they come from."""


def fit_episode_times(tokens: list[int], tokens_per_s: float) -> tuple[float, float]:
    """(median, sigma) of the clock's episode times: the maximum-likelihood lognormal of real episode lengths
    in tokens (rollout/sim_clock.py's `fit_lognormal`) at `tokens_per_s` per episode."""
    from rollout.sim_clock import fit_lognormal

    return fit_lognormal([t / tokens_per_s for t in tokens])


# ---------------------------------------------------------------------------------------------
# One run (in a worker process)


TIMED_CURVE_KEYS = {
    "sim_time": SIM_TIME,
    "sim_idle_fraction": SIM_IDLE_FRACTION,
    "max_lag": ROLLOUT_MAX_LAG,
    "mismatch_ess_ratio": IS_MISMATCH_ESS_RATIO,
    "mismatch_log_w_mean": IS_MISMATCH_LOG_W_MEAN,
    "lag_judged_ess_ratio": ROLLOUT_LAG_JUDGED_ESS,
    "lag_mismatch_floor": ROLLOUT_LAG_MISMATCH_ESS,
}
"""Curves of the timeline and of the bound's controller, beside the synthetic preset's: the lag-0 (engine
numerics) part of the behaviour ratio, what the controller judged and the mismatch floor it divided by."""


def run_config(bench: StalenessTimedBenchConfig, method: StalenessMethodConfig, lag: int | str, seed: int,
               model_dir: Path, task_path: Path, run_dir: Path, numerics: str = "matched") -> RunConfig:
    """The synthetic preset's run (benchmarks/staleness/bench.py) on the timeline: lags decided by it, not
    saturated; a checkpoint every `eval_every` steps, all kept (each is one point of the score's curve)."""
    base = staleness_bench.run_config_dict(bench, method, 0, seed, numerics, model_dir, task_path, run_dir)
    base["rollout"] = {"max_lag": lag, "groups_per_step": bench.groups_per_step, "saturate_lag": False,
                       "auto_lag": bench.auto_lag.model_dump(), "simulated_clock": bench.clock.model_dump()}
    base["trainer"].update(checkpoint_every=bench.eval_every,
                           keep_checkpoints=bench.steps // bench.eval_every)
    return RunConfig.model_validate(base)


def run_timed(bench: StalenessTimedBenchConfig, method: StalenessMethodConfig, lag: int | str, seed: int,
              numerics: str, model_dir: Path, task_path: Path, run_dir: Path) -> dict[str, Any]:
    """Train one (method, k, seed) on the timeline; its curves, its score at every checkpoint with the
    simulated time of that step, and the synthetic preset's summary numbers."""
    from run.train.checkpointing import checkpoint_root, load_checkpoint

    started = time.perf_counter()
    config = run_config(bench, method, lag, seed, model_dir, task_path, run_dir, numerics)
    summary, records = staleness_bench.train_run(config, task_path, run_dir)
    keys = {**staleness_bench.CURVE_KEYS, **TIMED_CURVE_KEYS}
    curves = {name: [staleness_bench.number(record.get(key)) for record in records]
              for name, key in keys.items()}
    sim_time = {int(record["trainer_step"]): float(record[SIM_TIME]) for record in records}
    score = _checkpoint_scores(bench, model_dir, checkpoint_root(run_dir), load_checkpoint, sim_time)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # only the curves are kept
    shutil.rmtree(run_dir / "export", ignore_errors=True)
    final = score[-1]["score"]
    bounds = [b for b in curves["max_lag"] if b is not None]
    return {"method": method.name, "lag": lag, "seed": seed, "numerics": numerics, "lr": method.lr,
            "steps": summary.steps, "wall_s": round(time.perf_counter() - started, 1), "final_success": final,
            "score_curve": score, "sim_time_s": sim_time[max(sim_time)],
            "mean_bound": statistics.fmean(bounds) if bounds else None, "host": host_description(),
            "curves": curves, **staleness_bench.summarize_curves(curves, bench.collapse_fraction),
            **mismatch_summary(curves)}


def _checkpoint_scores(bench: StalenessTimedBenchConfig, model_dir: Path, root: Path,
                       load: Callable[..., Any], sim_time: dict[int, float]) -> list[dict[str, float]]:
    """[{step, time, score}] from the starting policy (step 0, time 0) through every kept checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    batch = staleness_tasks.answer_batch(bench, staleness_tasks.problems(bench)[1])
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    points = [{"step": 0, "time": 0.0, "score": staleness_tasks.success_of(model, batch)}]
    kept = [p for p in root.glob("step_*") if p.is_dir()]
    for path in sorted(kept, key=lambda p: int(p.name.split("_")[1])):
        state, meta = load(path)
        step = int(meta["step"])
        with torch.no_grad():
            model.load_state_dict(state["learner"]["model"])
        score = staleness_tasks.success_of(model, batch)
        points.append({"step": step, "time": sim_time[step], "score": score})
    return points


# ---------------------------------------------------------------------------------------------
# The matrix and its summary


def jobs(bench: StalenessTimedBenchConfig) -> list[staleness_bench.Job]:
    """Every (method, k, seed, numerics): 'auto' and the largest k first (the longest runs start early)."""
    chosen = [m for m in bench.methods if bench.only is None or m.name in bench.only]
    order = sorted(bench.lags, key=lambda lag: -math.inf if lag == "auto" else -float(lag))
    return [(m, lag, seed, numerics) for lag in order for m in chosen for seed in bench.seeds  # type: ignore[misc]
            for numerics in bench.numerics_at(lag)]


def time_to_score(curve: list[dict[str, float]], target: float) -> float:
    """Simulated time of the first measurement at or above `target` (inf: never)."""
    return next((point["time"] for point in curve if point["score"] >= target), math.inf)


def timed_summary(bench: StalenessTimedBenchConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per (method, k): final score and time to score over seeds; per method: the goal's verdict."""
    table, verdicts = [], []
    for method, numerics in ((m, n) for m in bench.methods for n in bench.numerics):
        mine = [r for r in rows if r["method"] == method.name and "error" not in r
                and r.get("numerics", "matched") == numerics]
        base = [r["final_success"] for r in mine if r["lag"] == 0]
        target = bench.target_fraction * statistics.fmean(base) if base else None
        cells = {}
        for lag in bench.lags:
            if numerics not in bench.numerics_at(lag):
                continue
            runs = [r for r in mine if r["lag"] == lag]
            entry: dict[str, Any] = {"method": method.name, "lag": lag, "lr": method.lr, "seeds": len(runs),
                                     **({"numerics": numerics} if numerics != "matched" else {})}
            if not runs:
                entry["status"] = "not run"
            else:
                finals = [r["final_success"] for r in runs]
                mean, _, half = staleness_bench.mean_interval(finals)
                times = [time_to_score(r["score_curve"], target) for r in runs] if target is not None else []
                never = sum(not math.isfinite(t) for t in times)
                t_mean, _, t_half = (staleness_bench.mean_interval(times) if times and not never
                                     else (math.inf, None, None))  # a seed that never got there: never
                entry.update(status="ok", final_success=mean, final_success_ci95=half,
                             final_success_per_seed=finals, target=target, time_to_target=t_mean,
                             time_to_target_ci95=t_half, time_to_target_per_seed=times, never_reached=never,
                             **{key: _mean_of(runs, key)
                                for key in ("sim_time_s", "mean_lag", "mean_bound", "median_ess_ratio")},
                             **({key: _mean_of(runs, key) for key in MISMATCH_SUMMARY}
                                if numerics != "matched" else {}))
            cells[lag] = entry
            table.append(entry)
        verdict = _verdict(bench, method.name, cells)
        verdicts.append({**verdict, "numerics": numerics} if numerics != "matched" else verdict)
    return {"table": table, "verdicts": verdicts}


MISMATCH_SUMMARY = ("median_mismatch_ess_ratio", "min_mismatch_ess_ratio", "median_judged_ess_ratio")
"""Per run, over its steps (NaN steps skipped): the lag-0 part of the behaviour ratio's ESS and the ratio
the bound's controller judged — summarised where the engine's numerics differ from the learner's."""


def mismatch_summary(curves: dict[str, list[float | None]]) -> dict[str, float | None]:
    """The MISMATCH_SUMMARY numbers of one run's curves (None where the curve has no value)."""
    def values(name: str) -> list[float]:
        return [v for v in curves.get(name, []) if v is not None and math.isfinite(v)]

    mismatch, judged = values("mismatch_ess_ratio"), values("lag_judged_ess_ratio")
    return {"median_mismatch_ess_ratio": statistics.median(mismatch) if mismatch else None,
            "min_mismatch_ess_ratio": min(mismatch) if mismatch else None,
            "median_judged_ess_ratio": statistics.median(judged) if judged else None}


def _mean_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def _verdict(bench: StalenessTimedBenchConfig, method: str, cells: dict[Any, dict[str, Any]]
             ) -> dict[str, Any]:
    fixed = [e for lag, e in cells.items() if lag != "auto" and e["status"] == "ok"]
    auto = cells.get("auto")
    if not fixed or auto is None or auto["status"] != "ok":
        return {"method": method, "status": "incomplete"}
    best = max(fixed, key=lambda e: e["final_success"])
    fastest = min(fixed, key=lambda e: e["time_to_target"])
    score_ok = auto["final_success"] >= (1 - bench.score_tolerance) * best["final_success"]
    time_ok = math.isfinite(auto["time_to_target"]) and math.isfinite(fastest["time_to_target"]) and (
        auto["time_to_target"] <= bench.time_tolerance * fastest["time_to_target"])
    return {"method": method, "status": "ok", "best_fixed_lag": best["lag"],
            "best_fixed_score": best["final_success"], "auto_score": auto["final_success"],
            "score_within_tolerance": score_ok, "fastest_fixed_lag": fastest["lag"],
            "fastest_fixed_time": fastest["time_to_target"], "auto_time": auto["time_to_target"],
            "time_within_tolerance": time_ok, "goal_met": score_ok and time_ok}


def format_timed(result: dict[str, Any]) -> str:
    """Markdown: per method and k the final score and the time to score; then the goal per method (from a
    run's result or its compact summary, docs/results/staleness_timed.json)."""
    summary = result["summary"]
    lines = [f"Final exact success probability (mean ± 95% interval over seeds) and simulated time to "
             f"{result['config']['target_fraction']:.0%} of the method's k = 0 final score (mean ± 95% "
             "interval; 'never' counts seeds that did not reach it):", "",
             "| method | k | final score | time to score | never | sim time (all steps) | mean lag | "
             "mean bound | ESS median |", "|---|---|---|---|---|---|---|---|---|"]
    for e in summary["table"]:
        if e["status"] != "ok":
            lines.append(f"| {_label(e)} | {e['lag']} | {e['status']} |" + " |" * 6)
            continue
        score = f"{e['final_success']:.3f}" + (f" ± {e['final_success_ci95']:.3f}"
                                               if e["final_success_ci95"] is not None else "")
        clock = "never" if not math.isfinite(e["time_to_target"]) else f"{e['time_to_target']:.0f} s" + (
            f" ± {e['time_to_target_ci95']:.0f}" if e["time_to_target_ci95"] is not None else "")
        lines.append(f"| {_label(e)} | {e['lag']} | {score} | {clock} | {e['never_reached']}/{e['seeds']} "
                     f"| {_fmt(e['sim_time_s'], '.0f')} s | {_fmt(e['mean_lag'], '.1f')} | "
                     f"{_fmt(e['mean_bound'], '.1f')} | {_fmt(e['median_ess_ratio'], '.2f')} |")
    lines += ["", "| method | auto: score vs best fixed k | auto: time vs fastest fixed k | goal met |",
              "|---|---|---|---|"]
    for v in summary["verdicts"]:
        if v["status"] != "ok":
            lines.append(f"| {_label(v)} | {v['status']} | | |")
            continue
        score = "within" if v["score_within_tolerance"] else "NOT within"
        clock = "within" if v["time_within_tolerance"] else "NOT within"
        lines.append(f"| {_label(v)} | {v['auto_score']:.3f} vs {v['best_fixed_score']:.3f} (k = "
                     f"{v['best_fixed_lag']}): {score} | {_seconds(v['auto_time'])} vs "
                     f"{_seconds(v['fastest_fixed_time'])} (k = {v['fastest_fixed_lag']}): {clock} | "
                     f"{'yes' if v['goal_met'] else 'no'} |")
    mismatched = [e for e in summary["table"] if e.get("numerics") and e["status"] == "ok"]
    if mismatched:
        judge = result["config"].get("auto_lag", {}).get("judge", "staleness")
        lines += ["", "The engine's numerics apart from staleness (means over seeds of each run's median; "
                  f"`auto` judged by `{judge}`): the lag-0 trajectories' ESS ratio (the mismatch alone) and "
                  "the ratio the bound's controller compared with τ:", "",
                  "| method | k | mismatch ESS median | mismatch ESS min | judged ESS median |",
                  "|---|---|---|---|---|"]
        lines += [f"| {_label(e)} | {e['lag']} | {_fmt(e['median_mismatch_ess_ratio'], '.4f')} | "
                  f"{_fmt(e['min_mismatch_ess_ratio'], '.4f')} | "
                  f"{_fmt(e['median_judged_ess_ratio'], '.4f')} |"
                  for e in mismatched]
    return "\n".join(lines) + "\n"


def _label(entry: dict[str, Any]) -> str:
    """A table row's method, with its numerics where they are not the matched ones."""
    return entry["method"] + (f" ({entry['numerics']})" if entry.get("numerics") else "")


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if math.isfinite(value) else "never"


def run_timed_staleness_bench(bench: StalenessTimedBenchConfig,
                              progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Run (or reuse) every job; JSON-able result; writes result.json, summary.json and summary.md into
    `bench.run_root`."""
    root = Path(bench.run_root)
    started = time.perf_counter()
    task_path, model_dir = staleness_bench.prepare(bench, root)
    initial = staleness_bench.success_probability(model_dir, bench)
    progress(f"[bench staleness timed] pre-taught policy: success probability {initial:.3f}")
    rows = staleness_bench.run_jobs(bench, jobs(bench), model_dir, task_path, root, progress,
                                    runner=run_timed)
    order = {name: i for i, name in enumerate(m.name for m in bench.methods)}
    rows.sort(key=lambda r: (order[r["method"]], str(r["lag"]), r["seed"]))
    result: dict[str, Any] = {"benchmark": "staleness_timed", "config": bench.model_dump(mode="json"),
                              "initial_success": initial, "runs": rows, "summary": timed_summary(bench, rows),
                              "cpu_count": os.cpu_count(), "wall_s": round(time.perf_counter() - started, 1)}
    (root / "result.json").write_text(json.dumps(result, indent=1, allow_nan=True))
    (root / "summary.json").write_text(json.dumps(compact(result), indent=1, allow_nan=True))
    (root / "summary.md").write_text(format_timed(result))
    return result


def compact(result: dict[str, Any]) -> dict[str, Any]:
    """What docs/results/staleness_timed.json keeps: the settings, the table and the verdicts."""
    config = result["config"]
    return {"benchmark": "staleness_timed", "initial_success": result["initial_success"],
            "config": {k: config[k] for k in ("lags", "seeds", "steps", "groups_per_step", "group_size",
                                              "numerics", "clock", "auto_lag", "eval_every",
                                              "target_fraction", "score_tolerance", "time_tolerance")},
            "methods": {m["name"]: {"algo": m["algo"], "lr": m["lr"]} for m in config["methods"]},
            "summary": result["summary"]}
