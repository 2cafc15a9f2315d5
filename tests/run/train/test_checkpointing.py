"""Checkpoint writes that fail (a full disk) leave the previous checkpoint as `latest` and no partial copy;
a config that changed what a checkpoint's batches depend on is refused before resuming."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from run.train import checkpointing
from run.train.checkpointing import (
    CheckpointWriteError,
    latest_checkpoint,
    load_checkpoint,
    resume_conflicts,
    save_checkpoint,
)


def test_a_failed_write_removes_its_partial_copy_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    save_checkpoint(tmp_path, 1, {"weights": torch.ones(3)}, {"note": "first"}, keep=2)
    real_save = torch.save

    def short_write(state: Any, handle: Any) -> None:  # what torch.save does when the disk fills up
        real_save(state, handle)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 304695936 vs "
                           "304695824")

    monkeypatch.setattr(checkpointing.torch, "save", short_write)
    expected = (r"could not write checkpoint step 2 .* GiB free there\. The newest complete checkpoint is "
                r"step_000001, untouched")
    with pytest.raises(CheckpointWriteError, match=expected):
        save_checkpoint(tmp_path, 2, {"weights": torch.zeros(3)}, {}, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]  # no .tmp-* left
    state, meta = load_checkpoint(latest_checkpoint(tmp_path))
    assert torch.equal(state["weights"], torch.ones(3)) and meta["note"] == "first"


def test_an_unwritable_directory_is_reported_the_same_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(checkpointing, "_write_files", refuse)
    with pytest.raises(CheckpointWriteError, match="newest complete checkpoint is none"):
        save_checkpoint(tmp_path, 1, {}, {}, keep=1)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == []


def test_a_resume_with_another_batch_shape_seed_or_a_smaller_lag_bound_is_refused(tmp_path: Path) -> None:
    from configs.schema import RunConfig

    saved = RunConfig().model_dump(mode="json")
    assert resume_conflicts(tmp_path, saved) == []  # no checkpoint yet
    save_checkpoint(tmp_path, 3, {}, {"version": 3, "config": saved}, keep=1)
    assert resume_conflicts(tmp_path, saved) == []

    def changed(**fields: Any) -> dict[str, Any]:
        config = RunConfig().model_dump(mode="json")
        for dotted, value in fields.items():
            *parents, leaf = dotted.split("__")
            tree = config
            for part in parents:
                tree = tree[part]
            tree[leaf] = value
        return config

    group_size, lag = saved["algo"]["group_size"], saved["rollout"]["max_lag"]
    (problem,) = resume_conflicts(tmp_path, changed(algo__group_size=group_size + 1))
    checkpoint = tmp_path / "checkpoints" / "step_000003"
    assert problem == (f"algo.group_size: {group_size + 1}, but {checkpoint} was written with "
                       f"algo.group_size={group_size}; resume with algo.group_size={group_size}, "
                       "or train into a new run_dir")
    assert [p.split(":")[0] for p in resume_conflicts(tmp_path, changed(rollout__groups_per_step=99, seed=7))
            ] == ["rollout.groups_per_step", "seed"]
    assert resume_conflicts(tmp_path, changed(rollout__max_lag=lag + 1, optim__lr=0.5)) == []  # both fine
    if lag > 0:
        (problem,) = resume_conflicts(tmp_path, changed(rollout__max_lag=lag - 1))
        assert problem.startswith(f"rollout.max_lag: {lag - 1}, but ") and f"max_lag ≥ {lag}" in problem


def test_a_resume_compares_the_lag_ceilings_of_fixed_and_auto_bounds(tmp_path: Path) -> None:
    """With `max_lag: auto` the groups a checkpoint holds lag at most auto_lag.max_lag: a resume may switch
    between a fixed and an auto bound as long as the new ceiling is not below the saved one."""
    from configs.schema import RunConfig

    def dump(rollout: dict[str, Any]) -> dict[str, Any]:
        return RunConfig.model_validate({"rollout": rollout}).model_dump(mode="json")

    save_checkpoint(tmp_path, 2, {}, {"version": 2, "config": dump({"max_lag": "auto",
                                                                   "auto_lag": {"max_lag": 4}})}, keep=1)
    assert resume_conflicts(tmp_path, dump({"max_lag": 4})) == []
    assert resume_conflicts(tmp_path, dump({"max_lag": "auto", "auto_lag": {"max_lag": 6}})) == []
    (problem,) = resume_conflicts(tmp_path, dump({"max_lag": 3}))
    assert problem.startswith("rollout.max_lag: 3, but ") and "rollout.auto_lag.max_lag=4" in problem
    (problem,) = resume_conflicts(tmp_path, dump({"max_lag": "auto", "auto_lag": {"max_lag": 2}}))
    assert problem.startswith("rollout.auto_lag.max_lag: 2") and "rollout.auto_lag.max_lag ≥ 4" in problem
