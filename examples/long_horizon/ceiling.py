"""What a loop that only truncates can reach on the keychain task, and what each arm reached, by chain length.

A chain of h hops needs h tool turns; without compaction the whole history must fit in the task's token
budget, so past some length even a perfect policy is cut off. This replays the solver (agent_env/keychain.py's
turns, written as a perfect policy would) through the truncating arm's own loop and real sandbox on exactly
the prompts each set evaluated, and counts the episodes that end inside the budget: the truncating arm's
ceiling. Beside it, every arm's last evaluation of every seed, split by chain length.

    .venv/bin/python examples/long_horizon/ceiling.py --out docs/results/long_horizon_ceiling.json

Reads only committed evidence (docs/results/long_horizon*_runs/): each arm's task.yaml, config.yaml and
evaluation files.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from agent_env.datasets import load_samples  # noqa: E402
from agent_env.demonstrations import solver_finishes  # noqa: E402
from agent_env.evaluation.heldout import result_from_file  # noqa: E402
from benchmarks.main_job import last_evaluations  # noqa: E402
from configs.task_schema import TaskConfig  # noqa: E402
from rollout.models import default_cache_dir, load_tokenizer  # noqa: E402
from run.train.warm_start import KEYCHAIN_SOLVER  # noqa: E402
from run.train.wiring import load_task  # noqa: E402

ARMS = {"compaction": "docs/results/long_horizon_runs",
        "truncation (warm start of 8)": "docs/results/long_horizon_truncate_runs",
        "truncation (tuned warm start)": "docs/results/long_horizon_truncate_tuned_runs"}
"""Each arm's evidence folder (`vcpo bench main_job`'s evidence_dir); an arm not run yet is left out."""

TRUNCATING_ARM = "docs/results/long_horizon_truncate_runs"


def _prompts(eval_file: Path) -> list[str]:
    """The prompt ids an evaluation file evaluated (its meta line)."""
    with eval_file.open() as lines:
        meta = json.loads(lines.readline())
    return list(meta["meta"]["prompts"])


def _set_samples(task: TaskConfig, config: dict[str, Any], name: str, prompt_ids: list[str]) -> list[Any]:
    """The samples of set `name` (heldout, or an eval set of the run config) with these ids, in that order."""
    if name == "heldout":
        dataset = task.heldout_dataset
    else:
        spec = next(s for s in config["trainer"]["eval_sets"] if s["name"] == name)
        # a run's config.yaml lists every generator setting; the keychain generator takes its own only
        own = ("num_samples", "seed", "min_hops", "max_hops")
        dataset = task.dataset.model_copy(update={key: spec["dataset"][key] for key in own})
    loaded = load_samples(task.model_copy(update={"dataset": dataset}), which="train", task_dir=ROOT).samples
    by_id = {sample.sample_id: sample for sample in loaded}
    return [by_id[prompt] for prompt in prompt_ids]


def ceiling(evidence: Path, tokenizer: Any) -> dict[str, Any]:
    """Per set the truncating arm evaluated: the prompts whose solver episode ends inside its budget, by
    chain length."""
    config = yaml.safe_load((evidence / "config.yaml").read_text())
    task, _ = load_task(ROOT / config["task"], config["task_overrides"])
    sets: dict[str, Any] = {}
    for name, last in last_evaluations(evidence).items():
        samples = _set_samples(task, config, name, _prompts(last))
        finishes = solver_finishes(task, samples, tokenizer, KEYCHAIN_SOLVER)
        by_hops: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for sample in samples:
            row = by_hops[int(sample.fields["hops"])]
            row[0] += 1
            row[1] += finishes[sample.sample_id]
        sets[name] = {"prompts": len(samples), "solver_finishes": sum(finishes.values()),
                      "share": round(sum(finishes.values()) / len(samples), 4),
                      "by_hops": {str(h): {"prompts": n, "solver_finishes": f}
                                  for h, (n, f) in sorted(by_hops.items())},
                      "hops_of": {sample.sample_id: int(sample.fields["hops"]) for sample in samples}}
    return {"budget_tokens": task.loop.max_total_tokens, "compaction": task.loop.context.compaction,
            "sets": sets}


def arm_by_hops(evidence_root: Path, hops_of: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Per seed and set: the last evaluation's success split by chain length."""
    seeds: dict[str, Any] = {}
    for seed_dir in sorted(evidence_root.glob("seed_*")):
        row: dict[str, Any] = {}
        for name, last in last_evaluations(seed_dir).items():
            result = result_from_file(last)
            split: dict[int, list[float]] = defaultdict(lambda: [0, 0.0])
            for prompt, score in result.per_prompt.items():
                cell = split[hops_of[name][prompt]]
                cell[0] += 1
                cell[1] += score
            row[name] = {"step": result.version, "success": round(result.success, 4),
                         "by_hops": {str(h): {"prompts": int(n), "success": round(s / n, 4)}
                                     for h, (n, s) in sorted(split.items())}}
        seeds[seed_dir.name.removeprefix("seed_")] = row
    return seeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON here (else stdout)")
    args = parser.parse_args()
    truncating = sorted((ROOT / TRUNCATING_ARM).glob("seed_*"))[0]
    tokenizer = load_tokenizer(yaml.safe_load((truncating / "config.yaml").read_text())["model"]["path"],
                               default_cache_dir())
    found = ceiling(truncating, tokenizer)
    hops_of = {name: entry.pop("hops_of") for name, entry in found["sets"].items()}
    found["arms"] = {name: arm_by_hops(ROOT / folder, hops_of)
                     for name, folder in ARMS.items() if (ROOT / folder).is_dir()}
    text = json.dumps(found, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
