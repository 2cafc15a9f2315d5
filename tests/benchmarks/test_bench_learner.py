"""`benchmarks.learner_step`: a tiny torch-learner run reports consistent numbers; megatron on CPU is
refused with the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.learner_step import BenchBatch, BenchShape, bench_learner, random_batch
from benchmarks.schema import LearnerBenchConfig
from cli import main
from learner.forward.fused_layers import compiler_problem

TINY = BenchShape(kind="qwen2", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1)


def test_torch_learner_bench_reports_time_tokens_and_memory() -> None:
    batch = BenchBatch(groups=2, group_size=2, tokens=24, sampled=16, prompt=0)
    result = bench_learner("torch", shape=TINY, batch=batch, objective="vcpo", steps=2, warmup=1,
                           peak_gemm_size=128)
    json.dumps(result)  # JSON-able as it is
    assert len(result["step_s"]) == 2 and result["step_s_min"] <= result["step_s_mean"]
    assert result["tokens_per_step"] == 2 * 2 * 24  # 4 trajectories of 24 tokens
    assert result["tokens_per_s"] == pytest.approx(96 / result["step_s_mean"])
    assert result["peak_memory_mib"] > 0 and result["megatron"] is None
    floor = result["kernel_floor"]  # timed in the same process, after the steps
    assert floor["total_s"] > 0 and floor["norm_grams_s"] > 0  # VCPO's fast norms
    assert result["step_over_floor"] == pytest.approx(result["step_s_mean"] / floor["total_s"])
    # fp32 'auto' reuses the gradient forward: no proximal part
    assert result["reuses_gradient_forward"] and floor["proximal_s"] == 0.0


def test_the_bench_shares_each_groups_prompt_like_the_run_unless_told_not_to() -> None:
    batch = BenchBatch(groups=2, group_size=2, tokens=40, sampled=16, prompt=20)
    # the separate proximal pass, as the default run has it under autocast (fp32 'auto' reuses the gradient
    # forward, and then no forward takes the shared layout)
    rows = {share: bench_learner("torch", shape=TINY, batch=batch, objective="vcpo", steps=1, warmup=0,
                                 peak_gemm_size=128, proximal="separate", share_prompts=share)
            for share in (True, False)}
    assert rows[True]["prompt_tokens_shared_per_step"] == 2 * 1 * 20  # each group's second member's prompt
    assert rows[False]["prompt_tokens_shared_per_step"] == 0
    assert rows[True]["share_prompts"] and not rows[False]["share_prompts"]


def test_the_bench_times_the_norm_path_it_is_told() -> None:
    """`grad_norm_path` reaches the learner: on the per-trajectory path the fp32 step cannot take log π_old
    from the gradient pass (one backward per trajectory has no packed forward to reuse), on the fast one
    it does."""
    batch = BenchBatch(groups=1, group_size=2, tokens=24, sampled=16, prompt=0)
    rows = {path: bench_learner("torch", shape=TINY, batch=batch, objective="vcpo", grad_norm_path=path,
                                steps=1, warmup=0, peak_gemm_size=128)
            for path in ("fast", "per_trajectory")}
    assert rows["fast"]["grad_norm_path"] == "fast" and rows["fast"]["reuses_gradient_forward"]
    assert rows["per_trajectory"]["grad_norm_path"] == "per_trajectory"
    assert not rows["per_trajectory"]["reuses_gradient_forward"]


def test_megatron_bench_on_cpu_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="needs CUDA"):
        bench_learner("megatron", device="cpu", shape=TINY,
                      batch=BenchBatch(groups=1, group_size=2, tokens=8, sampled=4, prompt=0))


TINY_CLI = ["device=cpu", "kind=qwen2", "vocab_size=128", "hidden_size=32", "intermediate_size=64",
            "num_hidden_layers=1", "num_attention_heads=2", "num_key_value_heads=1", "groups=2",
            "group_size=2", "tokens=24", "prompt=4", "sampled=16", "steps=2", "peak_gemm_size=128"]
"""`vcpo bench learner` overrides for TINY's model and a 2 × 2 batch of 24 tokens."""


def test_cli_bench_learner_reports_each_backend_and_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "learner.json"
    overrides = ["backends=[torch,torch-autocast,megatron]", *TINY_CLI, "force_emulated=true",
                 "fused_elementwise=auto"]
    assert main(["bench", "learner", "--out", str(out), *overrides]) == 0
    result = json.loads(out.read_text())
    torch_row, megatron_row = result["results"]["torch"], result["results"]["megatron"]
    assert torch_row["vs_torch"] == 1.0 and torch_row["tokens_per_step"] == 96
    assert "needs CUDA" in megatron_row["error"]  # no GPU here: the row says why instead of a number
    autocast_row = result["results"]["torch-autocast"]
    assert autocast_row["vs_torch"] == pytest.approx(torch_row["step_s_mean"] / autocast_row["step_s_mean"],
                                                     abs=0.001)
    for row in (torch_row, autocast_row):  # FLOPs/s against the peak of the row's matmul dtype, same run
        peak = row["matmul_peak_gflops"][row["matmul_dtype"]]
        assert row["mfu"] == pytest.approx(row["model_gflops_per_s"] / peak)
        assert 0 < row["mfu"] < 1 and 0 < row["roofline_fraction"] < 1
        assert set(row["phases_s_mean"]) == {"proximal", "gradient", "optimizer"}
        assert sum(row["phases_s_mean"].values()) <= row["step_s_mean"]
    assert (torch_row["matmul_dtype"], autocast_row["matmul_dtype"]) == ("float32", "bfloat16")
    # 'auto' resolves as in a run: the fused kernels wherever torch.compile can build them
    can_fuse = compiler_problem(torch.device("cpu")) is None
    assert torch_row["fused_elementwise"] is can_fuse and autocast_row["fused_elementwise"] is can_fuse
    assert result["host"]["cpu"] and result["host"]["threads"] >= 1


def test_lora_rows_train_the_adapters_alone_each_in_its_own_process_beside_full_weights(
        tmp_path: Path) -> None:
    out = tmp_path / "learner.json"
    overrides = ["backends=[torch,torch-lora]", *TINY_CLI, "isolate=true", "lora={rank: 4, alpha: 8}"]
    assert main(["bench", "learner", "--out", str(out), *overrides]) == 0
    rows = json.loads(out.read_text())["results"]
    full, lora = rows["torch"], rows["torch-lora"]
    assert full["lora"] is None and full["trained_parameters"] == full["parameters_on_rank"]
    assert lora["lora"]["rank"] == 4 and lora["kernel_floor"] is None
    # rank 4 on q, k, v, o, gate, up, down of one layer: r × (in + out) each
    shapes = [(32, 32), (32, 16), (32, 16), (32, 32), (32, 64), (32, 64), (64, 32)]
    assert lora["trained_parameters"] == sum(4 * (i + o) for i, o in shapes)
    assert lora["parameters_on_rank"] == full["parameters_on_rank"] + lora["trained_parameters"]
    assert lora["vs_full_weights"]["step_s"] == pytest.approx(lora["step_s_mean"] / full["step_s_mean"],
                                                              abs=0.001)
    assert lora["vs_full_weights"]["peak_memory"] == pytest.approx(
        lora["peak_memory_mib"] / full["peak_memory_mib"], abs=0.001)
    assert 0 < lora["peak_memory_mib"] < 4096  # each row's own process: a fresh interpreter's peak


def test_model_flops_count_the_body_over_all_tokens_the_head_over_trained_ones_and_attention() -> None:
    from benchmarks.learner_step import model_flops

    # qwen2 tiny: head_dim 16, q 32, kv 16: attention 32*(32+32) + 32*32 = 3072, mlp 3*32*64 = 6144
    body, head = 3072 + 6144, 128 * 32
    batch = BenchBatch(groups=2, group_size=2, tokens=24, sampled=16, prompt=4)
    flops = model_flops(TINY, batch)
    attention = 1 * 4 * 2 * 32 * 24 * 25  # layers × trajectories × 2 × q width × T(T+1), forward
    forward = 2 * body * 96 + 2 * head * 64 + attention
    assert flops == {"model_flops": 3.0 * forward, "forward_flops": forward,
                     "proximal_forward_flops": forward}


def test_a_bf16_row_on_a_cpu_that_emulates_bf16_is_skipped_at_once_with_the_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.learner_step as bench

    monkeypatch.setattr(bench, "native_bf16", lambda device: False)
    monkeypatch.setattr(bench, "bench_learner", lambda *a, **k: pytest.fail("an emulated bf16 row ran"))
    config = LearnerBenchConfig(backends=["torch-autocast"], device="cpu")
    row = bench.run_learner_bench(config)["results"]["torch-autocast"]
    assert "only in emulation" in row["skipped"] and "force_emulated=true" in row["skipped"]


def test_random_batch_shares_each_groups_prompt() -> None:
    batch = random_batch(BenchBatch(groups=2, group_size=3, tokens=10, sampled=3, prompt=4), 50)
    ids = [t.token_ids for t in batch.trajectories]
    assert ids[0][:4] == ids[1][:4] == ids[2][:4] and ids[0][:4] != ids[3][:4]
    assert ids[0][4:] != ids[1][4:]


def test_the_python_defaults_are_the_cli_defaults_and_bad_lengths_are_refused() -> None:
    """`bench_learner()` without a batch times what `vcpo bench learner` times: the default run's step, its
    shared prompt included (a prompt-less default once made probes time an unshared proximal pass)."""
    config = LearnerBenchConfig()
    assert BenchBatch() == BenchBatch(groups=config.groups, group_size=config.group_size,
                                      tokens=config.tokens, sampled=config.sampled, prompt=config.prompt)
    with pytest.raises(ValueError, match="must not exceed tokens"):
        BenchBatch(tokens=100, sampled=70, prompt=50)


def test_a_multi_turn_batch_alternates_sampled_segments_and_tool_outputs() -> None:
    batch = BenchBatch(groups=1, group_size=2, tokens=20, sampled=9, prompt=3, turns=3)
    mask = batch.loss_mask()
    assert len(mask) == 20 and sum(mask) == 9 and not any(mask[:3])
    runs = [(value, len(list(group))) for value, group in __import__("itertools").groupby(mask)]
    assert runs == [(False, 3), (True, 3), (False, 4), (True, 3), (False, 4), (True, 3)]
    assert BenchBatch(tokens=10, sampled=4, prompt=2).loss_mask() == (False,) * 6 + (True,) * 4
    with pytest.raises(ValueError, match="turns"):
        BenchBatch(tokens=10, sampled=2, prompt=2, turns=3)


SWEEP_TINY = ["backends=[torch]", "device=cpu", "kind=qwen2", "vocab_size=128", "hidden_size=32",
              "intermediate_size=64", "num_hidden_layers=1", "num_attention_heads=2",
              "num_key_value_heads=1", "groups=1", "group_size=2", "steps=1", "warmup=0",
              "peak_gemm_size=128", "logits_chunk_mib=0.001"]


def test_the_learner_sweep_times_every_row_with_ratios_against_grpo(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    overrides = [*SWEEP_TINY, "sweep.lengths=[64,128]", "sweep.recompute=[false,true]", "sweep.isolate=false"]
    assert main(["bench", "learner", "--config", "benchmarks/configs/learner_long.yaml", "--out", str(out),
                 *overrides]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert not [row for row in rows if "error" in row or "skipped" in row]
    assert [(r["length"], r["recompute"], r["row"]) for r in rows] == [
        (n, rc, row) for n in (64, 128) for rc in (False, True)
        for row in ("grpo", "vcpo_fast", "vcpo_per_trajectory")]
    for row in rows:
        assert row["skipped_groups_per_step"] == 0  # every group trained: the step timed is a real one
        assert row["batch"]["tokens"] == row["length"] and row["batch"]["turns"] == 4
        assert row["micro_batch_tokens"] >= row["length"] and row["peak_memory_mib"] > 0
        assert (row["objective"], row["grad_norm_path"]) == {
            "grpo": ("grpo", None), "vcpo_fast": ("vcpo", "fast"),
            "vcpo_per_trajectory": ("vcpo", "per_trajectory")}[row["row"]]
    ratios = {(r["length"], r["recompute"], r["row"]): r["over_grpo"] for r in result["ratios"]}
    by_key = {(r["length"], r["recompute"], r["row"]): r["step_s_mean"] for r in rows}
    assert len(ratios) == 8
    assert ratios[(128, True, "vcpo_fast")] == pytest.approx(
        by_key[(128, True, "vcpo_fast")] / by_key[(128, True, "grpo")])


def test_an_isolated_sweep_row_runs_in_a_process_of_its_own(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    overrides = [*SWEEP_TINY, "sweep.lengths=[64]", "sweep.recompute=[true]", "sweep.rows=[vcpo_fast]"]
    assert main(["bench", "learner", "--config", "benchmarks/configs/learner_long.yaml", "--out", str(out),
                 *overrides]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["recompute"] is True and row["step_s_mean"] > 0
    # the child's own peak RSS: a fresh interpreter with torch, far below this test process's
    assert 0 < row["peak_memory_mib"] < 4096


def test_every_group_of_a_random_batch_has_rewards_that_differ() -> None:
    """A group whose members scored alike adds nothing to the gradient and the learner skips its gradient
    pass: a bench batch of such groups would time a step that trains nothing."""
    for tokens in range(64, 2048, 97):
        step = random_batch(BenchBatch(groups=3, group_size=2, tokens=tokens, sampled=tokens // 2,
                                       prompt=tokens // 10), 128, seed=tokens)
        for group in range(3):
            rewards = {t.reward for t in step.trajectories[2 * group: 2 * group + 2]}
            assert len(rewards) == 2, (tokens, group)
