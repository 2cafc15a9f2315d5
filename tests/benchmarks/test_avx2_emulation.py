"""scripts/emulate_avx2.sh: under it torch reports an AVX2-only CPU, so vcpo's `auto` picks fp32 and vLLM
would load its AVX2 kernels; ATen's kernels are AVX2's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import torch; from learner.forward.logprobs import native_bf16; "
         "caps = torch.cpu.get_capabilities(); "
         "print(torch.cpu._is_avx512_supported(), torch.cpu._is_amx_tile_supported(), caps['avx2'], "
         "any(v for k, v in caps.items() if k.startswith('avx512')), native_bf16(torch.device('cpu')), "
         "torch.backends.cpu.get_cpu_capability())")


@pytest.mark.skipif(not torch.cpu._is_avx2_supported(), reason="needs an x86-64 CPU with AVX2")
def test_the_emulation_hides_avx512_amx_and_bf16_from_torch_and_vcpo() -> None:
    shown = subprocess.run(["bash", str(ROOT / "scripts" / "emulate_avx2.sh"), sys.executable, "-c", PROBE],
                           capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
    assert shown == ["False", "False", "True", "False", "False", "AVX2"]
    plain = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True,
                           cwd=ROOT).stdout.split()
    if torch.cpu._is_avx512_supported():  # here the emulation is what hid it
        assert plain[0] == "True" and plain[3] == "True"
