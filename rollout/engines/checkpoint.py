"""HF checkpoint names and shapes, checked before any weight push; safetensors export for servers.

`load_weights(named_tensors, version)` takes HF parameter names. Engines that cannot validate names
themselves without side effects (vLLM's loader raises half-way through a load) check them here
against the checkpoint they started from, read from safetensors headers only (no tensor data).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

_CONFIG_FILES = ("config.json", "generation_config.json")


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of every tensor in `model_dir`'s safetensors files. A tied checkpoint that
    omits `lm_head.weight` still accepts it (with the embedding's shape): learners' state dicts
    carry both names."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    if _is_tied(model_dir) and "lm_head.weight" not in shapes:
        embedding = next((name for name in shapes if name.endswith("embed_tokens.weight")), None)
        if embedding is not None:
            shapes["lm_head.weight"] = shapes[embedding]
    return shapes


def check_named_tensors(
    named_tensors: Iterable[tuple[str, Tensor]], shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Raise ValueError naming every unknown name and shape mismatch (up to 5 of each)."""
    unknown, mismatched = [], []
    for name, tensor in named_tensors:
        if name not in shapes:
            unknown.append(name)
        elif tuple(tensor.shape) != shapes[name]:
            mismatched.append(f"{name}: got {tuple(tensor.shape)}, checkpoint has {shapes[name]}")
    if unknown or mismatched:
        raise ValueError(
            f"{len(unknown)} unknown names {unknown[:5]}, {len(mismatched)} shape mismatches "
            f"{mismatched[:5]}; send the model's HF state dict names"
        )


def write_checkpoint(
    named_tensors: Iterable[tuple[str, Tensor]], out_dir: Path, source_dir: Path | None
) -> Path:
    """Save tensors as `out_dir/model.safetensors` (+ config files of `source_dir`) for a server to load.

    `lm_head.weight` is dropped when it is the tied embedding (safetensors refuses shared storage;
    loaders re-tie it). Returns `out_dir`.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in named_tensors}
    if source_dir is not None and _is_tied(source_dir):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for name in _CONFIG_FILES if source_dir is not None else ():
        if (Path(source_dir) / name).is_file():
            shutil.copyfile(Path(source_dir) / name, out_dir / name)
    return out_dir


def _is_tied(model_dir: Path) -> bool:
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return False
    return bool(json.loads(config_path.read_text()).get("tie_word_embeddings", False))
