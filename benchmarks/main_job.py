"""`vcpo bench main_job`: the main job's claim, measured the way a user would run it — `vcpo train` of the
shipped config once per seed (seeds fixed before any runs), each a fresh process with its warm start
trained (the cache key holds the seed, so no seed reuses another's) — and summarized from small files
kept as evidence, so that the summary can be recomputed (and checked) without rerunning anything.

Per seed: held-out success at every evaluation with its 95% interval (recomputed from the evaluation
files), the start → end change paired by prompt, the lowest evaluation's change from the start (a
collapse shows as an interval wholly below 0), the training trend (`vcpo trend`'s estimate), wall time
of the process and by phase, and the host. Overall: whether every seed meets `min_gain` with its interval
above 0 and without a significant fall.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent_env.evaluation.heldout import HeldoutResult, paired_change, result_from_file
from benchmarks.schema import MainJobBenchConfig
from run.observability import metric_names as names
from run.observability.metrics_log import read_metrics
from run.observability.trend import TRAJECTORIES_FILE, reward_trend
from run.train.warm_start import is_search_program

EVIDENCE_FILES = ("config.yaml", "task.yaml", "summary.json", "metrics.jsonl")
"""A run's small files kept per seed, beside its `eval/` folder and its trajectory log without the text
(checkpoints, exports and the trained episodes' text stay behind)."""

TIMING_FILE = "timing.json"
"""The bench's own measurement of a seed's `vcpo train` process: wall seconds from launch to exit."""


def run_main_job_bench(bench: MainJobBenchConfig, repo_root: Path,
                       progress: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Train every seed that has no evidence yet (when `bench.run`), then summarize the evidence."""
    evidence_root = repo_root / bench.evidence_dir
    for seed in bench.seeds:
        evidence = evidence_root / f"seed_{seed}"
        if (evidence / TIMING_FILE).is_file():
            progress(f"[main_job] seed {seed}: evidence in {evidence}, not run again")
            continue
        if not bench.run:
            raise FileNotFoundError(f"{evidence} has no finished run of seed {seed}; run the bench with "
                                    "run=true, or drop the seed from `seeds`")
        run_dir = repo_root / bench.runs_dir / f"seed_{seed}"
        command = [sys.executable, "-m", "cli", "train", str(repo_root / bench.config),
                   f"seed={seed}", f"run_dir={run_dir}", *bench.overrides]
        progress(f"[main_job] seed {seed}: {' '.join(command[3:])}")
        started = time.perf_counter()
        finished = subprocess.run(command, cwd=repo_root, check=False)
        wall_s = time.perf_counter() - started
        if finished.returncode != 0:
            raise RuntimeError(f"seed {seed}: `vcpo train` exited with {finished.returncode}; its run dir "
                               f"{run_dir} resumes on the next call")
        base = None
        if bench.base_model:  # the same evaluations of the model before its warm start
            base = run_dir.with_name(run_dir.name + "_base")
            base_command = [*command, f"run_dir={base}", "warm_start.enabled=false", "--stop-after-step", "0"]
            progress(f"[main_job] seed {seed}, the model before its warm start: {' '.join(base_command[3:])}")
            if subprocess.run(base_command, cwd=repo_root, check=False).returncode != 0:
                raise RuntimeError(f"seed {seed}: the base model's evaluation failed (log in {base})")
        keep_evidence(run_dir, evidence, wall_s, base)
    baselines = {name: repo_root / folder for name, folder in bench.baselines.items()}
    return summarize_main_job(evidence_root, bench.seeds, bench.min_gain, baselines)


def keep_evidence(run_dir: Path, evidence: Path, wall_s: float, base: Path | None = None) -> None:
    """Copy `run_dir`'s small files into `evidence` (written beside and renamed into place): with its
    evaluation files (every eval set's under eval/<name>/), and `base`'s evaluations under base/eval/."""
    tmp = evidence.with_name(evidence.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "eval").mkdir(parents=True)
    for name in EVIDENCE_FILES:
        shutil.copy2(run_dir / name, tmp / name)
    keep_trajectory_log(run_dir / TRAJECTORIES_FILE, tmp / TRAJECTORIES_FILE)
    for source, target in ((run_dir, tmp), *(((base, tmp / "base"),) if base is not None else ())):
        for path in sorted((source / "eval").glob("**/version_*.jsonl")):
            destination = target / "eval" / path.relative_to(source / "eval")
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination)
    (tmp / TIMING_FILE).write_text(json.dumps({"process_wall_s": round(wall_s, 1)}) + "\n")
    shutil.rmtree(evidence, ignore_errors=True)
    tmp.rename(evidence)


def keep_trajectory_log(source: Path, target: Path) -> None:
    """Copy the trajectory log without the trained episodes' text (each record's and each segment's): what
    the summary reads — step, reward, lag, versions, turn and segment counts — stays; the text, most of the
    file, stays in the run's folder (the held-out episodes' text is kept in the evaluation files). A line
    that is not a record (a torn last line) is copied as it is, for `vcpo trend` to judge."""
    lines = source.read_text(encoding="utf-8").splitlines(keepends=True)
    with target.open("w", encoding="utf-8") as out:
        for line in lines:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            out.write(json.dumps(without_text(record)) + "\n" if isinstance(record, dict) else line)


def without_text(record: dict[str, Any]) -> dict[str, Any]:
    """A trajectory log record without its decoded text (its segments' too)."""
    kept = {key: value for key, value in record.items() if key != "text"}
    if isinstance(kept.get("segments"), list):
        kept["segments"] = [{key: value for key, value in segment.items() if key != "text"}
                            if isinstance(segment, dict) else segment for segment in kept["segments"]]
    return kept


def _strategies(path: Path) -> dict[str, dict[str, int]]:
    """How one evaluation's episodes used the tool — with the warm start's search program or otherwise —
    and how many of each solved their puzzle: what the policy learned to do, beside how well."""
    counts = {"search_program": {"episodes": 0, "correct": 0}, "other": {"episodes": 0, "correct": 0}}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("kind") != "sample":
            continue
        code = "\n".join(turn.get("code") or "" for turn in record.get("turns", []))
        row = counts["search_program" if is_search_program(code) else "other"]
        row["episodes"] += 1
        row["correct"] += bool(record.get("is_correct"))
    return counts


def _evaluation(result: HeldoutResult, path: Path) -> dict[str, Any]:
    return {"step": result.version, "success": round(result.success, 4), "low": round(result.low, 4),
            "high": round(result.high, 4), "prompts": len(result.per_prompt), "strategies": _strategies(path)}


def summarize_seed(evidence: Path, min_gain: float) -> dict[str, Any]:
    """One seed's figures, from its evidence folder alone."""
    paths = sorted((evidence / "eval").glob("version_*.jsonl"))
    results = [result_from_file(path) for path in paths]
    if len(results) < 2 or results[0].version != 0:
        raise ValueError(f"{evidence}: needs the evaluation before the first step and a later one, has "
                         f"{[result.version for result in results]}")
    start, end = results[0], results[-1]
    change = paired_change(start, end)
    lowest = min((paired_change(start, result) for result in results[1:]), key=lambda c: c.gain)
    summary = json.loads((evidence / "summary.json").read_text())
    timing = json.loads((evidence / TIMING_FILE).read_text())
    trend = reward_trend(evidence)
    meets = change.gain >= min_gain and change.low > 0 and lowest.high >= 0
    return {
        "heldout": [_evaluation(result, path) for result, path in zip(results, paths, strict=True)],
        "gain": round(change.gain, 4), "gain_low": round(change.low, 4), "gain_high": round(change.high, 4),
        "lowest_change": {"step": lowest.end.version, "gain": round(lowest.gain, 4),
                          "high": round(lowest.high, 4)},
        "collapsed": lowest.high < 0,
        "meets_target": meets,
        "training_success_first_to_last_third": trend["success_change_first_to_last_third"],
        "training_success_first_to_last_third_ci95": trend["ci95_change_first_to_last_third"],
        "process_wall_s": timing["process_wall_s"],
        "run_wall_s": round(summary["wall_s"], 1),
        "phases_s": {name: round(seconds, 1) for name, seconds in summary["phases_s"].items()},
        "host": summary["host"],
        "learner": _learner_load(evidence),
        **_eval_sets(evidence),
        **_base_model(evidence),
    }


def _learner_load(evidence: Path) -> dict[str, float | None]:
    """What the learner did per step, averaged over the run's steps: its seconds, the sampled tokens it
    trained, every token it read (contexts included: what a managed context's repeated contexts cost), the
    episodes' segments and compactions, the weight push's seconds, and how far behaviour and learner
    policies were apart (the batch's mean lag, KL estimate k3 and ESS ratio: how much each step moves the
    policy shows in them at lag > 0). None where the run did not log the metric."""
    if not (evidence / "metrics.jsonl").is_file():
        return {}
    steps = [r for r in read_metrics(evidence) if r.get("trainer_step", 0) >= 1]

    def mean(name: str, digits: int = 2) -> float | None:
        values = [float(r[name]) for r in steps if r.get(name) is not None]
        return round(sum(values) / len(values), digits) if values else None

    return {"learner_s_per_step": mean(names.TIME_TRAIN),
            "tokens_trained_per_step": mean(names.TOKENS_TRAINED),
            "tokens_read_per_step": mean(names.TOKENS_LEARNER_INPUT),
            "segments_per_episode": mean(names.ROLLOUT_SEGMENTS_MEAN),
            "compactions_per_episode": mean(names.ROLLOUT_COMPACTIONS_MEAN),
            "weight_sync_s_per_step": mean(names.TIME_WEIGHT_SYNC),
            "lag_per_step": mean(names.STALENESS_MEAN),
            "kl_k3_per_step": mean(names.IS_KL_K3, digits=6),
            "ess_ratio_per_step": mean(names.IS_ESS_RATIO, digits=4)}


def _eval_sets(evidence: Path) -> dict[str, Any]:
    """Each eval set's evaluations (trainer.eval_sets: e.g. the test set no choice was tuned on) and its start
    → end change paired by prompt; {} without any."""
    sets: dict[str, Any] = {}
    for folder in sorted(p for p in (evidence / "eval").iterdir() if p.is_dir()):
        paths = sorted(folder.glob("version_*.jsonl"))
        results = [result_from_file(path) for path in paths]
        evaluations = [_evaluation(result, path) for result, path in zip(results, paths, strict=True)]
        entry: dict[str, Any] = {"evaluations": evaluations}
        if len(results) >= 2 and results[0].version == 0:
            change = paired_change(results[0], results[-1])
            entry.update(gain=round(change.gain, 4), gain_low=round(change.low, 4),
                         gain_high=round(change.high, 4))
        sets[folder.name] = entry
    return {"eval_sets": sets} if sets else {}


def _base_model(evidence: Path) -> dict[str, Any]:
    """The model before its warm start, on the held-out set and every eval set (base/eval/): {} if not run."""
    folder = evidence / "base" / "eval"
    if not folder.is_dir():
        return {}
    found = {"heldout": folder / "version_000000.jsonl",
             **{p.name: p / "version_000000.jsonl" for p in sorted(folder.iterdir()) if p.is_dir()}}
    return {"base_model": {name: _evaluation(result_from_file(path), path)
                           for name, path in found.items() if path.is_file()}}


def last_evaluations(evidence: Path) -> dict[str, Path]:
    """The last evaluation file of the held-out set ("heldout") and of every eval set in a seed's evidence."""
    folders = [("heldout", evidence / "eval"),
               *((p.name, p) for p in sorted((evidence / "eval").iterdir()) if p.is_dir())]
    return {name: paths[-1] for name, folder in folders if (paths := sorted(folder.glob("version_*.jsonl")))}


def _final_results(evidence: Path) -> dict[str, HeldoutResult]:
    """The last evaluation of the held-out set and of every eval set in a seed's evidence, by set name."""
    return {name: result_from_file(path) for name, path in last_evaluations(evidence).items()}


def versus_baseline(evidence: Path, baseline: Path) -> dict[str, Any]:
    """Per set both arms evaluated: this arm's final success, the baseline's, and the difference paired by
    prompt with its 95% interval (each arm at its own last evaluation)."""
    if not baseline.is_dir():
        raise FileNotFoundError(f"{baseline}: the baseline has no evidence of this seed; run its bench first")
    ours, theirs = _final_results(evidence), _final_results(baseline)
    rows: dict[str, Any] = {}
    for name in sorted(set(ours) & set(theirs)):
        mine, other = ours[name], theirs[name]
        change = paired_change(other, mine)
        rows[name] = {"success": round(mine.success, 4), "baseline_success": round(other.success, 4),
                      "step": mine.version, "baseline_step": other.version,
                      "difference": round(change.gain, 4), "low": round(change.low, 4),
                      "high": round(change.high, 4),
                      "prompts": len(set(mine.per_prompt) & set(other.per_prompt))}
    return rows


def summarize_main_job(evidence_root: Path, seeds: list[int], min_gain: float,
                       baselines: dict[str, Path] | None = None) -> dict[str, Any]:
    """Every seed's figures and the claim over all of them; with `baselines` (name → another bench's
    evidence root), each seed's final success against each baseline's (`versus`) and each baseline's learner
    block beside this arm's (`baseline_learner`)."""
    per_seed = {str(seed): summarize_seed(evidence_root / f"seed_{seed}", min_gain) for seed in seeds}
    for seed in seeds:
        versus = {name: versus_baseline(evidence_root / f"seed_{seed}", root / f"seed_{seed}")
                  for name, root in (baselines or {}).items()}
        if versus:
            per_seed[str(seed)]["versus"] = versus
            per_seed[str(seed)]["baseline_learner"] = {name: _learner_load(root / f"seed_{seed}")
                                                       for name, root in (baselines or {}).items()}
    walls = [row["process_wall_s"] for row in per_seed.values()]
    return {
        "seeds": per_seed,
        "min_gain": min_gain,
        "every_seed_meets_target": all(row["meets_target"] for row in per_seed.values()),
        "gain_mean": round(sum(row["gain"] for row in per_seed.values()) / len(per_seed), 4),
        "process_wall_s_max": max(walls),
    }
