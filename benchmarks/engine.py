"""`vcpo bench engine`: generated tokens/s of each engine that runs here, against HF `generate`.

For each concurrency c (default 1, 8, 32) a backend serves max(c, min_requests) chat prompts with c
requests in flight at a time, each generating exactly `max_new_tokens` tokens (EOS ignored, temperature
1, no truncation); throughput = generated tokens / wall time. The baseline is HF `model.generate` on the
same weights and dtype, in batches of c left-padded prompts; only generated tokens count (no padding).
Weight push time is the median of three full-checkpoint `load_weights` calls on an idle engine.

Paired rounds. Every backend, and the baseline, lives in a process of its own (benchmarks/engine_worker.py
says why one torch thread per process) and stays up for the whole run. A round measures every
concurrency; within it the backends take turns at each concurrency, in an order rotated from round to
round, and only one measures at a time. Each speedup is the ratio of an engine's rate to the baseline's
at the same concurrency in the same round (measured back to back), and the report gives the median over
rounds with every round's ratio. Why: this host's memory bandwidth swings by 2x within seconds (the
bench's own probe read 26-56 GB/s in one minute), and a decode stream at c = 1 is bandwidth-bound for
vLLM but overhead-bound for HF `generate`; two rates measured minutes apart compared the host's moods as
much as the engines. The probe runs in the baseline's process at the start of every round.
"""

from __future__ import annotations

import json
import logging
import math
import os
import selectors
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rollout.errors import EngineError, EngineTimeout, EngineUnavailable, MalformedResponse
from rollout.models import load_tokenizer, resolve_model
from run.launch.host import host_description

log = logging.getLogger(__name__)

BENCH_BACKENDS = ("hf", "vllm")
"""Engines that run in-process (servers need a launcher and a GPU)."""
TARGET_SPEEDUP = 2.5
"""Target: the default engine must be ≥ 2.5x HF generate on the CPU machine."""
BASELINE = "hf_generate"
START_TIMEOUT_S = 1200.0
"""A worker's start-up, first vLLM compile included (~70 s here)."""
COMMAND_TIMEOUT_S = 1800.0
"""One measurement or weight-push command."""

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
    min_requests: int = 8,
    rounds: int = 3,
    dtype: str = "float32",
    vllm_use_eager: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns a JSON-able dict (see the module docstring for the method)."""
    unknown = sorted(set(backends) - set(BENCH_BACKENDS))
    if unknown:
        raise ValueError(
            f"backends {unknown} cannot be benchmarked in-process; choose from {list(BENCH_BACKENDS)}"
        )
    if rounds < 1 or min_requests < 1:
        raise ValueError(f"rounds ({rounds}) and min_requests ({min_requests}) must be at least 1")
    say = progress or log.info
    model_dir, prompts = bench_prompts(model_spec, cache_dir)
    plan = {c: max(c, min_requests) for c in concurrencies}
    setup = {"model_dir": str(model_dir), "dtype": dtype, "prompts": prompts, "max_concurrency": max(plan),
             "vllm_use_eager": vllm_use_eager}
    result: dict[str, Any] = {
        "model": model_spec,
        "dtype": dtype,
        "vllm_use_eager": vllm_use_eager,
        "max_new_tokens": max_new_tokens,
        "rounds": rounds,
        "requests_per_concurrency": {str(c): n for c, n in plan.items()},
    }
    result.update(_bench_all(setup, (BASELINE, *backends), plan, max_new_tokens, rounds, say))
    result["speedup_vs_hf_generate"], result["speedup_per_round"] = _speedups(result)
    result["decode_bound"] = _decode_bound(model_dir, dtype, result)
    default = "vllm" if "vllm" in result["backends"] else "hf"
    medians = result["speedup_vs_hf_generate"].get(default, {})
    result["target"] = {
        "backend": default,
        "speedup": TARGET_SPEEDUP,
        "is_met": {c: ratio >= TARGET_SPEEDUP for c, ratio in medians.items()},
        "is_met_in_every_round": {
            c: min(ratios) >= TARGET_SPEEDUP
            for c, ratios in result["speedup_per_round"].get(default, {}).items()
        },
    }
    result["host"] = host_description()
    return result


def bench_prompts(model_spec: str, cache_dir: Path, questions: Sequence[str] = _QUESTIONS
                  ) -> tuple[Path, list[list[int]]]:
    """The model's directory and `questions` as its chat prompts (token ids), as the bench sends them."""
    model_dir = Path(resolve_model(model_spec, cache_dir).name_or_path)
    tokenizer = load_tokenizer(str(model_dir), cache_dir)
    return model_dir, [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True)["input_ids"])
        for q in questions
    ]


def _bench_all(
    setup: dict[str, Any],
    names: Sequence[str],
    plan: dict[int, int],
    max_new_tokens: int,
    rounds: int,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Start every worker (one at a time), run the paired rounds, time the engines' weight pushes, close."""
    workers: dict[str, BenchWorker] = {}
    unavailable: dict[str, str] = {}
    ready: dict[str, dict[str, Any]] = {}
    gbps: list[float] = []
    pushes: dict[str, float] = {}
    try:
        for name in names:
            say(f"starting {name}")
            try:
                workers[name], ready[name] = BenchWorker.start({**setup, "backend": name})
            except EngineError as exc:
                if name == BASELINE:
                    raise
                unavailable[name] = str(exc)
                say(f"{name} unavailable: {exc}")
        rates: dict[str, dict[str, list[float]]] = {name: {str(c): [] for c in plan} for name in workers}
        for round_ in range(rounds):
            gbps.append(round(workers[BASELINE].ask({"op": "bandwidth"})["gbps"], 1))
            for c, n in plan.items():
                live = [name for name in names if name in workers]
                for name in live[round_ % len(live):] + live[: round_ % len(live)]:
                    say(f"round {round_ + 1}/{rounds}, concurrency {c}: {name}")
                    command = {"op": "serve", "concurrency": c, "num_requests": n,
                               "max_new_tokens": max_new_tokens, "tag": f"r{round_}-c{c}"}
                    try:
                        rates[name][str(c)].append(round(workers[name].ask(command)["tokens_per_s"], 1))
                    except EngineError as exc:
                        if name == BASELINE:
                            raise
                        unavailable[name] = str(exc)
                        say(f"{name} failed: {exc}")
                        workers.pop(name).close()
                        rates.pop(name)
        for name in [name for name in workers if name != BASELINE]:
            say(f"weight push: {name}")
            pushes[name] = workers[name].ask({"op": "push"})["weight_push_s"]
    finally:
        for worker in workers.values():
            worker.close()
    numbers = {
        name: {"start_s": ready[name]["start_s"], "torch_threads": ready[name]["torch_threads"],
               "weight_push_s": pushes[name],
               "tokens_per_s": {c: round(statistics.median(r), 1) for c, r in per_c.items()},
               "tokens_per_s_per_round": per_c}
        for name, per_c in rates.items() if name != BASELINE
    }
    baseline = rates[BASELINE]
    return {
        "hf_generate": {"torch_threads": ready[BASELINE]["torch_threads"],
                        "tokens_per_s": {c: round(statistics.median(r), 1) for c, r in baseline.items()},
                        "tokens_per_s_per_round": baseline},
        "backends": numbers,
        "unavailable": unavailable,
        "memory_read_gbps_per_round": gbps,
    }


Ratios = dict[str, dict[str, list[float]]]


def _speedups(result: dict[str, Any]) -> tuple[dict[str, dict[str, float]], Ratios]:
    """Each engine's rate over the baseline's, per concurrency: every round's ratio, and their median."""
    baseline = result["hf_generate"]["tokens_per_s_per_round"]
    per_round = {
        backend: {c: [round(rate / base, 2) for rate, base in zip(rates, baseline[c], strict=True)]
                  for c, rates in numbers["tokens_per_s_per_round"].items()}
        for backend, numbers in result["backends"].items()
    }
    medians = {backend: {c: round(statistics.median(r), 2) for c, r in ratios.items()}
               for backend, ratios in per_round.items()}
    return medians, per_round


class BenchWorker:
    """The parent's handle on one `benchmarks.engine_worker` process: JSON lines, every wait bounded."""

    def __init__(self, process: subprocess.Popen[bytes], backend: str) -> None:
        self._process, self.backend = process, backend
        self._buffer = b""

    @classmethod
    def start(cls, setup: dict[str, Any], timeout_s: float = START_TIMEOUT_S
              ) -> tuple[BenchWorker, dict[str, Any]]:
        """Start a worker for `setup["backend"]` and wait until it is warm; returns it and its ready answer
        (start-up seconds, torch threads). EngineUnavailable if the backend cannot start here (with the
        worker's reason)."""
        process = subprocess.Popen([sys.executable, "-m", "benchmarks.engine_worker"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE)
        worker = cls(process, setup["backend"])
        try:
            worker._send(setup)
            ready = worker._receive(timeout_s)
        except BaseException:
            worker.close()
            raise
        if "error" in ready:
            worker.close()
            raise EngineUnavailable(worker.backend, "the engine did not start", ready["error"])
        return worker, ready

    @property
    def pid(self) -> int:
        return self._process.pid

    def ask(self, command: dict[str, Any], timeout_s: float = COMMAND_TIMEOUT_S) -> dict[str, Any]:
        """Send one command and wait for its answer; an engine's error answer raises EngineError."""
        self._send(command)
        answer = self._receive(timeout_s)
        if "error" in answer:
            raise EngineError(self.backend, f"{command['op']} failed", answer["error"])
        return answer

    def close(self, timeout_s: float = 120.0) -> None:
        """Ask the worker to close its engine and exit; kill it if it does not within `timeout_s`."""
        if self._process.poll() is None:
            try:
                self._send({"op": "close"})
                self._process.wait(timeout_s)
            except (EngineError, OSError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait()
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                pipe.close()

    def _send(self, message: dict[str, Any]) -> None:
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(json.dumps(message).encode() + b"\n")
            self._process.stdin.flush()
        except BrokenPipeError as exc:
            raise self._gone() from exc

    def _receive(self, timeout_s: float) -> dict[str, Any]:
        assert self._process.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self._process.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    self._process.kill()
                    raise EngineTimeout(self.backend,
                                        f"the bench worker did not answer within {timeout_s:.0f} s")
                chunk = os.read(self._process.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise self._gone()
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except json.JSONDecodeError as exc:
            raise MalformedResponse(self.backend, "the bench worker wrote something that is not a JSON line",
                              line[:200].decode(errors="replace")) from exc

    def _gone(self) -> EngineUnavailable:
        code = self._process.wait()
        return EngineUnavailable(self.backend, f"the bench worker exited (code {code}); its log is on stderr")


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
    rounds = result["memory_read_gbps_per_round"]
    gbps = statistics.median(rounds)
    weight_bytes = parameters * element
    per_round = {BASELINE: result["hf_generate"]["tokens_per_s_per_round"].get("1", [])}
    per_round.update({name: numbers["tokens_per_s_per_round"].get("1", [])
                      for name, numbers in result["backends"].items()})
    return {
        "memory_read_gbps": round(gbps, 1), "weight_bytes": weight_bytes,
        "tokens_per_s_c1": round(gbps * 1e9 / weight_bytes, 1),
        # each round's c=1 rate against that round's bound (the probe ran at the start of the round)
        "fraction_of_bound_c1": {
            name: round(statistics.median(rate * weight_bytes / (bw * 1e9)
                                          for rate, bw in zip(rates, rounds, strict=True)), 2)
            for name, rates in per_round.items() if rates
        },
    }
