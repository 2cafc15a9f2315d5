"""A/B probe: does building vLLM on one torch thread (vLLM 0.32's own behaviour, count restored after
start-up) decode slower than building it on the engine's thread count (`_serving_threads`)?

    .venv/bin/python scripts/probe_vllm_threads.py old   # built on one thread, count restored
    .venv/bin/python scripts/probe_vllm_threads.py new   # built on the process's thread count
    # alternate them a few times: single runs on a shared host vary by ±10%

Prints decode tokens/s of the default model (compiled) at one request (6 × 128 tokens) and with 16
concurrent requests. docs/results.md has the measured pairs (no difference on 2 cores).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.bench.engine import bench_prompts
from rollout.engines import vllm_engine
from rollout.models import vcpo_cache_root
from rollout.settings import VLLMEngineSettings
from rollout.types import GenerationRequest, SamplingParams

_QUESTION = "Tell me a story about a lighthouse keeper."


async def _measure() -> tuple[float, float]:
    model, (prompt,) = bench_prompts("default", vcpo_cache_root() / "models", [_QUESTION])
    sampling = SamplingParams(max_new_tokens=128, temperature=1.0, use_eos=False)
    engine = vllm_engine.VLLMEngine(model, VLLMEngineSettings())

    def request(name: str) -> GenerationRequest:
        return GenerationRequest(request_id=name, prompt_token_ids=tuple(prompt), sampling=sampling)

    await engine.start()
    try:
        await engine.generate(request("warm"))
        start, tokens = time.perf_counter(), 0
        for i in range(6):
            tokens += len((await engine.generate(request(f"one-{i}"))).token_ids)
        single = tokens / (time.perf_counter() - start)
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(request(f"many-{i}")) for i in range(16)))
        many = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
    finally:
        await engine.close()
    return single, many


def main(mode: str) -> None:
    if mode not in ("old", "new"):
        raise SystemExit("usage: probe_vllm_threads.py old|new")
    if mode == "old":  # let vLLM build on one thread; only restore the count after (the GPU path)
        serving_threads = vllm_engine._serving_threads
        vllm_engine._serving_threads = lambda threads, _keep=True: serving_threads(threads, False)
    single, many = asyncio.run(_measure())
    print(f"{mode}: c=1 {single:.1f} tokens/s, 16 concurrent {many:.1f} tokens/s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
