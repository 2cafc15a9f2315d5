"""Per-token policy surrogates and the trajectory-balance loss.

* `clipped_surrogate` / `ppo_clip_token_loss`: PPO's clipped ratio objective with asymmetric
  bounds (clip-higher) and dual clip.
* `reinforce_token_loss`: −c_i · log π_θ, whose gradient is c_i ∇log π_θ (REINFORCE-style
  objectives with a detached per-trajectory or per-token coefficient, e.g. VCPO's w̄_i A_i).
* `ratio_token_loss`: −A · r with an unclipped ratio (M2PO's masked objective).
* `tba_vargrad_loss`: trajectory balance in the VarGrad form (TBA).

Every token-level function returns (B, T) losses; aggregation is aggregation.py's job. Log-ratios
are clamped to ±max_log_ratio before exp: an overflowing ratio would turn a zero gradient into
NaN (0 · inf in exp's backward). Tokens beyond the clamp get zero gradient.

Deliberately not here: IS weights (is_weights.py), masks of the stabilizers (stabilizers.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from vcpo.groups import GroupIndex, group_mean
from vcpo.is_weights import DEFAULT_MAX_LOG_RATIO


class ClippedSurrogate(NamedTuple):
    """token_loss: (B, T) per-token loss. is_clipped: (B, T) bool, tokens whose gradient a clip
    (PPO or dual) set to zero."""

    token_loss: Tensor
    is_clipped: Tensor


def clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    lower_bound: float | Tensor,
    upper_bound: float | Tensor,
    dual_clip: float | None = None,
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO,
) -> ClippedSurrogate:
    """−min(r A, clip(r, lo, hi) A), dual-clipped to ≤ −c A for A < 0 → (B, T).

    log_ratio: (B, T) log r (with grad), e.g. log π_θ − log π_old.
    advantages: (B, T) or broadcastable (B, 1) detached advantages.
    lower_bound, upper_bound: absolute ratio bounds lo < 1 < hi.
    dual_clip: c > 1 or None. References: Schulman et al. 2017 (PPO); Yu et al. 2025 (DAPO,
    clip-higher); Ye et al. 2020, "Mastering Complex Control in MOBA Games" (dual clip).
    """
    ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio).exp()
    advantages = advantages.detach().to(ratio.dtype)
    # PPO: L = −min(r A, clip(r, 1 − ε_low, 1 + ε_high) A) = max(−r A, −clip(r) A)
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(lower_bound, upper_bound))
    ratio_d = ratio.detach()
    is_clipped = ((advantages > 0) & (ratio_d > upper_bound)) | ((advantages < 0) & (ratio_d < lower_bound))
    if dual_clip is not None:
        # dual clip: for A < 0, L = min(L_ppo, −c A) bounds the loss of very large ratios.
        dual = torch.minimum(loss, -advantages * dual_clip)
        loss = torch.where(advantages < 0, dual, loss)
        is_clipped = is_clipped | ((advantages < 0) & (ratio_d > dual_clip))
    return ClippedSurrogate(loss, is_clipped)


def ppo_clip_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO,
) -> ClippedSurrogate:
    """PPO-clip on r = π_θ/π_old with bounds [1 − ε_low, 1 + ε_high] and dual clip c → (B, T).

    logprobs: (B, T) log π_θ (with grad). old_logprobs: (B, T) log π_old (detached).
    advantages: (B, T) or (B, 1). clip_low, clip_high: ε_low, ε_high. dual_clip: c or None.
    """
    log_ratio = logprobs - old_logprobs.detach()  # log r_t = log π_θ − log π_old
    return clipped_surrogate(log_ratio, advantages, 1.0 - clip_low, 1.0 + clip_high, dual_clip, max_log_ratio)


def reinforce_token_loss(logprobs: Tensor, coefficients: Tensor) -> Tensor:
    """−c · log π_θ → (B, T); gradient c ∇log π_θ.

    logprobs: (B, T) log π_θ (with grad). coefficients: (B, T) or (B, 1) detached, e.g. A_i or
    w̄_i A_i.
    """
    return -coefficients.detach().to(logprobs.dtype) * logprobs


def ratio_token_loss(
    log_ratio: Tensor, advantages: Tensor, max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
) -> Tensor:
    """−r A with r = exp(clamp(log r)) and no clipping → (B, T).

    log_ratio: (B, T) log r (with grad). advantages: (B, T) or (B, 1) detached.
    """
    ratio = log_ratio.clamp(-max_log_ratio, max_log_ratio).exp()
    return -advantages.detach().to(ratio.dtype) * ratio


class TrajectoryBalance(NamedTuple):
    """loss: 0-d VarGrad loss. log_partition: (B,) log Ẑ of each trajectory's group.
    residuals: (B,) log Ẑ + log π_θ(τ) − log π_ref(τ) − R/β (0 for invalid trajectories)."""

    loss: Tensor
    log_partition: Tensor
    residuals: Tensor


def tba_vargrad_loss(
    seq_logprobs: Tensor,
    seq_ref_logprobs: Tensor,
    rewards: Tensor,
    valid: Tensor,
    groups: GroupIndex,
    beta: float = 0.05,
    *,
    log_partition: Tensor | None = None,
    count: Tensor | float | None = None,
) -> TrajectoryBalance:
    """Trajectory balance with the VarGrad partition estimate → TrajectoryBalance.

    log Ẑ_g = mean_{k∈g} (R_k/β − log π_θ(τ_k) + log π_ref(τ_k));
    loss = mean_k (log Ẑ_g + log π_θ(τ_k) − log π_ref(τ_k) − R_k/β)².

    seq_logprobs: (B,) log π_θ(τ) = Σ_{t∈M} log π_θ (with grad). seq_ref_logprobs: (B,) the same
    under π_ref. rewards: (B,) R. valid: (B,) bool. groups: prompt groups. beta: reward temperature.
    log Ẑ is not detached; detaching it gives the same gradient because the residuals of a group
    sum to zero. That is what lets a learner split the minibatch: `log_partition` (B,) (detached, the
    log Ẑ of each trajectory's group computed on the whole minibatch) and `count` (the minibatch's valid
    trajectories) replace this call's own; the losses of the parts then sum to the whole one.
    The objective is valid for any sampling distribution, so no IS weights are needed.
    Reference: Bartoldson et al. 2025, "Trajectory Balance with Asynchrony: Decoupling Exploration
    and Learning for Fast, Scalable LLM Post-Training" (arXiv:2503.18929).
    """
    reward_term = rewards.to(seq_logprobs.dtype) / beta
    # δ_k = log π_θ(τ_k) − log π_ref(τ_k) − R_k / β
    delta = seq_logprobs - seq_ref_logprobs.detach().to(seq_logprobs.dtype) - reward_term.detach()
    delta = torch.where(valid, delta, torch.zeros_like(delta))
    if log_partition is None:  # log Ẑ_g = mean_g(R/β − log π_θ + log π_ref) = −mean_g(δ)
        log_partition = -group_mean(delta, valid, groups)[groups.index]
    else:
        log_partition = log_partition.detach().to(delta.dtype)
    residuals = torch.where(valid, log_partition + delta, torch.zeros_like(delta))
    if count is None:
        count = valid.sum()
    count = torch.as_tensor(count, device=residuals.device).clamp_min(1).to(residuals.dtype)
    return TrajectoryBalance((residuals * residuals).sum() / count, log_partition, residuals)
