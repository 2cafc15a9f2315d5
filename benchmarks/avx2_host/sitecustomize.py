"""Emulates an AVX2-only x86-64 host on an AVX-512 one, for timing (scripts/emulate_avx2.sh puts this folder
on PYTHONPATH). With EMULATE_AVX2=1, torch's CPU capability probes report no AVX-512, AMX or VNNI, so vLLM
loads its AVX2 kernels and vcpo's `auto` picks fp32; ATen, inductor, oneDNN and MKL are limited by the
script's environment variables. The probes are patched when torch is first imported, so processes that
never import torch (the sandbox's) pay nothing."""

import importlib.abc
import importlib.util
import os
import sys

_OFF = ("avx512", "amx", "avx_vnni", "avx10")


def _patch(torch_module):
    cpu = sys.modules.get("torch.cpu") or __import__("torch.cpu").cpu
    for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported",
                 "_is_amx_fp16_supported", "_is_vnni_supported"):
        if hasattr(cpu, name):
            setattr(cpu, name, lambda: False)
    original = cpu.get_capabilities

    def get_capabilities():
        caps = dict(original())
        for key in caps:
            if key.startswith(_OFF):
                caps[key] = False
        return caps

    cpu.get_capabilities = get_capabilities


class _TorchHook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        original_exec = spec.loader.exec_module

        def exec_module(module):
            original_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("EMULATE_AVX2") == "1":
    sys.meta_path.insert(0, _TorchHook())
