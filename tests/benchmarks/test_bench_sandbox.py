"""`run_sandbox_bench` with tiny numbers: the JSON shape and sane values, not the timings."""

from __future__ import annotations

import json

from benchmarks.sandbox import run_sandbox_bench
from tools.settings import LocalSandboxSettings


def test_bench_reports_latency_and_throughput_next_to_bare_python() -> None:
    settings = LocalSandboxSettings(warm_pool_size=1, max_concurrency=2)
    report = run_sandbox_bench(num_calls=3, concurrencies=(1, 2), settings=settings)
    assert json.loads(json.dumps(report)) == report  # JSON-able as is
    for kind in ("sandbox", "sandbox_no_warm_pool", "bare_python"):
        latency = report["latency_ms"][kind]
        assert 0 < latency["p50"] <= latency["p99"] and latency["mean"] > 0
    assert set(report["by_concurrency"]) == {"1", "2"}
    for row in report["by_concurrency"].values():
        assert row["sandbox_calls_per_s"] > 0 and row["bare_python_calls_per_s"] > 0
        assert 0 < row["sandbox_p50_ms"] <= row["sandbox_p99_ms"]
    assert report["p50_overhead_ratio"] > 0
    assert set(report["targets"]) == {
        "max_p50_overhead_ratio",
        "min_throughput_calls_per_s",
        "is_p50_overhead_met",
        "is_throughput_met",
    }
    assert report["warm_pool_hits"] + report["warm_pool_misses"] >= 3
