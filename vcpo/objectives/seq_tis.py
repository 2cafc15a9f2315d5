"""Sequence TIS: the weighted log-likelihood, the truncated sequence weight, the group-mean baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vcpo.advantages import grpo_advantages
from vcpo.objectives.base import ADVANTAGES, BatchContext, ObjectiveBase, PreparedBatch, Surrogate
from vcpo.objectives.weighted import SequenceTisOptions, Statistics, truncated_weights, weighted_loglik_loss


@dataclass(frozen=True)
class SeqTIS(SequenceTisOptions, ObjectiveBase):
    """Sequence TIS: −w̄_i (R_i − mean_g)/(σ_g + ε) · ℓ_i with w̄_i = min(w_i, C), w_i = π_old(τ_i)/μ(τ_i).

    is_cap: C (docs/algorithm.md default 8). This is VCPO's estimator with the group-mean baseline.
    """

    name: ClassVar[str] = "seq_tis"
    silent_degenerate_groups: ClassVar[bool] = True
    loss_aggregation: str = "seq-mean-token-mean"

    def _statistics(self, batch: PreparedBatch) -> Statistics:
        return {ADVANTAGES: grpo_advantages(batch.rewards, batch.groups, batch.valid)}, {}

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        truncated = truncated_weights(self, batch, self.is_cap)  # per trajectory: needs no other row
        advantages = context.rows[ADVANTAGES]
        return Surrogate(weighted_loglik_loss(self, batch, truncated * advantages, context), advantages)

