"""The learner step's kernel floor: the time its unavoidable kernels take at the rates they reach here.

`vcpo bench learner` measures model FLOPs/s against the matmul peak of one large square GEMM. That peak
is not what the step's own kernels can reach: its matrix products have a 576-wide inner dimension and
~2,000 rows, its attention runs over 240-token trajectories, VCPO's per-trajectory norms add batched
Gram products, and a separate proximal forward runs in fp32. `kernel_floor` times each of those
kernels alone, at the step's shapes and dtypes, on the same threads, and adds them up:

* the gradient pass's linear layers: per micro-batch and layer, the forward product, the input gradient
  and the weight gradient of every linear of the body (rows = the micro-batch's tokens), and of the
  output head over the trained tokens — in the matmul dtype;
* causal attention, forward and backward, per trajectory (`F.scaled_dot_product_attention`, heads
  already repeated for grouped-query attention);
* VCPO only: the Gram products of the fast per-trajectory norms (`X_j X_jᵀ` of each distinct layer input
  and `Δ_j Δ_jᵀ` of each layer output, batched over a micro-batch's trajectories); the head's
  per-trajectory products replace its weight-gradient product (same FLOPs) and are not counted again;
* the separate proximal forward (when the learner runs one): forward products and attention in the
  weights' dtype over the tokens it forwards (a group's prompt once with shared prompts);
* the optimizer step, as the bench measured it (memory-bound; no cheaper kernel stands in for it).

Nothing else: no elementwise layer (norms, rotary, activation, residual adds, casts), no copies, no
Python. `mfu_at_floor` is the fraction of the peak a step taking exactly the floor would reach — an
upper bound for `mfu` with these kernels on this host. Below a target, no amount of fusing or
overhead removal reaches it; only faster kernels (or fewer FLOPs than the model's) would.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.workload import BenchBatch, BenchShape
from learner.forward.packing import SHARED_PREFIX_MIN_TOKENS, plan_microbatches
from learner.forward.varlen_attention import branch_mask


def best_seconds(run: Callable[[], object], device: str, repeats: int) -> float:
    """Best wall time of `run` over `repeats` calls after one warm-up (the host's speed swings)."""
    best = math.inf
    for attempt in range(repeats + 1):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if attempt:
            best = min(best, time.perf_counter() - started)
    return best


class _KernelTimer:
    """Times each distinct kernel once (best of `repeats`) and reuses the figure for repeated shapes."""

    def __init__(self, device: str, repeats: int) -> None:
        self.device, self.repeats = device, repeats
        self._seen: dict[tuple[object, ...], float] = {}

    def _timed(self, key: tuple[object, ...], make: Callable[[], Callable[[], object]]) -> float:
        if key not in self._seen:
            self._seen[key] = best_seconds(make(), self.device, self.repeats)
        return self._seen[key]

    def mm(self, rows: int, inner: int, cols: int, dtype: torch.dtype) -> float:
        """(rows × inner) @ (inner × cols)."""
        def make() -> Callable[[], object]:
            a = torch.randn(rows, inner, device=self.device).to(dtype)
            b = torch.randn(inner, cols, device=self.device).to(dtype)
            return lambda: torch.mm(a, b)
        return self._timed(("mm", rows, inner, cols, dtype), make)

    def linear(self, rows: int, in_features: int, out_features: int, dtype: torch.dtype,
               backward: bool) -> float:
        """A linear layer's forward product, and with `backward` its input and weight gradients."""
        seconds = self.mm(rows, in_features, out_features, dtype)
        if backward:
            seconds += self.mm(rows, out_features, in_features, dtype)  # δ W: the input gradient
            seconds += self.mm(out_features, rows, in_features, dtype)  # δᵀ x: the weight gradient
        return seconds

    def attention(self, queries: int, keys: int, heads: int, head_dim: int, dtype: torch.dtype,
                  backward: bool) -> float:
        """Causal attention of `queries` over `keys` (queries are the last of the keys' positions)."""
        def make() -> Callable[[], object]:
            def tensor(length: int) -> torch.Tensor:
                return torch.randn(1, heads, length, head_dim, device=self.device, dtype=dtype,
                                   requires_grad=backward)
            q, k, v = tensor(queries), tensor(keys), tensor(keys)
            # a shared-prompt branch: every prefix key, then causal within the branch
            prefix = keys - queries
            mask = branch_mask(queries, prefix, torch.device(self.device)) if prefix else None
            grad = torch.randn(1, heads, queries, head_dim, device=self.device, dtype=dtype)

            def run() -> None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
                if backward:
                    q.grad = k.grad = v.grad = None
                    out.backward(grad)
            return run
        return self._timed(("attention", queries, keys, heads, head_dim, dtype, backward), make)

    def grams(self, trajectories: int, length: int, width: int, dtype: torch.dtype) -> float:
        """`trajectories` Gram matrices of `length` rows of `width` (one batched product)."""
        def make() -> Callable[[], object]:
            rows = torch.randn(trajectories, length, width, device=self.device).to(dtype)
            return lambda: torch.bmm(rows, rows.transpose(1, 2))
        return self._timed(("grams", trajectories, length, width, dtype), make)


def kernel_floor(shape: BenchShape, batch: BenchBatch, *, micro_batch_tokens: int, matmul_dtype: torch.dtype,
                 weight_dtype: torch.dtype, per_trajectory_norms: bool, separate_proximal: bool,
                 share_prompts: bool, optimizer_s: float, model_flops: float, peak_gflops: float,
                 device: str = "cpu", repeats: int = 3) -> dict[str, Any]:
    """The floor of one step of `batch` on a `shape` model (see the module docstring), its parts in
    seconds, and `mfu_at_floor` = `model_flops` / floor / `peak_gflops`.

    The gradient pass forwards a group's prompt once only where no per-trajectory norm needs each
    trajectory's own activations (`share_prompts` and not `per_trajectory_norms`), as the learner does."""
    timer = _KernelTimer(device, repeats)
    hidden, layers, heads = shape.hidden_size, shape.num_hidden_layers, shape.num_attention_heads
    head_dim = hidden // heads
    linears = shape.body_linears()
    # the norms' Grams: each distinct layer input (q/k/v share the first, gate/up the fifth), then each output
    gram_widths = [*(linears[i][0] for i in (0, 3, 4, 6)), *(out for _, out in linears)]
    tokens, group_size = batch.tokens, batch.group_size
    size = batch.groups * group_size
    plans = plan_microbatches([tokens] * size, [i // group_size for i in range(size)], micro_batch_tokens)

    def forward_part(plan: list[int], shared_prompt: int, dtype: torch.dtype,
                     backward: bool) -> tuple[float, float]:
        """(linear layers and head, attention) seconds of one packed pass over `plan`."""
        roots, branches = _roots_and_branches(plan, group_size, shared_prompt)
        rows = roots * tokens + branches * (tokens - shared_prompt)
        linear = layers * sum(timer.linear(rows, i, o, dtype, backward) for i, o in linears)
        linear += timer.linear(len(plan) * batch.sampled, hidden, shape.vocab_size, dtype, backward)
        attention = layers * roots * timer.attention(tokens, tokens, heads, head_dim, dtype, backward)
        if branches:
            attention += layers * branches * timer.attention(
                tokens - shared_prompt, tokens, heads, head_dim, dtype, backward)
        return linear, attention

    shared = batch.prompt if share_prompts else 0
    parts = dict.fromkeys(("gradient_linears_s", "gradient_attention_s", "norm_grams_s", "proximal_s"), 0.0)
    for plan in plans:
        linear, attention = forward_part(plan, 0 if per_trajectory_norms else shared, matmul_dtype, True)
        parts["gradient_linears_s"] += linear
        parts["gradient_attention_s"] += attention
        if per_trajectory_norms:
            parts["norm_grams_s"] += layers * sum(
                timer.grams(len(plan), tokens, width, matmul_dtype) for width in gram_widths)
        if separate_proximal:
            parts["proximal_s"] += sum(forward_part(plan, shared, weight_dtype, False))
    total = sum(parts.values()) + optimizer_s
    return {**parts, "optimizer_s": optimizer_s, "total_s": total,
            "mfu_at_floor": model_flops / total / (peak_gflops * 1e9), "micro_batches": len(plans)}


def _roots_and_branches(plan: list[int], group_size: int, shared_prompt: int) -> tuple[int, int]:
    """How many trajectories of a micro-batch forward whole (a group's first) and how many only what
    follows their group's shared prompt (the others, when the prompt is long enough to be shared)."""
    members_of: dict[int, int] = {}
    for index in plan:
        members_of[index // group_size] = members_of.get(index // group_size, 0) + 1
    if shared_prompt < SHARED_PREFIX_MIN_TOKENS:
        return len(plan), 0
    branches = sum(count - 1 for count in members_of.values())
    return len(plan) - branches, branches
