"""Which machine a benchmark figure was measured on: floating-point results differ in the last bits
between CPU kernels (AVX2, AVX-512, AMX) and library versions, and speed differs far more."""

from __future__ import annotations

import contextlib
import platform
from pathlib import Path
from typing import Any


def host_description() -> dict[str, Any]:
    """CPU model, torch's thread count, bf16 support in hardware, torch and transformers versions, the
    memory allocator (tcmalloc or glibc: ~1.4x on a CPU learner step, learner/launch/allocator.py)."""
    import torch
    import transformers

    from learner.forward.logprobs import native_bf16
    from learner.launch.allocator import active_allocator

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"cpu": cpu, "threads": torch.get_num_threads(),
            "native_bf16_cpu": native_bf16(torch.device("cpu")),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "allocator": active_allocator()}
