"""`vcpo bench engine`: generated tokens/s of each engine that runs here, against HF `generate`.

For each concurrency c (default 1, 8, 32) every backend serves max(c, min_requests) chat prompts
with c requests in flight at a time, each generating exactly `max_new_tokens` tokens (EOS
ignored, temperature 1, no truncation); throughput = generated tokens / wall time. The baseline is
HF `model.generate` on the same weights and dtype, in batches of c left-padded prompts; only
generated tokens count (no padding). Weight push time is the median of three full-state-dict
`load_weights` calls on an idle engine.

One torch-using thread at a time: each engine is started, measured at every concurrency, timed for
weight pushes and closed (its thread gone) before the next starts, and the baseline loads and runs in a
thread of its own that ends before any engine starts. Why (the likely mechanism, which fits every probe;
libgomp itself was not traced): torch's CPU kernels run on libgomp, which keeps one OpenMP team per
calling thread; once the teams of all threads hold more threads than there are cores, libgomp stops
spinning between parallel regions and every region pays a futex wake-up. A decode step is hundreds of
small regions, so an engine measured while another engine's (idle) thread was alive ran at about half
speed (vLLM c=1: 22–28 vs 42–47 tokens/s; docs/results.md). One engine per process is also how vcpo runs
them (a Ray rollout worker holds one engine).

Numbers on a shared CPU machine are still noisy: compare only within one run, on a quiet machine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rollout.base import InferenceEngine
from rollout.errors import EngineError
from rollout.models import load_tokenizer, resolve_model
from rollout.runtime import join_engine_threads
from rollout.types import GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

BENCH_BACKENDS = ("hf", "vllm")
"""Engines that run in-process (servers need a launcher and a GPU)."""
TARGET_SPEEDUP = 2.5
"""Issue #4: the default engine must be ≥ 2.5x HF generate on the CPU machine."""

_QUESTIONS = (
    "Tell me a story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "What is the capital of France, and why?",
    "Write a short poem about rain.",
    "List five uses of a paperclip.",
    "Describe the water cycle for a child.",
    "How do I make a cup of tea?",
    "Why is the sky blue?",
)


def run_engine_bench(
    model_spec: str,
    cache_dir: Path,
    concurrencies: Sequence[int] = (1, 8, 32),
    max_new_tokens: int = 128,
    backends: Sequence[str] = ("hf", "vllm"),
    min_requests: int = 16,
    dtype: str = "float32",
    vllm_use_eager: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns a JSON-able dict (see the module docstring for the method)."""
    import torch

    unknown = sorted(set(backends) - set(BENCH_BACKENDS))
    if unknown:
        raise ValueError(
            f"backends {unknown} cannot be benchmarked in-process; choose from {list(BENCH_BACKENDS)}"
        )
    say = progress or log.info
    model_dir = Path(resolve_model(model_spec, cache_dir).name_or_path)
    tokenizer = load_tokenizer(str(model_dir), cache_dir)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for q in _QUESTIONS
    ]
    plan = {c: max(c, min_requests) for c in concurrencies}
    result: dict[str, Any] = {
        "model": model_spec,
        "dtype": dtype,
        "vllm_use_eager": vllm_use_eager,
        "max_new_tokens": max_new_tokens,
        "torch_threads": torch.get_num_threads(),
        "requests_per_concurrency": {str(c): n for c, n in plan.items()},
    }

    measured = asyncio.run(_bench_all(model_dir, dtype, backends, prompts, plan, max_new_tokens, say,
                                      vllm_use_eager))
    result.update(measured)
    result["speedup_vs_hf_generate"] = {
        backend: {
            c: round(rate / result["hf_generate"]["tokens_per_s"][c], 2)
            for c, rate in numbers["tokens_per_s"].items()
        }
        for backend, numbers in result["backends"].items()
    }
    result["decode_bound"] = _decode_bound(model_dir, dtype, result)
    default = "vllm" if "vllm" in result["backends"] else "hf"
    result["target"] = {
        "backend": default,
        "speedup": TARGET_SPEEDUP,
        "is_met": {
            c: ratio >= TARGET_SPEEDUP
            for c, ratio in result["speedup_vs_hf_generate"].get(default, {}).items()
        },
    }
    return result


def memory_read_gbps(size_mib: int = 1024, repeats: int = 5) -> float:
    """Best-of-`repeats` memory read bandwidth of this process's torch threads, GB/s: a sum over a
    `size_mib` float32 tensor (far larger than any cache), so every byte comes from DRAM."""
    import torch

    data = torch.ones(size_mib * 2**20 // 4)
    float(data.sum())  # touch every page first
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        float(data.sum())
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9


def _decode_bound(model_dir: Path, dtype: str, result: dict[str, Any]) -> dict[str, Any]:
    """The memory-bandwidth roofline of one decode stream: every generated token reads every weight
    once, so one sequence cannot exceed bandwidth / weight bytes tokens/s, whatever the engine. Reports
    each engine's c=1 rate as a fraction of that bound (batching shares one weight read across the
    batch, which is where an engine can pull ahead of HF generate)."""
    from safetensors import safe_open

    element = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    sizes: dict[str, int] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                sizes[name] = math.prod(handle.get_slice(name).get_shape())
    if "lm_head.weight" in sizes:  # untied: a token reads one input-embedding row, not the table
        sizes = {name: n for name, n in sizes.items() if not name.endswith("embed_tokens.weight")}
    parameters = sum(sizes.values())
    if parameters == 0:
        return {"error": f"no *.safetensors weights in {model_dir}"}
    gbps = memory_read_gbps()
    bound = gbps * 1e9 / (parameters * element)
    rates = {"hf_generate": result["hf_generate"]["tokens_per_s"].get("1")}
    rates.update({name: numbers["tokens_per_s"].get("1") for name, numbers in result["backends"].items()})
    return {
        "memory_read_gbps": round(gbps, 1), "weight_bytes": parameters * element,
        "tokens_per_s_c1": round(bound, 1),
        "fraction_of_bound_c1": {name: round(rate / bound, 2) for name, rate in rates.items() if rate},
    }



def _build(backend: str, model_dir: Path, dtype: str, max_concurrency: int, vllm_use_eager: bool = False
           ) -> InferenceEngine:
    if backend == "hf":
        from rollout.hf_engine import HFEngine
        from rollout.settings import HFEngineSettings

        return HFEngine(model_dir, HFEngineSettings(dtype=dtype, max_batch_size=max(32, max_concurrency)))
    if backend == "vllm":
        from rollout.settings import VLLMEngineSettings
        from rollout.vllm_engine import VLLMEngine

        return VLLMEngine(
            model_dir,
            VLLMEngineSettings(dtype=dtype, max_model_len=1024, max_num_seqs=max(32, max_concurrency),
                               use_eager=vllm_use_eager),
        )
    raise AssertionError(backend)  # run_engine_bench validated the names


async def _bench_all(
    model_dir: Path,
    dtype: str,
    backends: Sequence[str],
    prompts: list[list[int]],
    plan: dict[int, int],
    max_new_tokens: int,
    say: Callable[[str], None],
    vllm_use_eager: bool = False,
) -> dict[str, Any]:
    """Each engine alone (started, measured at every concurrency, weight pushes timed, closed), then HF
    generate in a thread of its own (see the module docstring for why one torch thread at a time)."""
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(1, thread_name_prefix="vcpo-bench-baseline") as pool:  # the thread ends here
        baseline = await loop.run_in_executor(pool, _HFGenerateBaseline, model_dir, dtype, prompts)
    numbers: dict[str, dict[str, Any]] = {}
    unavailable: dict[str, str] = {}
    for backend in backends:
        say(f"starting {backend}")
        started = time.perf_counter()
        try:
            async with _build(backend, model_dir, dtype, max(plan), vllm_use_eager) as engine:
                await _serve(engine, prompts, 2, 2, 8, "warmup")
                numbers[backend] = {"start_s": round(time.perf_counter() - started, 1), "tokens_per_s": {}}
                for c, n in plan.items():
                    say(f"concurrency {c}: {backend}")
                    rate = await _serve(engine, prompts, n, c, max_new_tokens, f"c{c}")
                    numbers[backend]["tokens_per_s"][str(c)] = round(rate, 1)
                numbers[backend]["weight_push_s"] = await _push_time(engine, baseline.state_dict())
        except (EngineError, ImportError) as exc:
            numbers.pop(backend, None)
            unavailable[backend] = str(exc)
            say(f"{backend} unavailable: {exc}")
        join_engine_threads()
    baseline_rates = {}
    with ThreadPoolExecutor(1, thread_name_prefix="vcpo-bench-baseline") as pool:
        for c, n in plan.items():
            say(f"concurrency {c}: HF generate")
            baseline_rates[str(c)] = await loop.run_in_executor(pool, baseline.tokens_per_s, n, c,
                                                                max_new_tokens)
    return {"hf_generate": {"tokens_per_s": baseline_rates}, "backends": numbers, "unavailable": unavailable}


async def _push_time(engine: InferenceEngine, state_dict: dict[str, Any]) -> float:
    """Median of three full-state-dict loads on an idle engine, in seconds."""
    pushes = []
    for _ in range(3):
        started = time.perf_counter()
        await engine.load_weights(state_dict.items(), engine.version + 1)
        pushes.append(time.perf_counter() - started)
    return round(statistics.median(pushes), 3)


async def _serve(
    engine: InferenceEngine,
    prompts: list[list[int]],
    num_requests: int,
    concurrency: int,
    max_new_tokens: int,
    tag: str,
) -> float:
    """Generated tokens/s with `concurrency` requests in flight."""
    slots = asyncio.Semaphore(concurrency)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, use_eos=False)

    async def one(i: int) -> int:
        async with slots:
            request = GenerationRequest(
                request_id=f"{tag}-{i}",
                prompt_token_ids=prompts[i % len(prompts)],
                sampling=sampling.model_copy(update={"seed": i}),
            )
            return len((await engine.generate(request)).token_ids)

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(num_requests))))
    return tokens / (time.perf_counter() - started)


class _HFGenerateBaseline:
    """HF `generate` in batches of c left-padded prompts; counts generated tokens only."""

    def __init__(self, model_dir: Path, dtype: str, prompts: list[list[int]]) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self._pad = self._model.generation_config.pad_token_id or 0
        self._prompts = prompts

    def state_dict(self) -> dict[str, Any]:
        return self._model.state_dict()

    def tokens_per_s(self, num_requests: int, batch: int, max_new_tokens: int) -> float:
        ordered = [self._prompts[i % len(self._prompts)] for i in range(num_requests)]
        self._generate(ordered[:2], 8)  # warm-up
        started = time.perf_counter()
        tokens = sum(
            self._generate(ordered[i : i + batch], max_new_tokens) for i in range(0, num_requests, batch)
        )
        return round(tokens / (time.perf_counter() - started), 1)

    def _generate(self, prompts: list[list[int]], max_new_tokens: int) -> int:
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self._pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = self._model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=self._pad,
            )
        return (out.shape[1] - width) * len(prompts)
