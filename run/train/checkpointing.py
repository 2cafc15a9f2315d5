"""Atomic training checkpoints: a run never loses data and never resumes from half a checkpoint.

Layout: `run_dir/checkpoints/step_000010/` holding `state.pt` (model, optimizer, step, RNG states,
rollout-manager state: data position, completed-unconsumed groups, slots in flight) and `meta.json`.
A checkpoint is written into a temporary sibling directory, every file is fsynced, the directory is
renamed into place (atomic on POSIX) and only then does `run_dir/checkpoints/latest` (written by
temp file + `os.replace`) point at it. A SIGKILL at any moment leaves either the previous
checkpoint or the new one as `latest`, never a torn one. Old checkpoints are pruned after.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from configs.schema import RolloutConfig

LATEST = "latest"


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    """Python and torch generator states (CUDA too when present)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, permissions, I/O error); the previous one is intact."""


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], meta: dict[str, Any], keep: int) -> Path:
    """Write checkpoint `step` atomically, point `latest` at it, keep the newest `keep`. Returns its dir.

    If writing fails (e.g. the disk is full) the partial copy is deleted at once — it would hold the
    space the user has to free — and `CheckpointWriteError` says which checkpoint is still `latest`."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp-step_{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write_files(tmp, step, state, meta)
    except (OSError, RuntimeError) as exc:  # torch.save reports a short write as RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(run_dir)
        free = shutil.disk_usage(root).free / 2**30
        raise CheckpointWriteError(
            f"could not write checkpoint step {step} under {root} ({type(exc).__name__}: {exc}); "
            f"{free:.1f} GiB free there. The newest complete checkpoint is "
            f"{previous.name if previous else 'none'}, untouched: free disk space (or fix the directory's "
            "permissions) and rerun the same command to resume from it") from exc
    if final.exists():  # a re-run of the same step after a resume: replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    pointer = root / f".{LATEST}.tmp-{os.getpid()}"
    pointer.write_text(final.name)
    with open(pointer) as handle:
        os.fsync(handle.fileno())
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    _prune(root, keep, final.name)
    return final


def _write_files(tmp: Path, step: int, state: dict[str, Any], meta: dict[str, Any]) -> None:
    """state.pt and meta.json into `tmp`, each fsynced, then the directory."""
    with open(tmp / "state.pt", "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    with open(tmp / "meta.json", "w") as handle:
        json.dump({**meta, "step": step}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_dir(tmp)


def _prune(root: Path, keep: int, newest: str) -> None:
    done = sorted(p for p in root.glob("step_*") if p.is_dir())
    for path in done[:-keep]:
        if path.name != newest:
            shutil.rmtree(path, ignore_errors=True)
    for stale in root.glob(".tmp-*"):  # left by a run killed mid-write
        shutil.rmtree(stale, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The directory `latest` points at, or None when the run has no complete checkpoint."""
    pointer = checkpoint_root(run_dir) / LATEST
    if not pointer.is_file():
        return None
    path = checkpoint_root(run_dir) / pointer.read_text().strip()
    return path if (path / "state.pt").is_file() and (path / "meta.json").is_file() else None


def load_checkpoint(
    path: Path, map_location: str | torch.device = "cpu"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state, meta) of a checkpoint directory."""
    state = torch.load(path / "state.pt", map_location=map_location, weights_only=False)
    meta = json.loads((path / "meta.json").read_text())
    return state, meta


# What a checkpoint's rollout state depends on: its batch slots hold groups of `group_size` episodes,
# `groups_per_step` to a slot, drawn from the data order that `seed` shuffles, each within the lag bound
# it was admitted under (≤ max_lag, or ≤ auto_lag.max_lag with max_lag: auto).
_RESUME_MUST_MATCH = (("algo", "group_size"), ("rollout", "groups_per_step"), ("seed",), ("learner", "lora"))


def resume_conflicts(run_dir: Path, config: dict[str, Any]) -> list[str]:
    """Why `config` (a RunConfig dump) cannot resume run_dir's newest checkpoint; [] when it can (or
    there is none). A larger lag ceiling (max_lag, or auto_lag.max_lag under auto), more total_steps or
    another lr are fine."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return []
    saved = json.loads((checkpoint / "meta.json").read_text()).get("config")
    if not isinstance(saved, dict):  # a checkpoint from before the config was kept: nothing to check
        return []

    def at(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
        for part in path:
            tree = tree.get(part, {}) if isinstance(tree, dict) else {}
        return tree

    problems = []
    for path in _RESUME_MUST_MATCH:
        was, now = at(saved, path), at(config, path)
        if was != {} and was != now:
            name = ".".join(path)
            problems.append(f"{name}: {now!r}, but {checkpoint} was written with {name}={was!r}; resume with "
                            f"{name}={was!r}, or train into a new run_dir")
    was_lag, now_lag = _lag_ceiling(saved), _lag_ceiling(config)
    if was_lag is not None and now_lag is not None and now_lag[0] < was_lag[0]:
        problems.append(f"{now_lag[1]}: {now_lag[0]}, but {checkpoint} holds groups generated under "
                        f"{was_lag[1]}={was_lag[0]}, which may lag more than {now_lag[0]}; resume with "
                        f"{now_lag[1]} ≥ {was_lag[0]}, or train into a new run_dir")
    return problems


def _lag_ceiling(config: dict[str, Any]) -> tuple[int, str] | None:
    """(the largest lag bound of a RunConfig dump, the field that sets it): `RolloutConfig.lag_ceiling` of its
    rollout section; None when the dump has none that validates (a checkpoint of another version)."""
    rollout = config.get("rollout") if isinstance(config, dict) else None
    try:
        section = RolloutConfig.model_validate(rollout)
    except ValidationError:
        return None
    return section.lag_ceiling, "rollout.auto_lag.max_lag" if section.max_lag == "auto" else "rollout.max_lag"
