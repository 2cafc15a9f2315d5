"""Checkpoint writes that fail (a full disk) leave the previous checkpoint as `latest` and no partial copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from learner.train import checkpointing
from learner.train.checkpointing import (
    CheckpointWriteError,
    latest_checkpoint,
    load_checkpoint,
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
