"""Optimal token baseline (OTB): a per-token variance-minimising baseline from forward passes only.

Reference: Li, Xu, Li, Liu, et al. 2026, "The Optimal Token Baseline: Variance Reduction for
Long-Horizon LLM-RL" (arXiv:2602.07078); reference implementation in verl
(`compute_optimal_token_baseline_advantage` and its OTB page).

Definition used here (exactly that of the reference implementation, aligned by generated-token
index so that multi-turn trajectories with interleaved tool tokens line up):

1. Logit-gradient proxy. For a softmax policy the gradient of log π(y_t) with respect to the
   logits is e_y − p, so its squared norm is the per-token "energy"

       e_t = ‖e_{y_t} − p_t‖² = 1 − 2 p_t(y_t) + Σ_v p_t(v)²,

   computed from the forward pass (Σ_v p² = exp(logsumexp(2z) − 2 logsumexp(z))).
2. Realized energy: W_{i,k} = Σ_{j≤k} e_{i,j} (· w̄_i² with importance weights), the cumulative
   energy of trajectory i up to its k-th generated token — the proxy for ‖Σ_{j≤k} ∇log π_j‖².
3. Per-token optimal baseline, per prompt group g and generated-token index k, over the group's
   trajectories that have a k-th token:

       B*_{g,k} = Σ_i G_{i,k} W_{i,k} / Σ_i W_{i,k}

   with G_{i,k} the return-to-go (the outcome reward R_i for outcome rewards). If Σ_i W_{i,k} = 0
   the baseline falls back to the plain mean of G over those trajectories (reported).
4. Advantage A_{i,k} = G_{i,k} − B*_{g(i),k} (no std normalisation).

With importance weights the IS factor appears once in each place, as in OPOB: w̄_i² inside W
(the reference's "scale W by ρ̄²") and w̄_i once in the loss.
Not implemented: the reference's optional `handle_zero_tail` (zeroing the baseline where only the
longest trajectory of a group is still generating); here B* = G there, i.e. advantage 0.

Deliberately not here: the policy loss that consumes the advantages (objectives/weighted.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from vcpo.groups import GroupIndex


class TokenBaseline(NamedTuple):
    """baseline: (B, T) fp32 B*_{g(i),k(t)} on trained tokens, 0 elsewhere.
    is_fallback: (B, T) bool, tokens whose (group, index) cell had zero total energy."""

    baseline: Tensor
    is_fallback: Tensor


def sum_probs_squared_from_logits(logits: Tensor) -> Tensor:
    """Σ_v π(v)² per position from logits (B, T, V) → (B, T) fp32, no grad.

    Σ_v p_v² = Σ_v exp(2 z_v − 2 logsumexp(z)) = exp(logsumexp(2z) − 2 logsumexp(z)).
    """
    logits = logits.detach().float()
    return (torch.logsumexp(2.0 * logits, dim=-1) - 2.0 * torch.logsumexp(logits, dim=-1)).exp()


def logit_gradient_energy(logprobs: Tensor, sum_probs_squared: Tensor, loss_mask: Tensor) -> Tensor:
    """e_t = ‖e_{y_t} − p_t‖² = 1 − 2 p_t(y_t) + Σ_v p_t(v)² → (B, T) fp32, 0 off the mask.

    logprobs: (B, T) log p_t(y_t) of the sampled token under the policy whose probabilities gave
        `sum_probs_squared` (the proximal policy π_old). sum_probs_squared: (B, T) Σ_v p_t(v)².
    loss_mask: (B, T) bool generated positions.
    """
    p = logprobs.detach().float().exp()
    # OTB logit-gradient proxy: ‖e_y − p‖² = 1 − 2 p_y + Σ_v p_v²  (≥ 0; clamp removes rounding)
    energy = (1.0 - 2.0 * p + sum_probs_squared.detach().float()).clamp_min(0.0)
    return torch.where(loss_mask, energy, torch.zeros_like(energy))


def realized_energy(energy: Tensor, loss_mask: Tensor, is_weights: Tensor | None = None) -> Tensor:
    """W_{i,t} = w̄_i² Σ_{j≤t, j∈M_i} e_{i,j} → (B, T) fp32, 0 off the mask.

    energy: (B, T) e_t from `logit_gradient_energy`. loss_mask: (B, T) bool.
    is_weights: (B,) w̄_i, or None for on-policy OTB.
    """
    cumulative = torch.where(loss_mask, energy, torch.zeros_like(energy)).cumsum(dim=-1)
    if is_weights is not None:
        w = is_weights.detach().float()
        cumulative = cumulative * (w * w)[:, None]  # the IS factor's single appearance in the baseline
    return torch.where(loss_mask, cumulative, torch.zeros_like(cumulative))


def optimal_token_baseline(
    returns: Tensor, realized: Tensor, loss_mask: Tensor, groups: GroupIndex
) -> TokenBaseline:
    """B*_{g,k} = Σ_i G_{i,k} W_{i,k} / Σ_i W_{i,k} per group and generated-token index k.

    returns: (B, T) return-to-go G on trained tokens (R_i broadcast for outcome rewards).
    realized: (B, T) W from `realized_energy`. loss_mask: (B, T) bool trained tokens (invalid
        trajectories must already be masked out). groups: the prompt groups.
    Vectorised: every trained token is scattered into cell (g, k) of a flat (G·K) table.
    """
    mask = loss_mask
    token_index = mask.long().cumsum(dim=-1) - 1  # k: 0-based index among the trajectory's generated tokens
    num_slots = max(int(mask.shape[-1]), 1)
    cell = (groups.index[:, None] * num_slots + token_index.clamp_min(0))[mask]
    num_cells = groups.num_groups * num_slots
    g_values = returns.detach().double()[mask]
    w_values = realized.detach().double()[mask]

    def cell_sum(values: Tensor) -> Tensor:
        return torch.zeros(num_cells, dtype=torch.float64, device=values.device).index_add_(0, cell, values)

    weighted, total, plain, count = (
        cell_sum(g_values * w_values),
        cell_sum(w_values),
        cell_sum(g_values),
        cell_sum(torch.ones_like(g_values)),
    )
    # B*_{g,k} = Σ_i G_{i,k} W_{i,k} / Σ_i W_{i,k}; fallback: mean of G in the cell.
    optimal = weighted / torch.where(total > 0, total, torch.ones_like(total))
    per_cell = torch.where(total > 0, optimal, plain / count.clamp_min(1.0))
    baseline = torch.zeros_like(returns, dtype=torch.float32)
    baseline[mask] = per_cell[cell].float()
    is_fallback = torch.zeros_like(mask)
    is_fallback[mask] = total[cell] <= 0
    return TokenBaseline(baseline, is_fallback)


def otb_advantages(returns: Tensor, baseline: Tensor, loss_mask: Tensor) -> Tensor:
    """A_{i,t} = (G_{i,t} − B*_{g(i),k(t)}) on trained tokens, 0 elsewhere → (B, T) fp32.

    returns: (B, T) G. baseline: (B, T) from `optimal_token_baseline`. loss_mask: (B, T) bool.
    """
    advantages = returns.float() - baseline.float()
    return torch.where(loss_mask, advantages, torch.zeros_like(advantages))
