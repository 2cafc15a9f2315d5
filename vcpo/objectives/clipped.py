"""PPO-family objectives: a clipped ratio surrogate on top of group advantages.

| name      | advantage          | ratio in the clip          | behaviour correction            |
| --------- | ------------------ | -------------------------- | ------------------------------- |
| grpo      | (R − mean_g)/σ_g   | π_θ/π_old                  | none                            |
| dr_grpo   | R − mean_g         | π_θ/π_old                  | none                            |
| token_tis | (R − mean_g)/σ_g   | π_θ/π_old                  | × min(π_old/μ, C_tok) per token |
| mis       | (R − mean_g)/σ_g   | π_θ/π_old                  | × π_old/μ, dropped off [1/C, C] |
| m2po      | (R − mean_g)/σ_g   | π_θ/μ, unclipped           | second-moment token mask        |
| bapo      | (R − mean_g)/σ_g   | π_θ/μ, adaptive bounds     | none (the bounds absorb it)     |
| gspo      | (R − mean_g)/σ_g   | sequence (π_θ/μ)^(1/|M|)   | the clip on it (or π_old)       |
| cispo     | (R − mean_g)/σ_g   | π_θ/μ per token, detached  | the clipped weight, no drop     |

Why: PPO's ratio measures drift from the policy that computed the advantages' sampling
distribution. GRPO-style objectives treat π_old as that policy (the behaviour mismatch is
ignored, or corrected separately by the detached TIS/MIS factor — decoupled PPO). M2PO and BAPO
were designed for stale data and define their ratio against the rollout policy μ itself, so
their mask/bounds act on the staleness.

This module holds the family's shared parts and its plain members (grpo, dr_grpo); token_tis, mis, m2po,
bapo, gspo and cispo have a module each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vcpo.advantages import dr_grpo_advantages, grpo_advantages
from vcpo.corrections import CorrectionView
from vcpo.objectives.base import ADVANTAGES, BatchContext, ObjectiveBase, PreparedBatch, Surrogate
from vcpo.policy_losses import ppo_clip_token_loss


def grpo_rows(batch: PreparedBatch) -> dict[str, torch.Tensor]:
    return {ADVANTAGES: grpo_advantages(batch.rewards, batch.groups, batch.valid)}


def _check_clip(clip_low: float, clip_high: float, dual_clip: float | None) -> list[str]:
    problems = []
    if not 0.0 <= clip_low < 1.0:
        problems.append(f"clip_low={clip_low} must be in [0, 1) (the lower bound is 1 − clip_low)")
    if clip_high < 0:
        problems.append(f"clip_high={clip_high} must be ≥ 0")
    if dual_clip is not None and dual_clip <= 1.0:
        problems.append(f"dual_clip={dual_clip} must be > 1 or None")
    return problems


@dataclass(frozen=True)
class PpoClipOptions:
    """The PPO clip shared by several objectives.

    clip_low: ε_low, ratios below 1 − ε_low stop contributing gradient (A < 0).
    clip_high: ε_high, clip-higher (DAPO): ratios above 1 + ε_high stop contributing (A > 0).
    dual_clip: c > 1, a negative-advantage token's loss is at most c·|A|; None disables it.
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0

    def _check_options(self) -> list[str]:
        return _check_clip(self.clip_low, self.clip_high, self.dual_clip)

    def _statistics(self, batch: PreparedBatch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return grpo_rows(batch), {}

    def _clipped_loss(
        self, batch: PreparedBatch, context: BatchContext, token_weights: torch.Tensor | None = None
    ) -> Surrogate:
        """PPO-clip on π_θ/π_old of the context's (B,) advantages, optionally × detached (B, T) token
        weights."""
        advantages = context.rows[ADVANTAGES]
        clip = ppo_clip_token_loss(
            batch.logprobs,
            batch.old_logprobs,
            advantages[:, None],
            self.clip_low,
            self.clip_high,
            self.dual_clip,
            self.max_log_ratio,
        )
        token_loss = clip.token_loss if token_weights is None else clip.token_loss * token_weights.detach()
        loss = self.aggregate(self.weighted(token_loss, batch), batch.loss_mask, context)
        return Surrogate(loss, advantages, clipped=clip.is_clipped)


@dataclass(frozen=True)
class GRPO(PpoClipOptions, ObjectiveBase):
    """GRPO: A_i = (R_i − mean_g)/(σ_g + ε), PPO-clip on r = π_θ/π_old, no behaviour correction.

    normalize_std: divide by σ_g + ε (False = Dr. GRPO's advantage). eps: ε.
    Reference: Shao et al. 2024 (DeepSeekMath); clip-higher from Yu et al. 2025 (DAPO).
    """

    name: ClassVar[str] = "grpo"
    silent_degenerate_groups: ClassVar[bool] = True
    takes_token_weights: ClassVar[bool] = True
    normalize_std: bool = True
    eps: float = 1e-6

    def _statistics(self, batch: PreparedBatch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        if self.normalize_std:
            advantages = grpo_advantages(batch.rewards, batch.groups, batch.valid, self.eps)
        else:
            advantages = dr_grpo_advantages(batch.rewards, batch.groups, batch.valid)
        return {ADVANTAGES: advantages}, {}

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        return self._clipped_loss(batch, context)


@dataclass(frozen=True)
class DrGRPO(PpoClipOptions, ObjectiveBase):
    """Dr. GRPO: A_i = R_i − mean_g (no std), PPO-clip on π_θ/π_old, token-sum / constant aggregation.

    Reference: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective".
    """

    name: ClassVar[str] = "dr_grpo"
    silent_degenerate_groups: ClassVar[bool] = True
    takes_token_weights: ClassVar[bool] = True
    loss_aggregation: str = "seq-mean-token-sum-norm"

    def _statistics(self, batch: PreparedBatch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return {ADVANTAGES: dr_grpo_advantages(batch.rewards, batch.groups, batch.valid)}, {}

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        return self._clipped_loss(batch, context)


def correction_view(objective: ObjectiveBase, batch: PreparedBatch) -> CorrectionView:
    """What a correction stage reads of the batch: ℓ_t = log π_old − log μ on its trained tokens."""
    return CorrectionView.of(batch.old_logprobs, batch.behavior_logprobs, batch.loss_mask,
                             objective.max_log_ratio)


RATIO_DENOMINATORS = ("behavior", "proximal")
"""What GSPO's and CISPO's ratio divides by: the behaviour policy μ (the rollout's log-probs, as veRL's
asynchronous recipes use them as old log-probs), or the proximal π_old (then r = 1 at the gradient point
of a one-step-per-minibatch learner: no correction at all)."""


def ratio_denominator(batch: PreparedBatch, ratio_to: str) -> torch.Tensor:
    return batch.behavior_logprobs if ratio_to == "behavior" else batch.old_logprobs


class RatioToOptions:
    """GSPO's and CISPO's shared options: the ratio's denominator ν (`ratio_to`: μ or π_old) and the clip
    range [1 − clip_low, 1 + clip_high]; GRPO's group advantages. `allow_zero_bound`: clip_low = 1 (a lower
    bound of 0) is allowed."""

    allow_zero_bound: ClassVar[bool] = False
    ratio_to: str
    clip_low: float
    clip_high: float

    def _check_options(self) -> list[str]:
        problems = []
        if self.ratio_to not in RATIO_DENOMINATORS:
            problems.append(f"ratio_to={self.ratio_to!r}; valid: {list(RATIO_DENOMINATORS)}")
        in_range = 0.0 <= self.clip_low <= 1.0 if self.allow_zero_bound else 0.0 <= self.clip_low < 1.0
        if not in_range:
            interval = "[0, 1]" if self.allow_zero_bound else "[0, 1)"
            problems.append(f"clip_low={self.clip_low} must be in {interval} "
                            "(the lower bound is 1 − clip_low)")
        if self.clip_high < 0:
            problems.append(f"clip_high={self.clip_high} must be ≥ 0")
        return problems

    @property
    def accepts_token_weights(self) -> bool:
        return self.ratio_to == "proximal"  # a ratio to μ is a behaviour correction of its own

    def _statistics(self, batch: PreparedBatch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return grpo_rows(batch), {}


