"""CISPO: the clipped per-token ratio as a detached weight; no token is dropped."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vcpo.objectives.base import ADVANTAGES, BatchContext, ObjectiveBase, PreparedBatch, Surrogate
from vcpo.objectives.clipped import RatioToOptions, ratio_denominator
from vcpo.policy_losses import reinforce_token_loss


@dataclass(frozen=True)
class CISPO(RatioToOptions, ObjectiveBase):
    """CISPO: REINFORCE with a clipped, detached token IS weight — every token keeps its gradient.

    loss_t = −sg[clip(r_t, 1 − ε_low, 1 + ε_high)] · A_i · log π_θ(y_t), r_t = π_θ(y_t)/ν(y_t) with ν = μ
    (`ratio_to='behavior'`) or π_old ('proximal'), GRPO's A_i, token-mean aggregation (as MiniMax-M1).
    Unlike the PPO clip, a token outside the range is not dropped: its weight is held at the bound
    (`pg/clip_frac` counts those tokens; `cispo/weight_mean` is the mean weight). clip_low: ε_low, default
    1.0 — a lower bound of 0, i.e. none (r > 0): M1 imposed no lower bound "by setting ε_low to a large
    value" and tuned only ε_high. clip_high: ε_high, default 0.28 (DAPO's clip-higher, the usual CISPO
    default; M1's own tuned value is not used here). Reference: MiniMax 2025, "MiniMax-M1: Scaling
    Test-Time Compute Efficiently with Lightning Attention" (arXiv:2506.13585), §3.1.
    """

    name: ClassVar[str] = "cispo"
    allow_zero_bound: ClassVar[bool] = True
    silent_degenerate_groups: ClassVar[bool] = True
    clip_low: float = 1.0
    clip_high: float = 0.28
    ratio_to: str = "behavior"

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        mask = batch.loss_mask
        log_ratio = (batch.logprobs.detach() - ratio_denominator(batch, self.ratio_to)).clamp(
            -self.max_log_ratio, self.max_log_ratio
        )
        ratio = torch.where(mask, log_ratio.exp(), torch.zeros_like(log_ratio))
        lower, upper = 1.0 - self.clip_low, 1.0 + self.clip_high
        weights = ratio.clamp(lower, upper)  # detached: the IS weight changes the measure, not the loss
        advantages = context.rows[ADVANTAGES]
        token_loss = reinforce_token_loss(batch.logprobs, weights * advantages[:, None])
        loss = self.aggregate(self.weighted(token_loss, batch), mask, context)
        clipped = mask & ((ratio > upper) | (ratio < lower))
        weight_mean = torch.where(mask, weights, 0.0).sum() / mask.sum().clamp_min(1)
        return Surrogate(loss, advantages, clipped=clipped, metrics={"cispo/weight_mean": weight_mean})

