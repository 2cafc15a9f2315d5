"""Masking / clipping stabilizers for stale data: M2PO's second-moment mask, BAPO's bounds. (MIS's band
and weights are the correction stages', vcpo/corrections.py.)

* M2PO: per minibatch, mask the tokens with the largest (log r)² until the mean of (log r)² over
  the kept tokens is ≤ τ. Reference: Zheng, Zhao, Chen 2025, "Prosperity before Collapse: How Far
  Can Off-Policy RL Reach with Stale Data on LLMs?" (arXiv:2510.01161).
* BAPO: per batch, move the PPO ratio bounds up in small steps until positive-advantage tokens
  contribute at least ρ0 of the gradient-carrying objective. Reference: Xi et al. 2025, "BAPO:
  Stabilizing Off-Policy RL for LLMs via Balanced Policy Optimization with Adaptive Clipping"
  (arXiv:2510.18927).

All three are vectorised (sorting + cumulative sums), with no Python loop over tokens or bounds and
no device sync. Deliberately not here: the surrogate these masks and bounds feed (policy_losses.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor


class SecondMomentMask(NamedTuple):
    """kept: (B, T) bool tokens M2PO keeps. second_moment: 0-d mean (log r)² over all trained
    tokens before masking. kept_second_moment: 0-d the same over kept tokens (≤ τ)."""

    kept: Tensor
    second_moment: Tensor
    kept_second_moment: Tensor


def m2po_mask(log_ratio: Tensor, loss_mask: Tensor, tau: float = 0.04) -> SecondMomentMask:
    """Keep the largest set of tokens, smallest (log r)² first, whose mean (log r)² is ≤ τ.

    log_ratio: (B, T) log r_t = log π_θ − log μ (detached inside). loss_mask: (B, T) bool trained
    tokens of the whole minibatch. tau: τ (M2PO default 0.04).
    Masking the largest (log r)² one at a time until the mean is ≤ τ keeps a prefix of the values
    sorted ascending; the prefix means are non-decreasing, so the kept count is the number of
    prefixes with mean ≤ τ (sort + cumulative mean, no loop).
    """
    squared = log_ratio.detach().float().square()
    flat_sq = torch.where(loss_mask, squared, torch.full_like(squared, torch.inf)).flatten()
    sorted_sq, order = torch.sort(flat_sq)
    prefix_len = torch.arange(1, flat_sq.numel() + 1, device=flat_sq.device, dtype=torch.float32)
    finite_sorted = torch.where(torch.isfinite(sorted_sq), sorted_sq, torch.zeros_like(sorted_sq))
    prefix_mean = torch.where(torch.isfinite(sorted_sq), finite_sorted.cumsum(0) / prefix_len, sorted_sq)
    # M2PO: M̂2 = mean over kept tokens of (log r_t)² ≤ τ
    keep_count = (prefix_mean <= tau).sum()
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    kept = loss_mask & (rank.view_as(loss_mask) < keep_count)
    trained = loss_mask.sum().clamp_min(1)
    masked_sq = torch.where(loss_mask, squared, torch.zeros_like(squared))
    kept_sq = torch.where(kept, squared, torch.zeros_like(squared))
    return SecondMomentMask(kept, masked_sq.sum() / trained, kept_sq.sum() / kept.sum().clamp_min(1))


class BapoBounds(NamedTuple):
    """lower_bound, upper_bound: 0-d absolute ratio bounds (c_low, c_high) chosen for the batch.
    positive_fraction: 0-d ρ, the positive tokens' share at those bounds."""

    lower_bound: Tensor
    upper_bound: Tensor
    positive_fraction: Tensor


def bapo_candidate_bounds(
    clip_low_range: tuple[float, float] = (0.6, 0.9),
    clip_high_range: tuple[float, float] = (1.2, 3.0),
    step: float = 0.05,
) -> tuple[Tensor, Tensor]:
    """The sequence of (c_low, c_high) BAPO visits: raise c_high by `step` up to its maximum, then
    raise c_low by `step` up to its maximum (BAPO Algorithm 1). → two (K,) fp32 tensors."""
    (low_start, low_max), (high_start, high_max) = clip_low_range, clip_high_range
    high_steps = math.floor((high_max - high_start) / step + 1e-9)
    low_steps = math.floor((low_max - low_start) / step + 1e-9)
    highs = [high_start + j * step for j in range(high_steps + 1)] + [
        high_start + high_steps * step
    ] * low_steps
    lows = [low_start] * (high_steps + 1) + [low_start + j * step for j in range(1, low_steps + 1)]
    return torch.tensor(lows, dtype=torch.float32), torch.tensor(highs, dtype=torch.float32)


def _sorted_contributions(
    ratio: Tensor, contribution: Tensor, include: Tensor, fill: float
) -> tuple[Tensor, Tensor]:
    """Ratios sorted ascending (`fill` where not included) and the cumulative contribution (0 prepended)."""
    keys = torch.where(include, ratio, torch.full_like(ratio, fill)).flatten()
    sorted_keys, order = torch.sort(keys)
    values = torch.where(include, contribution, torch.zeros_like(contribution)).flatten()[order]
    return sorted_keys, torch.cat([values.new_zeros(1), values.cumsum(0)])


def bapo_bounds(
    ratio: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    clip_low_range: tuple[float, float] = (0.6, 0.9),
    clip_high_range: tuple[float, float] = (1.2, 3.0),
    step: float = 0.05,
    positive_fraction: float = 0.5,
) -> BapoBounds:
    """BAPO's adaptive bounds: the first candidate (c_low, c_high) with ρ ≥ ρ0, else the widest.

    ρ(c_low, c_high) = S⁺ / (S⁺ + S⁻), the positive-advantage tokens' share of the gradient-carrying
    objective: S⁺ = Σ_{A>0, r<c_high} r·A, S⁻ = Σ_{A<0, r>c_low} r·|A| (a token outside its bound
    is clipped and carries no gradient). Raising c_high admits more positive tokens, raising
    c_low clips more negative ones; both raise ρ. ρ = 1 when no token carries negative gradient.

    ratio: (B, T) r_t (detached inside). advantages: (B, T) or (B, 1). loss_mask: (B, T) bool.
    clip_low_range, clip_high_range: (start, max) of each bound. step: increment. positive_fraction: ρ0.
    """
    ratio = ratio.detach().float()
    advantages = advantages.detach().float().expand_as(ratio)
    magnitude = ratio * advantages.abs()
    lows, highs = (
        bounds.to(ratio.device) for bounds in bapo_candidate_bounds(clip_low_range, clip_high_range, step)
    )
    pos_keys, pos_cumsum = _sorted_contributions(ratio, magnitude, loss_mask & (advantages > 0), torch.inf)
    neg_keys, neg_cumsum = _sorted_contributions(ratio, magnitude, loss_mask & (advantages < 0), -torch.inf)
    # S⁺(c_high) = Σ over positive tokens with r < c_high; S⁻(c_low) = Σ over negative tokens with r > c_low
    positive = pos_cumsum[torch.searchsorted(pos_keys, highs, side="left")]
    negative = neg_cumsum[-1] - neg_cumsum[torch.searchsorted(neg_keys, lows, side="right")]
    total = positive + negative
    share = torch.where(
        negative > 0, positive / total.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(total)
    )
    satisfied = share >= positive_fraction
    index = torch.where(
        satisfied.any(), satisfied.float().argmax(), torch.tensor(len(lows) - 1, device=ratio.device)
    )
    return BapoBounds(lows[index], highs[index], share[index])
