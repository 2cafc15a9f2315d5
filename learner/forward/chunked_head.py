"""Target log-probabilities through the output head in chunks of positions: memory that does not grow
with vocabulary × tokens.

The plain path (`logprobs._target_logits`) has the model's `lm_head` produce the `(K, V)` logits of all
`K` target positions at once; autograd keeps them for the backward and builds an fp32 `(K, V)` gradient —
for 12k sampled tokens and a 152k vocabulary 3.7 GB of bf16 logits and 7.3 GB of gradient. Here the
model's body gives the `(K, H)` hidden states at the targets, and `ChunkedHeadLogprobs` takes
`log softmax(h Wᵀ / T)[y]` a chunk of rows at a time: the forward keeps only the hidden states and the
`(K,)` log-sum-exps, the backward computes each chunk's logits again (one more head GEMM) and turns them
into that chunk's gradient. Peak memory: one chunk's `(c, V)` block, whatever `K`.

The arithmetic is the plain path's, chunk by chunk: the head's product in the dtype the plain path's
`nn.Linear` runs in (under autocast the autocast dtype, with both operands cast), `/ T` in that dtype, the
log-softmax in fp32, and the backward's `g·(onehot − softmax)` in fp32 cast back to the logits' dtype
before `/ T` and the two products. Rows are independent, so the values equal the plain path's up to the
rounding a GEMM of another row count may take (tests: within fp32 rounding).

The per-trajectory gradient path (`learner/traj_grads/`) cannot hook a head that is never called as a
module; it passes a `head_grad` callback instead, which receives each chunk's logits gradient and input
rows (`HeadChunk`) in the backward and takes the head's weight gradient itself. Chunks then follow
`head_chunks`: whole short trajectories together, a long one in pieces of its own, so a trajectory's
gradient is complete when its last chunk has been seen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class HeadChunk:
    """One chunk of target rows in the backward: rows `[start, end)` of the `K` targets, their logits
    gradient `delta` (`(end − start, V)`, in the logits' dtype, already divided by `T`) and head inputs `x`
    (`(end − start, H)`, in the product's dtype)."""

    start: int
    end: int
    delta: Tensor
    x: Tensor


HeadGrad = Callable[[HeadChunk], None]
"""Receives every chunk of the backward, in row order (the per-trajectory path's head handler)."""


def chunk_rows(vocab_size: int, chunk_mib: float) -> int:
    """Rows per chunk so that one fp32 `(rows, V)` block takes at most `chunk_mib` MiB (at least 16)."""
    return max(16, int(chunk_mib * 2**20 // (4 * vocab_size)))


def head_chunks(target_counts: Sequence[int], rows: int) -> list[tuple[int, int]]:
    """`[start, end)` target rows per chunk: consecutive whole trajectories while they fit in `rows`; a
    trajectory with more targets than `rows` in pieces of its own. `target_counts`: targets per packed
    trajectory, in order."""
    chunks: list[tuple[int, int]] = []
    start = end = 0
    for count in target_counts:
        if count == 0:
            continue
        if count > rows:
            if end > start:
                chunks.append((start, end))
            for piece in range(end, end + count, rows):
                chunks.append((piece, min(piece + rows, end + count)))
            start = end = end + count
            continue
        if end + count - start > rows:
            chunks.append((start, end))
            start = end
        end += count
    if end > start:
        chunks.append((start, end))
    return chunks


def even_chunks(num_rows: int, rows: int) -> list[tuple[int, int]]:
    """`[start, end)` pieces of `rows` rows (the plain autograd path: trajectories do not matter)."""
    return [(start, min(start + rows, num_rows)) for start in range(0, num_rows, rows)]


class ChunkedHeadLogprobs(torch.autograd.Function):
    """`log softmax(x Wᵀ / T)[y]` → (K,) fp32 (fp64 for fp64 logits), chunk by chunk (module docstring).

    `x`: (K, H) head inputs; `weight`: (V, H); `targets`: (K,) long; `compute_dtype`: the product's dtype
    (None: `x`'s); `chunks`: row ranges covering `[0, K)` in order; `head_grad`: with it, the weight gets no
    gradient here — the callback takes each chunk's instead."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor, weight: Tensor, targets: Tensor,
                temperature: float, compute_dtype: torch.dtype | None, chunks: Sequence[tuple[int, int]],
                head_grad: HeadGrad | None) -> Tensor:
        cast_weight = weight if compute_dtype is None else weight.to(compute_dtype)
        wide_dtype = torch.promote_types(compute_dtype or x.dtype, torch.float32)
        out = torch.empty(x.shape[0], dtype=wide_dtype, device=x.device)
        lse = torch.empty_like(out)
        for start, end in chunks:
            wide = _logits(x[start:end], cast_weight, compute_dtype, temperature).to(wide_dtype)
            lse[start:end] = torch.logsumexp(wide, dim=-1)
            out[start:end] = wide.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1) - lse[start:end]
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.temperature, ctx.compute_dtype, ctx.chunks, ctx.head_grad = (
            temperature, compute_dtype, tuple(chunks), head_grad)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor
                 ) -> tuple[Tensor | None, Tensor | None, None, None, None, None, None]:
        x, weight, targets, lse = ctx.saved_tensors
        temperature, compute_dtype, head_grad = ctx.temperature, ctx.compute_dtype, ctx.head_grad
        cast_weight = weight if compute_dtype is None else weight.to(compute_dtype)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        take_weight = ctx.needs_input_grad[1] and head_grad is None
        grad_weight = torch.zeros_like(weight, dtype=torch.promote_types(weight.dtype, torch.float32)) \
            if take_weight else None
        for start, end in ctx.chunks:
            rows = x[start:end] if compute_dtype is None else x[start:end].to(compute_dtype)
            logits = _logits(rows, cast_weight, None, temperature)
            chunk_grad = grad[start:end]
            # _TargetLogprobs' backward: g·(onehot − softmax), one fp32 buffer
            delta = torch.sub(logits.to(lse.dtype), lse[start:end].unsqueeze(-1)).exp_().mul_(
                -chunk_grad.unsqueeze(-1))
            delta.scatter_add_(-1, targets[start:end].unsqueeze(-1), chunk_grad.unsqueeze(-1))
            delta = delta.to(logits.dtype)
            if temperature != 1.0:
                delta = delta / temperature
            if grad_x is not None:
                grad_x[start:end] = (delta @ cast_weight).to(x.dtype)
            if grad_weight is not None:  # in the product's dtype, as autograd's, summed in the weight's
                grad_weight.add_(delta.T @ rows)
            if head_grad is not None:
                head_grad(HeadChunk(start, end, delta, rows))
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_x, grad_weight, None, None, None, None, None


def _logits(rows: Tensor, weight: Tensor, compute_dtype: torch.dtype | None, temperature: float) -> Tensor:
    """`rows Wᵀ / T` as the plain path's `nn.Linear` and division compute it (weight already cast)."""
    if compute_dtype is not None:
        rows = rows.to(compute_dtype)
    logits = F.linear(rows, weight)
    return logits / temperature if temperature != 1.0 else logits


def chunked_target_logprobs(x: Tensor, head: nn.Module, targets: Tensor, temperature: float,
                            chunks: Sequence[tuple[int, int]], head_grad: HeadGrad | None = None) -> Tensor:
    """(K,) target log-probs of head inputs `x` (K, H) through `head` (an `nn.Linear` without bias) in
    `chunks`. Under autocast the product runs in the autocast dtype, as `head(x)` would."""
    device = x.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    with torch.autocast(device_type=device, enabled=False):
        return ChunkedHeadLogprobs.apply(x, head.weight, targets, temperature, compute_dtype, chunks,
                                         head_grad)
