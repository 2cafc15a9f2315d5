"""BAPO: the ratio to μ under adaptive clipping bounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vcpo.objectives.base import ADVANTAGES, BatchContext, ObjectiveBase, PreparedBatch, Surrogate
from vcpo.objectives.clipped import grpo_rows
from vcpo.policy_losses import clipped_surrogate
from vcpo.stabilizers import bapo_bounds


@dataclass(frozen=True)
class BAPO(ObjectiveBase):
    """BAPO: GRPO advantages, clipped surrogate on r = π_θ/μ with per-batch adaptive bounds.

    The bounds start at (clip_low_range[0], clip_high_range[0]); c_high then c_low move up by
    `step` until positive-advantage tokens make up ≥ positive_fraction of the gradient-carrying
    objective (see `vcpo.stabilizers.bapo_bounds`). Reference: Xi et al. 2025 (arXiv:2510.18927).
    """

    name: ClassVar[str] = "bapo"
    silent_degenerate_groups: ClassVar[bool] = True
    clip_low_range: tuple[float, float] = (0.6, 0.9)
    clip_high_range: tuple[float, float] = (1.2, 3.0)
    step: float = 0.05
    positive_fraction: float = 0.5

    def _check_options(self) -> list[str]:
        problems = []
        (low_start, low_max), (high_start, high_max) = self.clip_low_range, self.clip_high_range
        if not 0.0 < low_start <= low_max < 1.0:
            problems.append(f"clip_low_range={self.clip_low_range} must satisfy 0 < start ≤ max < 1")
        if not 1.0 < high_start <= high_max:
            problems.append(f"clip_high_range={self.clip_high_range} must satisfy 1 < start ≤ max")
        if self.step <= 0:
            problems.append(f"step={self.step} must be > 0")
        if not 0.0 < self.positive_fraction < 1.0:
            problems.append(f"positive_fraction={self.positive_fraction} must be in (0, 1)")
        return problems

    def _statistics(self, batch: PreparedBatch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        # the bounds are chosen once per minibatch, from every token's ratio and advantage
        rows = grpo_rows(batch)
        log_ratio = batch.logprobs - batch.behavior_logprobs  # log r_t = log π_θ − log μ
        ratio = log_ratio.detach().clamp(-self.max_log_ratio, self.max_log_ratio).exp()
        bounds = bapo_bounds(
            ratio,
            rows[ADVANTAGES][:, None],
            batch.loss_mask,
            self.clip_low_range,
            self.clip_high_range,
            self.step,
            self.positive_fraction,
        )
        shared = {
            "bapo/clip_low": bounds.lower_bound,
            "bapo/clip_high": bounds.upper_bound,
            "bapo/positive_fraction": bounds.positive_fraction,
        }
        return rows, shared

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        log_ratio = batch.logprobs - batch.behavior_logprobs  # log r_t = log π_θ − log μ
        advantages = context.rows[ADVANTAGES]
        lower, upper = context.shared["bapo/clip_low"], context.shared["bapo/clip_high"]
        clip = clipped_surrogate(log_ratio, advantages[:, None], lower, upper, None, self.max_log_ratio)
        loss = self.aggregate(clip.token_loss, batch.loss_mask, context)
        return Surrogate(loss, advantages, clipped=clip.is_clipped, metrics=dict(context.shared))

