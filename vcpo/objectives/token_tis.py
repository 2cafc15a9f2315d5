"""Token TIS: GRPO's clipped surrogate × the token truncation's weight min(π_old/μ, C_tok)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vcpo.corrections import TokenTruncation
from vcpo.objectives.base import BatchContext, ObjectiveBase, PreparedBatch, Surrogate
from vcpo.objectives.clipped import PpoClipOptions, correction_view


@dataclass(frozen=True)
class TokenTIS(PpoClipOptions, ObjectiveBase):
    """Token TIS: GRPO advantages, PPO-clip on π_θ/π_old, × min(π_old/μ, C_tok) per token (detached).

    token_is_cap: C_tok (docs/algorithm.md default 2). Reference: Yao et al. 2025, "Your Efficient RL
    Framework Secretly Brings You Off-Policy RL Training".
    """

    name: ClassVar[str] = "token_tis"
    silent_degenerate_groups: ClassVar[bool] = True
    token_is_cap: float = 2.0

    def _check_options(self) -> list[str]:
        cap_problem = [f"token_is_cap={self.token_is_cap} must be > 0"] if self.token_is_cap <= 0 else []
        return PpoClipOptions._check_options(self) + cap_problem

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        # ρ_t = min(π_old/μ, C_tok): the token truncation stage's weight (vcpo/corrections.py)
        weights = TokenTruncation(self.token_is_cap).weights(correction_view(self, batch))
        surrogate = self._clipped_loss(batch, context, weights)
        weight_mean = weights.sum() / batch.loss_mask.sum().clamp_min(1)
        return surrogate._replace(metrics={"is/token_weight_mean": weight_mean})

