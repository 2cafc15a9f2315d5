"""REINFORCE-family objectives: loss −c · log π_θ with a detached coefficient c per trajectory/token.

| name      | coefficient c                                     | ratio                              |
| --------- | ------------------------------------------------- | ---------------------------------- |
| reinforce | R_i − mean_batch                                  | none (on-policy)                   |
| rloo      | R_i − mean of the other G−1 rewards of the group  | none (on-policy)                   |
| seq_tis   | w̄_i (R_i − mean_g)/(σ_g + ε)                      | w̄_i = min(π_old(τ)/μ(τ), C)       |
| vcpo      | w̄_i (R_i − b*_g)/(σ_g + ε), b* the OPOB           | w̄_i = min(π_old(τ)/μ(τ), C)       |
| otb       | w̄_i (R_i − B*_{g,k}) per token, B* the OTB        | w̄_i = min(π_old(τ)/μ(τ), C) or none |

The gradient is c ∇log π_θ; with the default aggregation seq-mean-token-mean the loss is
−(1/B) Σ_i c_i ℓ_i with ℓ_i the mean log π_θ over M_i, docs/algorithm.md's ĝ. There is no ratio to π_old:
these objectives take one optimizer step per minibatch (the asynchronous setting), where
π_θ = π_old at the forward pass, so the whole behaviour correction is the sequence weight π_old/μ.
seq_tis and vcpo differ only in the baseline, which makes the ablations exact:
"ESS lr only" = seq_tis + `EssLr`, "OPOB only" = vcpo + `ConstantLr`, VCPO = vcpo + `EssLr`.

This module holds the family's shared parts and its plain members (reinforce, rloo); seq_tis, vcpo and
otb have a module each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from vcpo.advantages import reinforce_advantages, rloo_advantages
from vcpo.is_weights import sequence_is_weights, truncated_is_weights
from vcpo.objectives.base import ADVANTAGES, BatchContext, ObjectiveBase, PreparedBatch, Surrogate
from vcpo.policy_losses import reinforce_token_loss

Statistics = tuple[dict[str, Tensor], dict[str, Tensor]]
"""(rows, shared) of a `BatchContext`."""


def weighted_loglik_loss(
    objective: ObjectiveBase, batch: PreparedBatch, coefficients: Tensor, context: BatchContext
) -> Tensor:
    """aggregate(−c · log π_θ); coefficients (B,) per trajectory or (B, T) per token."""
    coefficients = coefficients[:, None] if coefficients.dim() == 1 else coefficients
    token_loss = objective.weighted(reinforce_token_loss(batch.logprobs, coefficients), batch)
    return objective.aggregate(token_loss, batch.loss_mask, context)


def truncated_weights(objective: ObjectiveBase, batch: PreparedBatch, cap: float) -> Tensor:
    """w̄_i = min(exp(clamp(L_i)), C), L_i = Σ log π_old − log μ → (B,) fp32."""
    return truncated_is_weights(sequence_is_weights(batch.seq_log_ratios, objective.max_log_ratio), cap)


@dataclass(frozen=True)
class SequenceTisOptions:
    """The sequence-level truncated IS weight w̄_i = min(w_i, is_cap) (docs/algorithm.md: C = 8).

    is_cap also sets C of the is/ess_ratio_clipped metric.
    """

    is_cap: float = 8.0

    def _check_options(self) -> list[str]:
        return [f"is_cap={self.is_cap} must be > 0"] if self.is_cap <= 0 else []

    @property
    def ess_clip_cap(self) -> float:
        return self.is_cap


@dataclass(frozen=True)
class Reinforce(ObjectiveBase):
    """REINFORCE with the batch-mean baseline, no clipping, no ratio: loss −(R_i − mean_B) log π_θ."""

    name: ClassVar[str] = "reinforce"
    takes_token_weights: ClassVar[bool] = True
    loss_aggregation: str = "seq-mean-token-mean"

    def _statistics(self, batch: PreparedBatch) -> Statistics:
        return {ADVANTAGES: reinforce_advantages(batch.rewards, batch.valid)}, {}  # the minibatch's mean

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        advantages = context.rows[ADVANTAGES]
        return Surrogate(weighted_loglik_loss(self, batch, advantages, context), advantages)


@dataclass(frozen=True)
class RLOO(ObjectiveBase):
    """RLOO: REINFORCE with the leave-one-out group baseline, no clipping, no ratio.

    Reference: Ahmadian et al. 2024, "Back to Basics" (REINFORCE Leave-One-Out).
    """

    name: ClassVar[str] = "rloo"
    silent_degenerate_groups: ClassVar[bool] = True
    takes_token_weights: ClassVar[bool] = True
    loss_aggregation: str = "seq-mean-token-mean"

    def _statistics(self, batch: PreparedBatch) -> Statistics:
        return {ADVANTAGES: rloo_advantages(batch.rewards, batch.groups, batch.valid)}, {}

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        advantages = context.rows[ADVANTAGES]
        return Surrogate(weighted_loglik_loss(self, batch, advantages, context), advantages)


FALLBACKS, NONFINITE_NORMS = "baseline_fallbacks", "nonfinite_grad_norms"
"""`BatchContext.shared` keys of the counts VCPO and OTB report in `LossCounts` (not metrics)."""


