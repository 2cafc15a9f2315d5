"""The optimal token baseline (OTB) objective."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vcpo.objectives.base import ADVANTAGES, BatchContext, ObjectiveBase, PreparedBatch, Surrogate
from vcpo.objectives.weighted import (
    FALLBACKS,
    SequenceTisOptions,
    Statistics,
    truncated_weights,
    weighted_loglik_loss,
)
from vcpo.otb import logit_gradient_energy, optimal_token_baseline, otb_advantages, realized_energy


@dataclass(frozen=True)
class OTB(SequenceTisOptions, ObjectiveBase):
    """Optimal token baseline (otb.py): −w̄_i (R_i − B*_{g,k}) log π_θ per token.

    Needs `sum_probs_squared` (Σ_v π_old(v)² per position, from the same forward as old_logprobs).
    use_is_weights: w̄_i once in the loss and w̄_i² once in the realized energy (False = on-policy
    OTB). is_cap: C of w̄. No std normalisation (as in the reference).
    Reference: Li et al. 2026, "The Optimal Token Baseline" (arXiv:2602.07078).
    """

    name: ClassVar[str] = "otb"
    uses_sum_probs_squared: ClassVar[bool] = True
    loss_aggregation: str = "seq-mean-token-mean"
    use_is_weights: bool = True

    @property
    def accepts_token_weights(self) -> bool:
        return not self.use_is_weights  # w̄_i is a behaviour correction of its own

    def _statistics(self, batch: PreparedBatch) -> Statistics:
        mask = batch.loss_mask
        truncated = truncated_weights(self, batch, self.is_cap) if self.use_is_weights else None
        energy = logit_gradient_energy(batch.old_logprobs, batch.sum_probs_squared, mask)
        realized = realized_energy(energy, mask, truncated)
        returns = batch.rewards[:, None].expand(mask.shape)  # outcome reward: G_{i,t} = R_i
        token_baseline = optimal_token_baseline(returns, realized, mask, batch.groups)
        keep = (batch.valid & ~batch.is_degenerate)[:, None]
        advantages = torch.where(keep, otb_advantages(returns, token_baseline.baseline, mask), 0.0)
        return {ADVANTAGES: advantages}, {FALLBACKS: (token_baseline.is_fallback & mask).sum()}

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        truncated = truncated_weights(self, batch, self.is_cap) if self.use_is_weights else None
        advantages = context.rows[ADVANTAGES]  # (B, T): B*_{g,k} pools the group's k-th tokens
        coefficients = advantages if truncated is None else truncated[:, None] * advantages
        loss = weighted_loglik_loss(self, batch, coefficients, context)
        return Surrogate(loss, advantages, baseline_fallbacks=context.shared[FALLBACKS])

