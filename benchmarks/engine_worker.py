"""One process of `vcpo bench engine`: it holds one backend (an engine, or HF `generate` as the baseline)
and runs the measurements the parent (benchmarks/engine.py) asks for, one at a time.

Why a process per backend: torch's CPU kernels run on libgomp, which keeps one OpenMP team per calling
thread; once the teams in a process hold more threads than there are cores, libgomp stops spinning
between parallel regions and every region pays a futex wake-up. A decode step is hundreds of small
regions, so an engine measured while another engine's idle thread was alive in the same process ran at
about half speed (docs/performance.md). Idle workers in other processes sleep and cost nothing, so every
backend can stay up for the whole run and the parent can interleave their measurements in time.

Protocol (JSON lines). The parent writes the setup as the first line of stdin:
{"backend": "hf_generate" | "hf" | "vllm", "model_dir", "dtype", "prompts", "max_concurrency",
"vllm_use_eager"}. The worker answers {"ready": true, "start_s", "torch_threads"} or {"error",
"unavailable": true}, then one line per command:
  {"op": "serve", "concurrency", "num_requests", "max_new_tokens", "tag"}
                       -> {"tokens_per_s", "pid", "threads"}
  {"op": "push"}       -> {"weight_push_s"}   (engines: median of three full-checkpoint loads)
  {"op": "bandwidth"}  -> {"gbps"}            (baseline only: it is that process's torch thread anyway)
  {"op": "close"}      -> {"closed": true}, then exit (end of stdin closes too)
An engine failure answers {"error": "<type>: <message>"}. The worker's stdout is the protocol channel:
anything else written to it goes to stderr.

    python -m benchmarks.engine_worker    # started by benchmarks.engine, not by hand
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

from rollout.base import InferenceEngine
from rollout.errors import EngineError
from rollout.types import GenerationRequest, SamplingParams

Reply = Callable[[dict[str, Any]], None]


def main() -> None:
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # C libraries and print() now write to stderr; the protocol keeps the old stdout
    sys.stdout = sys.stderr
    setup = json.loads(sys.stdin.readline())

    def reply(message: dict[str, Any]) -> None:
        channel.write(json.dumps(message) + "\n")

    serve = _serve_baseline if setup["backend"] == "hf_generate" else _serve_engine
    asyncio.run(serve(setup, reply, sys.stdin))


def build_engine(backend: str, model_dir: Path, dtype: str, max_concurrency: int, vllm_use_eager: bool = False
                 ) -> InferenceEngine:
    """The unstarted engine the bench measures (rollout.engines.factory's, with room for
    `max_concurrency`)."""
    from rollout.engines.factory import build_engine as build
    from rollout.settings import HFEngineSettings, VLLMEngineSettings

    batch = max(32, max_concurrency)
    if backend == "hf":
        return build(HFEngineSettings(dtype=dtype, max_batch_size=batch), model_dir)
    if backend == "vllm":
        return build(VLLMEngineSettings(dtype=dtype, max_model_len=1024, max_num_seqs=batch,
                                        use_eager=vllm_use_eager), model_dir)
    raise ValueError(f"no engine backend {backend!r}")


Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


async def _answer_commands(reply: Reply, commands: TextIO, handlers: dict[str, Handler]) -> None:
    """Answer the parent's commands in order until "close" or the end of stdin (read on a plain thread,
    which never runs torch); an engine failure is answered, not raised."""
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, commands.readline):
        command = json.loads(line)
        if command["op"] == "close":
            break
        handler = handlers.get(command["op"])
        try:
            if handler is None:
                raise ValueError(f"this worker does not do {command['op']!r}; it does {sorted(handlers)}")
            reply(await handler(command))
        except (EngineError, ValueError) as exc:
            reply({"error": f"{type(exc).__name__}: {exc}"})


async def _serve_engine(setup: dict[str, Any], reply: Reply, commands: TextIO) -> None:
    started = time.perf_counter()
    prompts: list[list[int]] = setup["prompts"]
    model_dir = Path(setup["model_dir"])
    try:
        engine = build_engine(setup["backend"], model_dir, setup["dtype"], setup["max_concurrency"],
                              setup.get("vllm_use_eager", False))
        await engine.start()
    except (EngineError, ImportError) as exc:
        reply({"error": f"{type(exc).__name__}: {exc}", "unavailable": True})
        return

    async def serve(command: dict[str, Any]) -> dict[str, Any]:
        rate = await serve_requests(engine, prompts, command["num_requests"], command["concurrency"],
                                    command["max_new_tokens"], command["tag"])
        return {"tokens_per_s": rate, **_whoami()}

    async def push(command: dict[str, Any]) -> dict[str, Any]:
        return {"weight_push_s": await push_time(engine, _checkpoint(model_dir))}

    try:
        await serve_requests(engine, prompts, 2, 2, 8, "warmup")
        reply(_ready(started))
        await _answer_commands(reply, commands, {"serve": serve, "push": push})
    finally:
        await engine.close()
    reply({"closed": True})


async def _serve_baseline(setup: dict[str, Any], reply: Reply, commands: TextIO) -> None:
    """HF generate runs on this (the main) thread, blocking the loop while it measures: nothing else runs."""
    started = time.perf_counter()
    baseline = HFGenerateBaseline(Path(setup["model_dir"]), setup["dtype"], setup["prompts"])
    baseline.generate(baseline.prompts[:2], 8)  # warm-up

    async def serve(command: dict[str, Any]) -> dict[str, Any]:
        rate = baseline.tokens_per_s(command["num_requests"], command["concurrency"],
                                     command["max_new_tokens"])
        return {"tokens_per_s": rate, **_whoami()}

    async def bandwidth(command: dict[str, Any]) -> dict[str, Any]:
        return {"gbps": memory_read_gbps()}

    reply(_ready(started))
    await _answer_commands(reply, commands, {"serve": serve, "bandwidth": bandwidth})
    reply({"closed": True})


def _ready(started: float) -> dict[str, Any]:
    import torch

    return {"ready": True, "start_s": round(time.perf_counter() - started, 1),
            "torch_threads": torch.get_num_threads()}


def _whoami() -> dict[str, Any]:
    """This process and its threads that can run torch kernels (engine step threads), for the bench's
    own test: a measurement must run with no other such thread beside it."""
    names = sorted(t.name.rsplit("_", 1)[0] for t in threading.enumerate() if t.name.startswith("vcpo-"))
    return {"pid": os.getpid(), "threads": names}


async def serve_requests(
    engine: InferenceEngine,
    prompts: list[list[int]],
    num_requests: int,
    concurrency: int,
    max_new_tokens: int,
    tag: str,
) -> float:
    """Generated tokens/s with `concurrency` requests in flight (EOS ignored, temperature 1)."""
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


async def push_time(engine: InferenceEngine, named_tensors: dict[str, Any]) -> float:
    """Median of three full-checkpoint loads on an idle engine, in seconds."""
    pushes = []
    for _ in range(3):
        started = time.perf_counter()
        await engine.load_weights(named_tensors.items(), engine.version + 1)
        pushes.append(time.perf_counter() - started)
    return round(statistics.median(pushes), 3)


def _checkpoint(model_dir: Path) -> dict[str, Any]:
    """The checkpoint's tensors by name (what a learner pushes), read after the measurements."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


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


class HFGenerateBaseline:
    """HF `generate` in batches of c left-padded prompts; counts generated tokens only."""

    def __init__(self, model_dir: Path, dtype: str, prompts: list[list[int]]) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        self._pad = self._model.generation_config.pad_token_id or 0
        self.prompts = prompts

    def tokens_per_s(self, num_requests: int, batch: int, max_new_tokens: int) -> float:
        ordered = [self.prompts[i % len(self.prompts)] for i in range(num_requests)]
        started = time.perf_counter()
        tokens = sum(
            self.generate(ordered[i : i + batch], max_new_tokens) for i in range(0, num_requests, batch)
        )
        return tokens / (time.perf_counter() - started)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> int:
        """Sample `max_new_tokens` for each prompt in one left-padded batch; returns the tokens generated."""
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


if __name__ == "__main__":
    main()
