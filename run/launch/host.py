"""Which machine a run or a benchmark figure was measured on: floating-point results differ in the last
bits between CPU kernels (AVX2, AVX-512, AMX) and library versions, and speed differs far more (a bf16
GEMM on a CPU without AMX runs ~1/10 as fast as with it)."""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path
from typing import Any

SPEED_FEATURES = ("amx_tile", "avx512_bf16", "avx512f", "avx2")
"""The CPU flags that decide which kernels a CPU run gets, and so its speed."""


def host_description() -> dict[str, Any]:
    """CPU model and the speed-deciding flags it has, torch's thread count, bf16 support in hardware, torch
    and transformers versions, the memory allocator (tcmalloc or glibc: ~1.4x on a CPU learner step,
    run/launch/allocator.py)."""
    import torch
    import transformers

    from learner.forward.logprobs import native_bf16
    from run.launch.allocator import active_allocator

    model: str | None = None
    flags: set[str] | None = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # the first CPU's lines are enough
            if line.startswith("model name") and model is None:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and flags is None:
                flags = set(line.split(":", 1)[1].split())
    cpu = model or platform.processor() or platform.machine()
    flags = flags or set()
    return {"cpu": cpu, "cpu_features": [name for name in SPEED_FEATURES if name in flags],
            "threads": torch.get_num_threads(),
            "native_bf16_cpu": native_bf16(torch.device("cpu")),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "allocator": active_allocator()}
