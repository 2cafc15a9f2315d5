"""Importance weights between the learner's policy and the engine's behaviour policy μ.

Notation of docs/algorithm.md: ℓ_{i,t} = log π(y_t|y_<t) − log μ_t on the model-generated positions M_i
(`loss_mask`), L_i = Σ_{t∈M_i} ℓ_{i,t}, w_i = exp(L_i), w̄_i = min(w_i, C). Which π is used is the
caller's choice; the objectives pass the proximal policy π_old (the learner's recomputed logprobs at
the start of the step), which is π_θ at the moment the step's gradient is taken.

All weights are computed in fp32 with L clamped to [−max_log_ratio, max_log_ratio] before `exp`,
so they are always finite (e^20 ≈ 4.9e8; its square still fits fp32 with room for sums).
ESS works on log-weights shifted by their maximum, which is exact and cannot overflow.

Deliberately not here: any use of the weights in a loss (objectives/) or in a step size
(step_size.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

DEFAULT_MAX_LOG_RATIO = 20.0
"""Clamp of log-ratios before exp: |L| ≤ 20 keeps w, w² and their batch sums finite in fp32."""


def token_log_ratios(logprobs: Tensor, behavior_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """ℓ_{i,t} = log π_t − log μ_t on generated tokens, 0 elsewhere (fp32, no grad).

    logprobs: (B, T) log π of the sampled tokens (detached inside).
    behavior_logprobs: (B, T) log μ the engine reported for the sampled tokens.
    loss_mask: (B, T) bool, True on the positions M_i the model generated.
    """
    # docs/algorithm.md: ℓ_{i,t} = log π_θ(y_t | y_<t) − log μ_t, only for t ∈ M_i.
    diff = logprobs.detach().float() - behavior_logprobs.detach().float()
    return torch.where(loss_mask, diff, torch.zeros_like(diff))


def sequence_log_ratios(logprobs: Tensor, behavior_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
    """L_i = Σ_{t∈M_i} ℓ_{i,t} → (B,) fp32 (unclamped; non-finite if an input is).

    Arguments as in `token_log_ratios`.
    """
    # docs/algorithm.md: L_i = Σ_{t∈M_i} ℓ_{i,t}.
    return token_log_ratios(logprobs, behavior_logprobs, loss_mask).sum(dim=-1)


def clamp_log_ratios(log_ratios: Tensor, max_log_ratio: float = DEFAULT_MAX_LOG_RATIO) -> Tensor:
    """Clamp log-ratios (any shape) to [−max_log_ratio, max_log_ratio] so that exp stays finite."""
    return log_ratios.clamp(-max_log_ratio, max_log_ratio)


def sequence_is_weights(seq_log_ratios: Tensor, max_log_ratio: float = DEFAULT_MAX_LOG_RATIO) -> Tensor:
    """w_i = exp(clamp(L_i)) → (B,) fp32.

    seq_log_ratios: (B,) L_i from `sequence_log_ratios`.
    """
    # docs/algorithm.md: w_i = exp(L_i), fp32, L_i clamped to a safe range before exp.
    return clamp_log_ratios(seq_log_ratios.float(), max_log_ratio).exp()


def truncated_is_weights(is_weights: Tensor, cap: float = 8.0) -> Tensor:
    """w̄ = min(w, C) (any shape). is_weights: IS weights ≥ 0; cap: C (docs/algorithm.md default 8)."""
    # docs/algorithm.md: w̄_i = min(w_i, C).
    return is_weights.clamp(max=cap)


def effective_sample_size(log_weights: Tensor, valid: Tensor | None = None) -> Tensor:
    """ESS = (Σ_i w_i)² / Σ_i w_i² over the valid entries, from log-weights → 0-d fp32.

    log_weights: (B,) log w_i (e.g. L_i, or log w̄_i = min(L_i, log C)); any finite values.
    valid: (B,) bool, entries that count; None = all. ESS is 0 when nothing is valid.
    The ratio is invariant to scaling all w by a constant, so we shift by max log w: every shifted
    weight is in (0, 1], the largest is exactly 1, and nothing overflows (exact, not approximate).
    """
    log_weights = log_weights.detach().float()
    if valid is None:
        valid = torch.ones_like(log_weights, dtype=torch.bool)
    very_negative = torch.full_like(log_weights, -torch.inf)
    masked = torch.where(valid, log_weights, very_negative)
    shift = masked.max() if masked.numel() > 0 else torch.zeros((), device=log_weights.device)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    scaled = torch.where(valid, (masked - shift).exp(), torch.zeros_like(log_weights))
    # docs/algorithm.md: ESS = (Σ_i w_i)² / Σ_i w_i²
    total = scaled.sum()
    total_sq = (scaled * scaled).sum()
    return torch.where(
        total_sq > 0, total * total / total_sq.clamp_min(torch.finfo(torch.float32).tiny), total_sq
    )


def ess_ratio(log_weights: Tensor, valid: Tensor | None = None) -> Tensor:
    """ρ = ESS / B ∈ (0, 1] over the valid entries → 0-d fp32 (0 when nothing is valid).

    log_weights: (B,) log w_i; valid: (B,) bool or None (all).
    """
    count = log_weights.numel() if valid is None else valid.sum()
    count = torch.as_tensor(count, dtype=torch.float32, device=log_weights.device)
    # docs/algorithm.md: ρ = ESS / B
    return effective_sample_size(log_weights, valid) / count.clamp_min(1.0)
