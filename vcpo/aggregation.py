"""Loss aggregation: how a (B, T) matrix of per-token losses becomes the scalar loss.

Four modes, one function each, plus `LOSS_AGGREGATIONS` (name → function):

* token-mean:             Σ_{i,t} m_{i,t} x_{i,t} / Σ_{i,t} m_{i,t}       (every token weighs the same)
* seq-mean-token-mean:    (1/B) Σ_i [Σ_t m x / |M_i|]                      (every trajectory weighs the same;
                                                                            VCPO's ℓ_i = mean log π over M_i)
* seq-mean-token-sum:     (1/B) Σ_i Σ_t m x
* seq-mean-token-sum-norm:(1/B) Σ_i Σ_t m x / N                            (Dr. GRPO: N a constant, default T)

B counts the trajectories with at least one trained token. With micro-batching or data
parallelism the local denominator is wrong; pass `num_units` (the global token count for
token-mean, the global trajectory count otherwise) and sum the results.

Deliberately not here: which tokens are trained (the caller's mask) and any reduction across ranks.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _denominator(local: Tensor, num_units: float | Tensor | None, like: Tensor) -> Tensor:
    count = local if num_units is None else torch.as_tensor(num_units, device=like.device)
    return count.to(like.dtype).clamp_min(1.0)


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Σ of `values` where `mask` is True; masked-out entries never propagate NaN/inf or gradients."""
    return torch.where(mask, values, torch.zeros_like(values)).sum()


def token_mean(token_losses: Tensor, loss_mask: Tensor, num_units: float | Tensor | None = None) -> Tensor:
    """Σ m x / Σ m → 0-d. token_losses: (B, T); loss_mask: (B, T) bool trained tokens;
    num_units: global token count (None = local Σ m)."""
    return masked_sum(token_losses, loss_mask) / _denominator(loss_mask.sum(), num_units, token_losses)


def _sequence_mean(per_sequence: Tensor, loss_mask: Tensor, num_units: float | Tensor | None) -> Tensor:
    has_tokens = loss_mask.any(dim=-1)
    return masked_sum(per_sequence, has_tokens) / _denominator(has_tokens.sum(), num_units, per_sequence)


def seq_mean_token_mean(
    token_losses: Tensor, loss_mask: Tensor, num_units: float | Tensor | None = None
) -> Tensor:
    """(1/B) Σ_i mean_{t∈M_i} x_{i,t} → 0-d. Arguments as in `token_mean`; num_units = global B."""
    lengths = loss_mask.sum(dim=-1).clamp_min(1).to(token_losses.dtype)
    per_sequence = torch.where(loss_mask, token_losses, torch.zeros_like(token_losses)).sum(dim=-1) / lengths
    return _sequence_mean(per_sequence, loss_mask, num_units)


def seq_mean_token_sum(
    token_losses: Tensor, loss_mask: Tensor, num_units: float | Tensor | None = None
) -> Tensor:
    """(1/B) Σ_i Σ_{t∈M_i} x_{i,t} → 0-d. Arguments as in `token_mean`; num_units = global B."""
    per_sequence = torch.where(loss_mask, token_losses, torch.zeros_like(token_losses)).sum(dim=-1)
    return _sequence_mean(per_sequence, loss_mask, num_units)


def seq_mean_token_sum_norm(
    token_losses: Tensor,
    loss_mask: Tensor,
    num_units: float | Tensor | None = None,
    normalizer: float | None = None,
) -> Tensor:
    """(1/B) Σ_i Σ_{t∈M_i} x_{i,t} / N → 0-d, N a constant (default T = token_losses.shape[-1]).

    Dr. GRPO's length-unbiased aggregation: a constant N (the generation budget) instead of |M_i|.
    Other arguments as in `seq_mean_token_sum`.
    """
    constant = float(token_losses.shape[-1]) if normalizer is None else float(normalizer)
    return seq_mean_token_sum(token_losses, loss_mask, num_units) / constant


LOSS_AGGREGATIONS = {
    "token-mean": token_mean,
    "seq-mean-token-mean": seq_mean_token_mean,
    "seq-mean-token-sum": seq_mean_token_sum,
    "seq-mean-token-sum-norm": seq_mean_token_sum_norm,
}
"""Aggregation functions by name; each is f(token_losses (B,T), loss_mask (B,T), num_units=None)."""
