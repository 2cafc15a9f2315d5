"""`vcpo bench sandbox`: latency and throughput of the local sandbox next to a bare interpreter.

Measured in one run, on the same interpreter and snippet:
* latency (p50/p99/mean, ms) of one call at a time with the machine idle between calls (how
  tool calls arrive in RL: a model generates between them), for the sandbox with its warm pool,
  the sandbox without one, and a bare `python -c` subprocess; calls of the kinds alternate so
  that background load hits them alike;
* back-to-back throughput (calls/s) and latency at each concurrency, sandbox and bare.
Targets from the issue: sandbox p50 <= 1.5x bare p50, and >= 30 calls/s at every concurrency > 1.

This module measures; it does not tune. It runs its own event loop (`asyncio.run`), so call
`run_sandbox_bench` from synchronous code.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from run.launch.host import host_description
from tools.base import ToolCall
from tools.sandbox.local_sandbox import LocalPythonSandbox
from tools.settings import LocalSandboxSettings

MAX_P50_OVERHEAD_RATIO = 1.5
MIN_THROUGHPUT_CALLS_PER_S = 30.0

Call = Callable[[], Awaitable[None]]


def run_sandbox_bench(
    num_calls: int = 200,
    concurrencies: Sequence[int] = (1, 8, 32),
    snippet: str = "print(1 + 1)",
    settings: LocalSandboxSettings | None = None,
) -> dict[str, Any]:
    """Run the benchmark and return a JSON-able dict (see the module docstring for what is in it)."""
    if num_calls < 1 or not concurrencies or min(concurrencies) < 1:
        raise ValueError(
            f"need num_calls >= 1 and concurrencies >= 1; got {num_calls}, {tuple(concurrencies)}"
        )
    settings = settings or LocalSandboxSettings(max_concurrency=max(concurrencies), warm_pool_size=4)
    return asyncio.run(_bench(num_calls, tuple(concurrencies), snippet, settings))


async def _bench(
    num_calls: int, concurrencies: tuple[int, ...], snippet: str, settings: LocalSandboxSettings
) -> dict[str, Any]:
    cold_settings = settings.model_copy(update={"warm_pool_size": 0})
    async with LocalPythonSandbox(settings) as tool, LocalPythonSandbox(cold_settings) as cold_tool:
        interpreter = tool.launcher.layout.executable
        sandbox, cold, bare = (
            _sandbox_call(tool, snippet),
            _sandbox_call(cold_tool, snippet),
            _bare_call(interpreter, snippet),
        )
        for warm_up in (sandbox, cold, bare):
            await warm_up()
        idle = await _idle_latencies(
            {"sandbox": sandbox, "sandbox_no_warm_pool": cold, "bare_python": bare}, tool, num_calls
        )
        loaded = {}
        for concurrency in concurrencies:
            loaded[str(concurrency)] = {
                **_prefixed("sandbox", await _loaded_run(sandbox, num_calls, concurrency)),
                **_prefixed("bare_python", await _loaded_run(bare, num_calls, concurrency)),
            }
            await tool.wait_for_warm_pool()
        metrics = tool.metrics()
    latency_ms = {name: _summary(values) for name, values in idle.items()}
    ratio = latency_ms["sandbox"]["p50"] / latency_ms["bare_python"]["p50"]
    parallel = [loaded[str(c)]["sandbox_calls_per_s"] for c in concurrencies if c > 1] or [
        loaded[str(c)]["sandbox_calls_per_s"] for c in concurrencies
    ]
    return {
        "snippet": snippet,
        "num_calls": num_calls,
        "cpu_count": os.cpu_count(),
        "interpreter": interpreter,
        "warm_pool_size": settings.warm_pool_size,
        "latency_ms": latency_ms,
        "p50_overhead_ratio": ratio,
        "p50_overhead_ratio_no_warm_pool": latency_ms["sandbox_no_warm_pool"]["p50"]
        / latency_ms["bare_python"]["p50"],
        "by_concurrency": loaded,
        "warm_pool_hits": metrics["tools/python_warm_pool_hits"],
        "warm_pool_misses": metrics["tools/python_warm_pool_misses"],
        "host": host_description(),
        "targets": {
            "max_p50_overhead_ratio": MAX_P50_OVERHEAD_RATIO,
            "min_throughput_calls_per_s": MIN_THROUGHPUT_CALLS_PER_S,
            "is_p50_overhead_met": ratio <= MAX_P50_OVERHEAD_RATIO,
            "is_throughput_met": min(parallel) >= MIN_THROUGHPUT_CALLS_PER_S,
        },
    }


def _sandbox_call(tool: LocalPythonSandbox, snippet: str) -> Call:
    async def call() -> None:
        result = await tool.run(ToolCall(code=snippet))
        if result.status != "ok":
            raise RuntimeError(f"benchmark snippet failed in the sandbox: {result.status} {result.message}")

    return call


def _bare_call(interpreter: str, snippet: str) -> Call:
    async def call() -> None:
        process = await asyncio.create_subprocess_exec(
            interpreter, "-c", snippet, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        await process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"benchmark snippet failed in a bare interpreter (exit {process.returncode})")

    return call


async def _idle_latencies(
    calls: dict[str, Call], tool: LocalPythonSandbox, num_calls: int
) -> dict[str, list[float]]:
    """One call at a time, kinds alternating, waiting for the warm pool to refill between calls."""
    found: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(num_calls):
        for name, call in calls.items():
            await tool.wait_for_warm_pool()
            start = time.perf_counter()
            await call()
            found[name].append(time.perf_counter() - start)
    return found


async def _loaded_run(call: Call, num_calls: int, concurrency: int) -> dict[str, float]:
    """`num_calls` calls back to back by `concurrency` workers: throughput and per-call latency."""
    latencies: list[float] = []
    remaining = [num_calls]

    async def worker() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            start = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    summary = _summary(latencies)
    return {"calls_per_s": num_calls / elapsed, "p50_ms": summary["p50"], "p99_ms": summary["p99"]}


def _prefixed(prefix: str, values: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}_{key}": value for key, value in values.items()}


def _summary(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50": _percentile(ordered, 0.50) * 1e3,
        "p99": _percentile(ordered, 0.99) * 1e3,
        "mean": statistics.fmean(ordered) * 1e3,
    }


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]
