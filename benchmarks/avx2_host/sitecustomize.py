"""Emulates an AVX2-only x86-64 host on an AVX-512 one, for timing (scripts/emulate_avx2.sh puts this folder
on PYTHONPATH). With EMULATE_AVX2=1, torch's CPU capability probes report no AVX-512, AMX or VNNI, so vLLM
loads its AVX2 kernels and vcpo's `auto` picks fp32; ATen, inductor, oneDNN and MKL are limited by the
script's environment variables. The probes are patched when torch is first imported, so processes that
never import torch (the sandbox's) pay nothing."""

import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

_OFF = ("avx512", "amx", "avx_vnni", "avx10")


def _patch(torch_module: ModuleType) -> None:
    """torch.cpu's probes answer as on a CPU without the instruction sets in `_OFF`."""
    cpu = torch_module.cpu
    for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported",
                 "_is_amx_fp16_supported", "_is_vnni_supported"):
        if hasattr(cpu, name):
            setattr(cpu, name, lambda: False)
    original = cpu.get_capabilities

    def get_capabilities() -> dict[str, Any]:
        return {key: False if key.startswith(_OFF) else value for key, value in original().items()}

    cpu.get_capabilities = get_capabilities


class _TorchHook(importlib.abc.MetaPathFinder):
    """Patches torch right after its first import, then leaves the import system alone."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        original_exec = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("EMULATE_AVX2") == "1":
    sys.meta_path.insert(0, _TorchHook())
