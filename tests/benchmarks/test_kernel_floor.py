"""`benchmarks.kernel_floor`: which kernels a step's floor adds up, on a timer that counts instead of
timing (so the accounting is checked exactly), and one real timing on a tiny model."""

from __future__ import annotations

import pytest
import torch

from benchmarks import kernel_floor as floor_module
from benchmarks.kernel_floor import kernel_floor
from benchmarks.workload import BenchBatch, BenchShape

SHAPE = BenchShape(kind="llama", vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2)
# 2 groups x 4 trajectories of 40 tokens, the first 20 a shared prompt, the last 10 trained; a 200-token
# budget puts each group in a micro-batch of its own
BATCH = BenchBatch(groups=2, group_size=4, tokens=40, sampled=10, prompt=20)


class _CountingTimer(floor_module._KernelTimer):
    """Seconds = a product's multiply-adds × 1e-9, attention = queries × keys × 1e-9 (× 3 with its backward),
    Grams = trajectories × length² × width × 1e-9: exact, host-independent figures."""

    def mm(self, rows: int, inner: int, cols: int, dtype: torch.dtype) -> float:
        return rows * inner * cols * 1e-9

    def attention(self, queries: int, keys: int, heads: int, head_dim: int, dtype: torch.dtype,
                  backward: bool) -> float:
        return queries * keys * 1e-9 * (3 if backward else 1)

    def grams(self, trajectories: int, length: int, width: int, dtype: torch.dtype) -> float:
        return trajectories * length * length * width * 1e-9


def _floor(monkeypatch: pytest.MonkeyPatch, **options: object) -> dict[str, float]:
    monkeypatch.setattr(floor_module, "_KernelTimer", _CountingTimer)
    settings: dict[str, object] = dict(micro_batch_tokens=200, matmul_dtype=torch.bfloat16,
                                       weight_dtype=torch.float32, per_trajectory_norms=True,
                                       separate_proximal=True, share_prompts=True, optimizer_s=0.5,
                                       model_flops=1e9, peak_gflops=10.0)
    return kernel_floor(SHAPE, BATCH, **{**settings, **options})


# the body's linear layers of one layer (in, out): q, k, v, o, gate, up, down; head_dim 4, 2 KV heads
LINEARS = [(16, 16), (16, 8), (16, 8), (16, 16), (16, 32), (16, 32), (32, 16)]


def _linears(rows: int, backward: bool) -> float:
    """Multiply-adds × 1e-9 of the body (3 layers) and the head (over 4 × 10 trained tokens) for `rows`."""
    body = 3 * sum(rows * i * o for i, o in LINEARS)
    head = 40 * 16 * 100
    return (body + head) * 1e-9 * (3 if backward else 1)  # forward, input gradient, weight gradient


def test_the_vcpo_floor_forwards_every_prompt_in_the_gradient_pass_and_shares_it_in_the_proximal_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    floor = _floor(monkeypatch)
    assert floor["micro_batches"] == 2
    # gradient pass: per micro-batch 160 rows (4 whole trajectories: the norms need each one's activations)
    assert floor["gradient_linears_s"] == pytest.approx(2 * _linears(160, backward=True))
    assert floor["gradient_attention_s"] == pytest.approx(2 * 3 * 4 * 40 * 40 * 3e-9)
    # Grams of the 4 distinct layer inputs (16, 16, 16, 32 wide) and the 7 outputs, 3 layers, 2 micro-batches
    widths = [16, 16, 16, 32] + [o for _, o in LINEARS]
    assert floor["norm_grams_s"] == pytest.approx(2 * 3 * sum(4 * 40 * 40 * w for w in widths) * 1e-9)
    # proximal: a root of 40 tokens and 3 branches of the 20 after the prompt, forward only
    rows = 40 + 3 * 20
    proximal = _linears(rows, backward=False) + 3 * (40 * 40 + 3 * 20 * 40) * 1e-9
    assert floor["proximal_s"] == pytest.approx(2 * proximal)
    parts = ("gradient_linears_s", "gradient_attention_s", "norm_grams_s", "proximal_s", "optimizer_s")
    assert floor["total_s"] == pytest.approx(sum(floor[name] for name in parts))
    assert floor["mfu_at_floor"] == pytest.approx(1e9 / floor["total_s"] / 10e9)


def test_without_norms_the_gradient_pass_shares_prompts_and_a_reusing_learner_has_no_proximal_part(
        monkeypatch: pytest.MonkeyPatch) -> None:
    floor = _floor(monkeypatch, per_trajectory_norms=False, separate_proximal=False)
    assert floor["norm_grams_s"] == 0.0 and floor["proximal_s"] == 0.0
    assert floor["gradient_linears_s"] == pytest.approx(2 * _linears(40 + 3 * 20, backward=True))
    assert floor["gradient_attention_s"] == pytest.approx(2 * 3 * (40 * 40 + 3 * 20 * 40) * 3e-9)
    unshared = _floor(monkeypatch, per_trajectory_norms=False, separate_proximal=False, share_prompts=False)
    assert unshared["gradient_linears_s"] == pytest.approx(2 * _linears(160, backward=True))


def test_a_prompt_too_short_to_share_is_forwarded_by_every_trajectory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    short = BenchBatch(groups=2, group_size=4, tokens=40, sampled=10, prompt=8)  # < SHARED_PREFIX_MIN_TOKENS
    monkeypatch.setattr(floor_module, "_KernelTimer", _CountingTimer)
    floor = kernel_floor(SHAPE, short, micro_batch_tokens=200, matmul_dtype=torch.bfloat16,
                         weight_dtype=torch.float32, per_trajectory_norms=True, separate_proximal=True,
                         share_prompts=True, optimizer_s=0.0, model_flops=1e9, peak_gflops=10.0)
    assert floor["proximal_s"] == pytest.approx(2 * (_linears(160, backward=False) + 3 * 4 * 40 * 40 * 1e-9))


def test_the_real_timer_times_each_kernel_shape_once(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[int] = []
    real = floor_module.best_seconds

    def counted(run: object, device: str, repeats: int) -> float:
        timed.append(1)
        return real(run, device, repeats)  # type: ignore[arg-type]

    monkeypatch.setattr(floor_module, "best_seconds", counted)
    calls = {}
    for groups in (1, 2):  # two micro-batches of the same shapes time nothing more than one
        timed.clear()
        batch = BenchBatch(groups=groups, group_size=4, tokens=40, sampled=10, prompt=20)
        floor = kernel_floor(SHAPE, batch, micro_batch_tokens=200, matmul_dtype=torch.float32,
                             weight_dtype=torch.float32, per_trajectory_norms=True, separate_proximal=True,
                             share_prompts=True, optimizer_s=0.0, model_flops=1e6, peak_gflops=1.0, repeats=1)
        calls[groups] = len(timed)
        for name in ("gradient_linears_s", "gradient_attention_s", "norm_grams_s", "proximal_s"):
            assert floor[name] > 0, name
    assert calls[1] == calls[2] > 0
