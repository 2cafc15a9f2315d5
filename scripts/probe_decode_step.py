"""Where a single-request vLLM decode step goes, and how fast the linear kernels stream weights.

    .venv/bin/python scripts/probe_decode_step.py          # both parts, each in a process of its own (~1 min)
    .venv/bin/python scripts/probe_decode_step.py gemv     # the kernels only
    .venv/bin/python scripts/probe_decode_step.py step     # the engine only (vLLM compiled, graphs cached)

Part 1 (gemv): every linear layer of the default model (SmolLM2-135M, fp32: 30 layers of qkv, o, gate_up,
down, and the tied lm_head — 538 MB) as matrix-vector products on this process's torch threads, once
with vLLM-CPU's pre-packed oneDNN kernel (`onednn_mm`, what vLLM decodes with) and once with
`torch.nn.functional.linear` (what HF `generate` runs), as GB/s next to the memory-read probe of
`vcpo bench engine`. Part 2 (step): the default engine at one request, 6 x 128 tokens, with vLLM's
step phases timed per generated token. docs/results.md has the numbers.
"""

from __future__ import annotations

import asyncio
import collections
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.bench.worker import memory_read_gbps

_LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down (N, K)
_LAYERS, _LM_HEAD = 30, (49152, 576)
_QUESTION = "Tell me a story about a lighthouse keeper."


def gemv() -> None:
    import torch
    import vllm._custom_ops as ops

    weights = [torch.randn(n, k) for _ in range(_LAYERS) for n, k in _LAYER_SHAPES] + [torch.randn(*_LM_HEAD)]
    inputs = {k: torch.randn(1, k) for k in (576, 1536)}
    total = sum(w.numel() * 4 for w in weights)

    def best_of(calls: list[Callable[[], Any]], repeats: int = 20) -> float:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            for call in calls:
                call()
            best = min(best, time.perf_counter() - started)
        return best

    handles = [ops.create_onednn_mm(w.t(), 32) for w in weights]
    onednn = best_of([lambda h=h, w=w: ops.onednn_mm(h, inputs[w.shape[1]], None)
                      for h, w in zip(handles, weights, strict=True)])
    plain = best_of([lambda w=w: torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights])
    print(f"weights {total / 1e6:.0f} MB; memory-read probe {memory_read_gbps():.1f} GB/s")
    for name, seconds in (("vLLM onednn_mm", onednn), ("torch linear", plain)):
        print(f"{name:15s} {seconds * 1e3:6.2f} ms per token  {total / seconds / 1e9:5.1f} GB/s")


async def step() -> None:
    from rollout.bench.engine import bench_prompts
    from rollout.engines import vllm_engine
    from rollout.models import vcpo_cache_root
    from rollout.settings import VLLMEngineSettings
    from rollout.types import GenerationRequest, SamplingParams

    seconds: dict[str, float] = collections.defaultdict(float)

    def timed(owner: Any, method: str, label: str) -> None:
        inner = getattr(owner, method)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - started

        setattr(owner, method, wrapper)

    model, (prompt,) = bench_prompts("default", vcpo_cache_root() / "models", [_QUESTION])
    sampling = SamplingParams(max_new_tokens=128, temperature=1.0, use_eos=False)
    engine = vllm_engine.VLLMEngine(model, VLLMEngineSettings())
    await engine.start()
    try:
        core = engine._engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        timed(engine._engine, "step", "LLMEngine.step (all of a step)")
        timed(core.scheduler, "schedule", "  scheduler")
        timed(runner, "execute_model", "  execute_model")
        timed(runner, "_prepare_inputs", "    prepare inputs")
        timed(runner, "_model_forward", "    model forward (30 layers, no lm_head)")
        timed(runner, "sample_tokens", "  sample_tokens")
        timed(runner.sampler, "forward", "    sampler")
        request = GenerationRequest(request_id="warm", prompt_token_ids=tuple(prompt), sampling=sampling)
        await engine.generate(request)
        seconds.clear()
        started, tokens = time.perf_counter(), 0
        for i in range(6):
            request = GenerationRequest(request_id=f"r{i}", prompt_token_ids=tuple(prompt), sampling=sampling)
            tokens += len((await engine.generate(request)).token_ids)
        wall = time.perf_counter() - started
    finally:
        await engine.close()
    print(f"c=1: {tokens / wall:.1f} tokens/s, {wall / tokens * 1e3:.2f} ms per token (wall)")
    for label, spent in seconds.items():
        print(f"{label:45s} {spent / tokens * 1e3:6.2f} ms per token")


if __name__ == "__main__":
    part = sys.argv[1] if len(sys.argv) > 1 else "all"
    if part == "gemv":
        gemv()
    elif part == "step":
        asyncio.run(step())
    else:  # each part in a process of its own: torch kernels run on this thread would halve the engine's
        for each in ("gemv", "step"):  # speed (one OpenMP team per thread, docs/results.md)
            subprocess.run([sys.executable, __file__, each], check=True)
