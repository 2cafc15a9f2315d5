"""Test-only: run megatron-core on a CPU-only torch build (gloo, no CUDA). Never imported by product code.

megatron-core assumes CUDA in many places: `torch.cuda.current_device()` as a device (an int),
`device="cuda"`, CUDA streams/events/RNG, and the distributed optimizer's check that parameters are
`torch.cuda.FloatTensor`. `cuda_on_cpu()` maps all of that to the CPU for the duration of a `with`
block and restores everything afterwards:

1. the `torch.cuda` entry points megatron calls are replaced by CPU stand-ins (device 0, no-op
   synchronize/seed, dummy streams/events, the CPU RNG state, zero memory statistics);
2. megatron's own CUDA RNG helpers (`tensor_parallel/random.py`) read/write the CPU RNG;
3. a `TorchFunctionMode` rewrites any CUDA device argument (`"cuda"`, `"cuda:0"`, an int) to the
   CPU, makes `Tensor.cuda()`/`pin_memory()` no-ops and reports `tensor.type()` as `torch.cuda.*`.

Cost: every torch call inside the block goes through a Python `__torch_function__`; fine for the
tiny models of the tests. What it does not do: make CUDA-only kernels (TransformerEngine, Apex,
sequence parallelism's fused paths) run — those stay GPU tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _cpu_device(device: Any) -> Any:
    """`device` with every CUDA spelling (str, torch.device, bare int ordinal) replaced by the CPU."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if name in ("cuda", "pin_memory") and args and isinstance(args[0], torch.Tensor):
            return args[0]
        if name == "type" and len(args) == 1 and not kwargs:
            # DistributedOptimizer accepts only 'torch.cuda.{Float,Half,BFloat16}Tensor' parameters
            result = func(*args)
            if isinstance(result, str) and result.startswith("torch.") and "cuda" not in result:
                return "torch.cuda." + result[len("torch."):]
            return result
        if name == "to" and len(args) > 1:
            args = (args[0], *(_cpu_device(a) if isinstance(a, str | torch.device | int) else a
                               for a in args[1:]))
        return func(*args, **kwargs)


class _DummyStream:
    device = _CPU

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _DummyEvent:
        return _DummyEvent()

    def query(self) -> bool:
        return True

    def __enter__(self) -> _DummyStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class _DummyEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: _DummyEvent) -> float:
        return 0.0


def _returning(value: Any) -> Callable[..., Any]:
    """A new function returning `value` (one object per name: dynamo's rule table rejects a function
    registered under two torch names)."""
    return lambda *args, **kwargs: value


def _cuda_replacements() -> dict[str, Any]:
    replacements: dict[str, Any] = {
        "Stream": _DummyStream, "Event": _DummyEvent,
        "current_stream": lambda *a, **k: _DummyStream(), "default_stream": lambda *a, **k: _DummyStream(),
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
        "current_device": _returning(0), "device_count": _returning(1),
        "get_device_capability": _returning((0, 0)), "get_device_name": _returning("cpu"),
    }
    for name in ("set_device", "synchronize", "empty_cache", "manual_seed", "manual_seed_all",
                 "reset_peak_memory_stats"):
        replacements[name] = _returning(None)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        replacements[name] = _returning(0)
    return replacements


@contextlib.contextmanager
def _patched(target: Any, replacements: dict[str, Any]) -> Iterator[None]:
    missing = object()
    saved = {name: getattr(target, name, missing) for name in replacements}
    try:
        for name, value in replacements.items():
            setattr(target, name, value)
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(target, name)
            else:
                setattr(target, name, value)


@contextlib.contextmanager
def cuda_on_cpu() -> Iterator[None]:
    """Inside: megatron-core runs on the CPU (see the module docstring). Restores everything on exit.

    Imports megatron-core and mbridge first, unpatched: their import-time `torch.compile` decorators
    build dynamo's table of torch functions, which must hold the real `torch.cuda` ones.
    """
    import mbridge  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import torch.cuda.random as cuda_random
    from megatron.core.tensor_parallel import random as megatron_random

    replacements = _cuda_replacements()
    rng = {"get_rng_state": replacements["get_rng_state"], "set_rng_state": replacements["set_rng_state"]}
    megatron_rng = {
        "_get_cuda_rng_state": lambda *a, **k: torch.get_rng_state(),
        "_set_cuda_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
    }
    with (_patched(torch.cuda, replacements), _patched(cuda_random, rng),
          _patched(megatron_random, megatron_rng), _CudaToCpuMode()):
        yield
