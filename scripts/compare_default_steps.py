"""Time the default run's RL step at two commits on this machine, back to back.

    .venv/bin/python scripts/compare_default_steps.py --before <rev> [--steps 8] [--model DIR]
        [--after-set a.b=c ...] [a.b=c ...]

Checks `<rev>` out into a temporary git worktree and runs `vcpo train configs/default.yaml` there and in
this checkout, one after the other, with the same seed, data order and starting weights — both from
`--model` (default: this checkout's cached warm start of the default config, trained first if
missing), with `warm_start.enabled=false`, so only the RL steps differ. Positional `a.b=c` overrides go
to both sides; `--after-set a.b=c` (repeatable) only to this checkout's run (e.g. an opt-in that changes
numerics, timed against the same `before`).

Prints one JSON object: per side the step times (`time/step`, `time/train`, `time/generate`) and the
process CPU-seconds (`time/cpu`, tool-call children included) of steps 2..N (step 1 includes the
engine's first fill of the pipeline), their medians, and the medians over the steps with generation
alongside and over the last steps without it (the learner alone); then the ratios after/before of the
median and of the mean step (the mean is what a run's wall time adds up; per step the counts of
degenerate groups and of groups the learner skipped are printed too, since a step's time depends on
them). Where the CPU goes: on a machine whose cores the engine and the learner share, a step
cannot be shorter than its CPU-seconds over the cores, so `cpu_floor_s` (median CPU-seconds of the steps
with generation ÷ cores) and `generation_cpu_s` (that median minus the learner-alone median) say how much
of a step is work that overlap cannot hide. Hosts differ and memory bandwidth swings: compare only the
numbers of one invocation.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from learner.benchmarks.step_mix import mean_by_kind, mix_adjusted_mean

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"
KEYS = ("step", "train", "generate", "cpu")


def _run(tree: Path, run_dir: Path, model: str, steps: int, extra: list[str]) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [str(PYTHON), "-m", "cli", "train", str(tree / "configs" / "default.yaml"),
               f"run_dir={run_dir}", f"model.path={model}", "warm_start.enabled=false",
               f"trainer.total_steps={steps}", "--no-progress", *extra]
    subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {key: [float(r.get(f"time/{key}") or 0.0) for r in records[1:]] for key in KEYS} | {
        key: [float(r.get(f"train/{key}") or 0.0) for r in records[1:]] for key in GROUP_COUNTS}


GROUP_COUNTS = ("degenerate_groups", "skipped_groups")
"""Per timed step: groups whose rewards were all equal, and those the learner left out of its gradient pass
(VCPO; 0 where a checkout does not log it). A step's learner time
depends on them, so the two sides' counts are printed next to their times."""


def _summary(times: dict[str, list[float]], cores: int) -> dict[str, object]:
    """Medians over all timed steps, over those with generation alongside and over the learner-alone ones."""
    out: dict[str, object] = {**times, **{f"median_{k}_s": statistics.median(times[k]) for k in KEYS},
                              **{f"mean_{k}_s": statistics.fmean(times[k]) for k in KEYS}}
    out.update({f"total_{key}": sum(times[key]) for key in GROUP_COUNTS})
    out["mean_step_s_by_degenerate_groups"] = mean_by_kind(times["step"], times["degenerate_groups"])
    overlapped = [i for i, g in enumerate(times["generate"]) if g > 0]
    alone = [i for i, g in enumerate(times["generate"]) if g == 0]
    for name, rows in (("with_generation", overlapped), ("learner_alone", alone)):
        if rows:
            out[name] = {f"median_{key}_s": statistics.median(times[key][i] for i in rows)
                         for key in ("step", "cpu")}
    if overlapped:
        cpu = statistics.median(times["cpu"][i] for i in overlapped)
        out["cpu_floor_s"] = cpu / cores
        if alone:
            out["generation_cpu_s"] = cpu - statistics.median(times["cpu"][i] for i in alone)
    return out


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """`rev` checked out in a temporary git worktree of this repository, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="vcpo-checkout-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False,
                           capture_output=True)


def _warm_start_model() -> str:
    """This checkout's cached warm start of the default config (trained now if it is not cached)."""
    code = ("from pathlib import Path\n"
            "from configs.loader import load_config\n"
            "from configs.schema import RunConfig\n"
            "from learner.train.compose import load_task\n"
            "from learner.train.warm_start import run_warm_start\n"
            "from rollout.models import default_cache_dir\n"
            "c = load_config('configs/default.yaml', RunConfig)\n"
            "t, p = load_task(c.task, c.task_overrides, relative_to=Path('configs'))\n"
            "print(run_warm_start(c, t, p, default_cache_dir()))\n")
    done = subprocess.run([str(PYTHON), "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit to compare this checkout with")
    parser.add_argument("--steps", type=int, default=6, help="RL steps per side (the first is not timed)")
    parser.add_argument("--model", default=None, help="starting weights (default: the cached warm start)")
    parser.add_argument("--after-set", action="append", default=[], metavar="A.B=C",
                        help="an override for this checkout's run only (repeatable)")
    parser.add_argument("overrides", nargs="*", help="a.b.c=value overrides for both sides")
    args = parser.parse_args()
    model = args.model or _warm_start_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    result: dict[str, object] = {"before": args.before, "after": "working tree", "after_only": args.after_set,
                                 "model": model, "steps_timed": args.steps - 1, "cores": cores}
    with tempfile.TemporaryDirectory(prefix="vcpo-compare-") as tmp, checkout(args.before) as before_tree:
        for side, tree, extra in (("before", before_tree, args.overrides),
                                  ("after", ROOT, [*args.overrides, *args.after_set])):
            times = _run(tree, Path(tmp) / f"run-{side}", model, args.steps, extra)
            result[side] = _summary(times, cores)
    before, after = result["before"], result["after"]
    ratio = after["median_step_s"] / before["median_step_s"]  # type: ignore[index]
    result["step_ratio_after_over_before"] = ratio
    # the mean is what a run's wall time sums: since VCPO skips degenerate groups the steps of one run
    # differ (a step whose groups all scored alike is generation alone); the median shows the commoner kind
    mean_ratio = after["mean_step_s"] / before["mean_step_s"]  # type: ignore[index]
    result["mean_step_ratio_after_over_before"] = mean_ratio
    # and on the same data: the after side's time per kind of step, over the before side's mix of kinds
    adjusted = mix_adjusted_mean(after["mean_step_s_by_degenerate_groups"],  # type: ignore[index]
                                 before["degenerate_groups"])  # type: ignore[index]
    result["mix_adjusted_mean_step_ratio"] = None if adjusted is None else adjusted / before["mean_step_s"]  # type: ignore[index]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
