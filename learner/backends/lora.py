"""LoRA adapters on the torch learner's model (`learner.lora`), with peft.

Only the adapters train: peft's `lora_A`/`lora_B` are plain `nn.Linear` layers, so VCPO's per-trajectory
norm hooks (learner/traj_grads/hooks.py) see them as any other trained linear layer and skip the frozen
base layers (they own no trainable parameter) — the norms are over the optimised vector, nothing else.

What the engines load is the merged policy, `W + scaling · B A` per adapted layer under the base model's own
parameter names (`merged_weights`): every engine (the HF engine, vLLM, vLLM-CPU) samples exactly what the
learner trains without an adapter runtime of its own, and a push replaces every tensor, as a full-weight run's
does (vLLM reloads fused projections whole). The base stays frozen in its dtype; merging is done in fp32 and
rounded once to the base's dtype, never merged into the trained module in place (merge/unmerge in bf16 would
drift by rounding every step).

A checkpoint holds the adapter and its optimizer (`adapter_state`); an export writes the merged HF directory
and, beside it in `adapter/`, peft's adapter directory (its base named in it), which `vcpo eval --model`
and `model.path` also take (`rollout.models.resolve_model` merges it once into the model cache).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from configs.schema import LoraSettings

ADAPTER = "default"
"""peft's name of the one adapter a run trains."""

ADAPTER_DIR = "adapter"
"""The export's subfolder with peft's adapter (adapter_config.json, adapter_model.safetensors)."""

INSTALL_HINT = "pip install 'vcpo[lora]' (peft==0.21.2)"


def _peft() -> Any:
    try:
        import peft
    except ImportError as error:  # an optional extra: say how to get it
        raise ImportError(f"learner.lora needs peft: {INSTALL_HINT}") from error
    return peft


def attach(model: nn.Module, settings: LoraSettings, seed: int) -> Any:
    """Inject the adapters into `model` in place (its base parameters frozen) and return peft's wrapper;
    `model` itself stays the plain causal LM the learner drives. The adapters' initial values come from
    `seed` alone, so every data-parallel replica starts from the same ones."""
    peft = _peft()
    config = peft.LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=settings.target_modules, bias="none", task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = peft.get_peft_model(model, config, adapter_name=ADAPTER)
    if wrapped.base_model.model is not model:
        raise RuntimeError("peft wrapped a copy of the model instead of the model itself")
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    foreign = [name for name in trained if ".lora_A." not in name and ".lora_B." not in name]
    if foreign or not trained:
        raise ValueError("learner.lora: the adapters must be the only trained parameters, got "
                         f"{foreign[:3] or 'none'}; check learner.lora.target_modules="
                         f"{settings.target_modules}")
    return wrapped


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(module name, peft LoRA layer) of every adapted layer of `model`."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def merged_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """(base model's name, tensor) of every parameter with the adapters merged into their layers'
    weights — what an engine without the adapters loads. Deterministic: the same tensors on every call."""
    merged: dict[str, Tensor] = {}
    with torch.no_grad():  # never across a yield: grad mode is the caller's state between two items
        for name, layer in lora_layers(model):
            base = layer.get_base_layer().weight
            delta = layer.get_delta_weight(ADAPTER)
            merged[f"{name}.base_layer.weight"] = (base.float() + delta.float()).to(base.dtype)
    for name, parameter in model.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        yield name.replace(".base_layer.", "."), merged.get(name, parameter.detach())


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trained vector: every adapter parameter, in the model's order."""
    return [p for p in model.parameters() if p.requires_grad]


def adapter_state(wrapped: Any) -> dict[str, Tensor]:
    """The adapters' weights as peft names them (no base weight)."""
    return {k: v.detach().clone() for k, v in _peft().get_peft_model_state_dict(wrapped, adapter_name=ADAPTER)
            .items()}


def load_adapter_state(wrapped: Any, state: dict[str, Tensor]) -> None:
    """Put a checkpoint's adapter back; every adapter tensor must be there, nothing else."""
    result = _peft().set_peft_model_state_dict(wrapped, state, adapter_name=ADAPTER)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(f"the checkpoint's adapter does not fit this run's learner.lora: unexpected "
                         f"{list(result.unexpected_keys)[:3]}, missing {missing[:3]}; resume with the "
                         "learner.lora settings it was written with")


def save_adapter(wrapped: Any, path: Path, base_model: str) -> None:
    """peft's adapter directory at `path`, naming `base_model` (the directory the run's base weights came
    from) as its base."""
    wrapped.peft_config[ADAPTER].base_model_name_or_path = base_model
    wrapped.save_pretrained(str(path), safe_serialization=True, save_embedding_layers=False)


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[None]:
    """The adapters' dropout as at inference inside (no-grad passes: log π_old, reference, statistics),
    so they compute the policy the engine samples from; restored after."""
    layers = [m for name, m in model.named_modules() if name.endswith("lora_dropout." + ADAPTER)]
    modes = [m.training for m in layers]
    for m in layers:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(layers, modes, strict=True):
            m.train(mode)

