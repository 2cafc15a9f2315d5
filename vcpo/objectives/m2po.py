"""M2PO: the ratio to μ, unclipped, under a second-moment token mask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vcpo.objectives.base import ADVANTAGES, BatchContext, ObjectiveBase, PreparedBatch, Surrogate
from vcpo.objectives.clipped import grpo_rows
from vcpo.policy_losses import ratio_token_loss
from vcpo.stabilizers import m2po_mask


@dataclass(frozen=True)
class M2PO(ObjectiveBase):
    """M2PO: GRPO advantages, loss −M_t r_t A_i with r_t = π_θ/μ unclipped, M the second-moment mask.

    The mask drops the tokens with the largest (log r_t)² of the minibatch until the mean over kept
    tokens is ≤ τ. tau: τ (default 0.04). Reference: Zheng, Zhao, Chen 2025 (arXiv:2510.01161).
    """

    name: ClassVar[str] = "m2po"
    silent_degenerate_groups: ClassVar[bool] = True
    tau: float = 0.04

    def _check_options(self) -> list[str]:
        return [f"tau={self.tau} must be > 0"] if self.tau <= 0 else []

    def _statistics(self, batch: PreparedBatch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        # the mask is a statistic of the whole minibatch's (log π_θ − log μ)²: one per minibatch, as M2PO's
        mask = m2po_mask(batch.logprobs - batch.behavior_logprobs, batch.loss_mask, self.tau)
        rows = {**grpo_rows(batch), "kept": mask.kept}
        shared = {
            "m2po/second_moment": mask.second_moment,
            "m2po/kept_second_moment": mask.kept_second_moment,
        }
        return rows, shared

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        log_ratio = batch.logprobs - batch.behavior_logprobs  # log r_t = log π_θ − log μ
        advantages, kept = context.rows[ADVANTAGES], context.rows["kept"] & batch.loss_mask
        token_loss = ratio_token_loss(log_ratio, advantages[:, None], self.max_log_ratio)
        # J = (1/Σ|o|) Σ M_{i,t} r_{i,t} A_i: masked tokens contribute 0 but stay in the denominator
        token_loss = torch.where(kept, token_loss, torch.zeros_like(token_loss))
        loss = self.aggregate(token_loss, batch.loss_mask, context)
        return Surrogate(loss, advantages, masked=batch.loss_mask & ~kept, metrics=dict(context.shared))

