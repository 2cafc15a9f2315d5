"""Finished runs' RL step times by how many of each step's groups were degenerate, and on a common mix.

    .venv/bin/python scripts/step_time_by_degenerate_groups.py RUN_DIR [RUN_DIR ...] [--mix RUN_DIR ...]

Why: since VCPO's degenerate groups (every episode of the group scored the same) are left out of the
learner's gradient pass, a step's time depends on how many of its groups were
degenerate, and that fraction depends on the policy — a run that collapses into all-equal rewards gets
fast. So two runs' mean steps compare their data as much as their code. For each run (its steps 2..N; step 1
includes the engines' start-up) this prints the mean `time/step` per count of degenerate groups, the
overall mean and the fraction of degenerate groups; with `--mix`, also each run's per-kind means weighted
by the pooled kinds of the `--mix` runs' steps: its mean step on their data (null when a kind of the mix
never occurred in the run). Reads `metrics.jsonl` only. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from learner.benchmarks.step_mix import mean_by_kind, mix_adjusted_mean


def _steps(run_dir: Path) -> tuple[list[float], list[float], int]:
    """(step seconds, degenerate-group counts) of steps 2..N, and the run's groups per step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = [r for r in rows[1:] if "time/step" in r and "train/degenerate_groups" in r]
    if not timed:
        raise SystemExit(f"{run_dir}/metrics.jsonl: no step after the first has time/step and "
                         "train/degenerate_groups; point at a finished `vcpo train` run directory")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    groups = int(config["rollout"]["groups_per_step"])
    degenerate = [float(r["train/degenerate_groups"]) for r in timed]
    return [float(r["time/step"]) for r in timed], degenerate, groups


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="finished `vcpo train` run directories")
    parser.add_argument("--mix", nargs="*", type=Path, default=[],
                        help="runs whose pooled kinds of steps weigh every run's per-kind means")
    args = parser.parse_args()
    mix = [count for run in args.mix for count in _steps(run)[1]]
    result: dict[str, object] = {"mix_runs": [str(run) for run in args.mix]}
    for run in args.runs:
        seconds, degenerate, groups = _steps(run)
        by_kind = mean_by_kind(seconds, degenerate)
        entry: dict[str, object] = {
            "steps": len(seconds), "mean_step_s": statistics.fmean(seconds),
            "median_step_s": statistics.median(seconds),
            "degenerate_group_fraction": sum(degenerate) / (groups * len(degenerate)),
            "mean_step_s_by_degenerate_groups": by_kind,
            "steps_by_degenerate_groups": {k: degenerate.count(float(k)) for k in by_kind},
        }
        if mix:
            entry["mean_step_s_on_mix"] = mix_adjusted_mean(by_kind, mix)
        result[str(run)] = entry
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
