"""GSPO: the clip on the sequence-level ratio (π_θ/μ)^(1/|M|)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vcpo.objectives.base import ADVANTAGES, BatchContext, ObjectiveBase, PreparedBatch, Surrogate
from vcpo.objectives.clipped import RatioToOptions, ratio_denominator
from vcpo.policy_losses import clipped_surrogate


@dataclass(frozen=True)
class GSPO(RatioToOptions, ObjectiveBase):
    """GSPO: the PPO clip on the length-normalised *sequence* ratio, one decision per trajectory.

    s_i = exp((1/|M_i|) Σ_{t∈M_i} log π_θ(y_t) − log ν(y_t)) with ν = μ (`ratio_to='behavior'`) or π_old
    ('proximal'); loss_i = −min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i) with GRPO's A_i, the
    gradient flowing through s_i; every token of trajectory i carries loss_i, so the default
    seq-mean-token-mean aggregation gives (1/B) Σ_i loss_i, the paper's objective. A trajectory whose
    clipped branch is the minimum (A > 0 and s > 1 + ε_high, or A < 0 and s < 1 − ε_low) contributes no
    gradient; `pg/clip_frac` counts its tokens and `gspo/seq_clip_frac` the trajectories.
    clip_low, clip_high: ε (the paper's 3e-4 and 4e-4). Reference: Zheng et al. 2025, "Group Sequence
    Policy Optimization" (arXiv:2507.18071).
    """

    name: ClassVar[str] = "gspo"
    silent_degenerate_groups: ClassVar[bool] = True
    loss_aggregation: str = "seq-mean-token-mean"
    clip_low: float = 3e-4
    clip_high: float = 4e-4
    ratio_to: str = "behavior"

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        mask = batch.loss_mask
        token_log_ratio = torch.where(mask, batch.logprobs - ratio_denominator(batch, self.ratio_to), 0.0)
        lengths = mask.sum(dim=-1).clamp_min(1).to(token_log_ratio.dtype)
        seq_log_ratio = token_log_ratio.sum(dim=-1) / lengths  # log s_i, gradient through π_θ
        advantages = context.rows[ADVANTAGES]
        clip = clipped_surrogate(
            seq_log_ratio[:, None],
            advantages[:, None],
            1.0 - self.clip_low,
            1.0 + self.clip_high,
            None,
            self.max_log_ratio,
        )
        token_loss = clip.token_loss.expand(mask.shape)  # loss_i on each of its tokens
        loss = self.aggregate(self.weighted(token_loss, batch), mask, context)
        clipped_seq = clip.is_clipped[:, 0] & batch.valid & mask.any(dim=-1)
        present = (batch.valid & mask.any(dim=-1)).sum().clamp_min(1)
        seq_ratio = seq_log_ratio.detach().clamp(-self.max_log_ratio, self.max_log_ratio).exp()
        metrics = {
            "gspo/seq_clip_frac": clipped_seq.sum().float() / present.float(),
            "gspo/seq_ratio_mean": _masked_seq_mean(seq_ratio, batch.valid),
        }
        return Surrogate(loss, advantages, clipped=clipped_seq[:, None] & mask, metrics=metrics)


def _masked_seq_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, values, torch.zeros_like(values)).sum() / valid.sum().clamp_min(1)

