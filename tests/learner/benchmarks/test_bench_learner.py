"""`learner.benchmarks.learner_step`: a tiny torch-learner run reports consistent numbers; megatron on CPU is
refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.benchmarks.learner_step import BenchBatch, BenchShape, bench_learner
from learner.cli import main

TINY = BenchShape(kind="qwen2", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)


def test_torch_learner_bench_reports_time_tokens_and_memory() -> None:
    batch = BenchBatch(groups=2, group_size=2, tokens=24, sampled=16)
    result = bench_learner("torch", shape=TINY, batch=batch, objective="vcpo", steps=2, warmup=1)
    json.dumps(result)  # JSON-able as it is
    assert len(result["step_s"]) == 2 and result["step_s_min"] <= result["step_s_mean"]
    assert result["tokens_per_step"] == 2 * 2 * 24  # 4 trajectories of 24 tokens
    assert result["tokens_per_s"] == pytest.approx(96 / result["step_s_mean"])
    assert result["peak_memory_mib"] > 0 and result["megatron"] is None


def test_megatron_bench_on_cpu_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="needs CUDA"):
        bench_learner("megatron", device="cpu", shape=TINY, batch=BenchBatch(groups=1, group_size=2, tokens=8,
                                                                             sampled=4))


def test_cli_bench_learner_reports_each_backend_and_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "learner.json"
    overrides = ["backends=[torch,torch-autocast,megatron]", "device=cpu", "kind=qwen2", "vocab_size=128",
                 "hidden_size=32", "intermediate_size=64", "num_hidden_layers=1", "num_attention_heads=2",
                 "num_key_value_heads=1", "groups=2", "group_size=2", "tokens=24", "sampled=16", "steps=2"]
    assert main(["bench", "learner", "--out", str(out), *overrides]) == 0
    result = json.loads(out.read_text())
    torch_row, megatron_row = result["results"]["torch"], result["results"]["megatron"]
    assert torch_row["vs_torch"] == 1.0 and torch_row["tokens_per_step"] == 96
    assert "needs CUDA" in megatron_row["error"]  # no GPU here: the row says why instead of a number
    autocast_row = result["results"]["torch-autocast"]
    assert autocast_row["vs_torch"] == pytest.approx(torch_row["step_s_mean"] / autocast_row["step_s_mean"],
                                                     abs=0.001)
