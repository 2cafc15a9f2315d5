"""A run config of the tiny random model on generated Countdown (HF engine, no tool): what the benchmarks'
tests drive through a real `vcpo train` process in seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def tiny_countdown_run(tmp_path: Path, model_dir: Path, *, max_total_tokens: int,
                       **sections: dict[str, Any]) -> Path:
    """Write `task.yaml` and `run.yaml` into `tmp_path`; `sections` (e.g. `trainer={...}`) join the run's
    model, task, engine, algo and learner sections. Returns the run config's path."""
    task = {
        "name": "tiny-countdown",
        "dataset": {"type": "generator", "name": "countdown", "num_samples": 16, "seed": 0},
        "heldout_dataset": {"type": "generator", "name": "countdown", "num_samples": 16, "seed": 1},
        "fields": {"answer": {"target": "target", "numbers": "nums"},
                   "template_fields": {"numbers": "nums", "target": "target"}},
        "prompt": {"system": "Answer.", "user": "Make {target} from {numbers}."},
        "tool": None,
        "loop": {"max_turns": 1, "max_total_tokens": max_total_tokens, "max_new_tokens_per_turn": 12},
        "reward": {"type": "countdown"},
    }
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    run = {"model": {"path": str(model_dir)}, "task": str(tmp_path / "task.yaml"),
           "engine": {"backend": "hf", "max_batch_size": 16},
           "algo": {"objective": {"type": "vcpo"}, "group_size": 4},
           "learner": {"device": "cpu", "micro_batch_tokens": 1024}, **sections}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    return path
