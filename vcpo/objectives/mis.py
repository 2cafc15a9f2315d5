"""MIS, masked importance sampling: GRPO's clipped surrogate × π_old/μ where it lies in [1/C, C]."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vcpo.corrections import SequenceRejection, SequenceTruncation, TokenRejection, TokenTruncation
from vcpo.objectives.base import BatchContext, ObjectiveBase, PreparedBatch, Surrogate
from vcpo.objectives.clipped import PpoClipOptions, correction_view

MIS_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class MIS(PpoClipOptions, ObjectiveBase):
    """Masked IS: GRPO advantages, PPO-clip on π_θ/π_old, × the IS ratio where it lies in [1/C, C].

    level "token": ρ_t = π_old/μ per token, out-of-range tokens dropped.
    level "sequence": w_i = Π_t π_old/μ, out-of-range trajectories dropped.
    is_cap: C > 1. Reference: Liu, Li, et al. 2025, "When Speed Kills Stability".
    """

    name: ClassVar[str] = "mis"
    silent_degenerate_groups: ClassVar[bool] = True
    is_cap: float = 2.0
    level: str = "token"

    def _check_options(self) -> list[str]:
        problems = PpoClipOptions._check_options(self)
        if self.is_cap <= 1.0:
            problems.append(f"is_cap={self.is_cap} must be > 1 (kept range [1/C, C])")
        if self.level not in MIS_LEVELS:
            problems.append(f"level={self.level!r}; valid: {list(MIS_LEVELS)}")
        return problems

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        # the correction stages' band [1/C, C] and truncation at C (vcpo/corrections.py); unlike a rejection
        # stage, a dropped token stays in token-mean's denominator (MIS weighs it 0)
        view = correction_view(self, batch)
        band = (1.0 / self.is_cap, self.is_cap)
        if self.level == "token":
            kept = TokenRejection(*band).keep(view) & view.mask
            truncation: TokenTruncation | SequenceTruncation = TokenTruncation(self.is_cap)
        else:
            kept = SequenceRejection(*band).keep(view)[:, None] & view.mask
            truncation = SequenceTruncation(self.is_cap)
        weights = truncation.weights(view._replace(mask=kept))
        surrogate = self._clipped_loss(batch, context, weights)
        return surrogate._replace(masked=batch.loss_mask & ~kept)

