"""Outcome advantages from scalar rewards: GRPO, RLOO, REINFORCE (batch mean), Dr. GRPO.

Every function takes rewards (B,), the batch's `GroupIndex` and a `valid` (B,) mask, and returns
per-trajectory advantages (B,). Invalid trajectories (non-finite inputs) are excluded from every
group statistic and get advantage 0. In a degenerate group (a singleton, or all rewards equal)
every group-relative advantage is exactly 0 — not "small because of rounding".

Deliberately not here: the off-policy optimal baseline (opob.py) and the token baseline (otb.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vcpo.groups import GroupIndex, degenerate_groups, group_count, group_mean, group_std, group_sum


def _finalize(advantages: Tensor, rewards: Tensor, valid: Tensor, groups: GroupIndex) -> Tensor:
    """Exact zeros for invalid trajectories and for members of degenerate groups."""
    is_degenerate = degenerate_groups(rewards, valid, groups)[groups.index]
    keep = valid & ~is_degenerate
    return torch.where(keep, advantages, torch.zeros_like(advantages))


def grpo_advantages(
    rewards: Tensor,
    groups: GroupIndex,
    valid: Tensor,
    eps: float = 1e-6,
    use_bessel_correction: bool = True,
) -> Tensor:
    """A_i = (R_i − mean_g) / (σ_g + ε) → (B,).

    rewards: (B,) scalar reward R_i per trajectory. groups: dense group of each trajectory.
    valid: (B,) bool, trajectories that count. eps: ε in the denominator.
    Reference: Shao et al. 2024, "DeepSeekMath" (GRPO), outcome supervision.
    """
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    mean = group_mean(rewards, valid, groups)
    std = group_std(rewards, valid, groups, use_bessel_correction)
    # A_i = (R_i − mean_g) / (σ_g + ε)
    advantages = (rewards - mean[groups.index]) / (std[groups.index] + eps)
    return _finalize(advantages, rewards, valid, groups)


def dr_grpo_advantages(rewards: Tensor, groups: GroupIndex, valid: Tensor) -> Tensor:
    """A_i = R_i − mean_g (no std normalisation) → (B,). Arguments as in `grpo_advantages`.

    Reference: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (Dr. GRPO removes the std division, which up-weights near-solved/unsolved prompts).
    """
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    # A_i = R_i − mean_g
    advantages = rewards - group_mean(rewards, valid, groups)[groups.index]
    return _finalize(advantages, rewards, valid, groups)


def rloo_advantages(rewards: Tensor, groups: GroupIndex, valid: Tensor) -> Tensor:
    """A_i = R_i − (Σ_{j∈g, j≠i} R_j) / (n_g − 1) → (B,). Arguments as in `grpo_advantages`.

    Reference: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs" (REINFORCE Leave-One-Out).
    """
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    total = group_sum(rewards, groups)[groups.index]
    count = group_count(valid, groups).to(rewards.dtype)[groups.index]
    # baseline_i = (S_g − R_i) / (n_g − 1); singletons (n_g = 1) are degenerate and zeroed below.
    leave_one_out_mean = (total - rewards) / (count - 1.0).clamp_min(1.0)
    return _finalize(rewards - leave_one_out_mean, rewards, valid, groups)


def reinforce_advantages(rewards: Tensor, valid: Tensor) -> Tensor:
    """A_i = R_i − (1/B) Σ_j R_j with the batch-mean baseline over valid trajectories → (B,).

    rewards: (B,) scalar rewards. valid: (B,) bool. Groups play no role; if every valid reward is
    equal the advantages are exactly 0.
    Reference: Williams 1992, "Simple statistical gradient-following algorithms" (REINFORCE).
    """
    groups = GroupIndex(torch.zeros_like(rewards, dtype=torch.long), 1)
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards))
    # A_i = R_i − mean_batch(R)
    advantages = rewards - group_mean(rewards, valid, groups)[groups.index]
    return _finalize(advantages, rewards, valid, groups)
