"""A custom objective and a custom correction stage, as a user writes them: plain frozen dataclasses in your
own module, named in a run config by `import_path` (`algo.objective` / `algo.corrections` with
`type: custom`). Nothing in vcpo is edited. docs/extending.md walks through both."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from vcpo.advantages import rloo_advantages
from vcpo.corrections import SEQUENCE, CorrectionView
from vcpo.objectives.base import ADVANTAGES, PreparedBatch
from vcpo.objectives.weighted import RLOO


@dataclass(frozen=True)
class ClippedRLOO(RLOO):
    """RLOO whose leave-one-out advantages are clipped to ±max_advantage: one lucky sample in a group of
    failures cannot dominate the step. Everything else — the loss, aggregation, KL and entropy terms, the
    metrics — is RLOO's."""

    name: ClassVar[str] = "clipped_rloo"
    max_advantage: float = 0.5

    def __post_init__(self) -> None:
        if not self.max_advantage > 0:
            raise ValueError(f"max_advantage={self.max_advantage} must be > 0")

    def _statistics(self, batch: PreparedBatch) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        advantages = rloo_advantages(batch.rewards, batch.groups, batch.valid)
        return {ADVANTAGES: advantages.clamp(-self.max_advantage, self.max_advantage)}, {}


@dataclass(frozen=True)
class MaxRatioRejection:
    """Reject a whole trajectory when any of its tokens has π_old/μ above `upper` — one token the behaviour
    policy found far likelier than the learner does marks a sample too stale to trust."""

    label: ClassVar[str] = "max_ratio_reject"
    level: ClassVar[str] = SEQUENCE
    upper: float = 4.0

    def __post_init__(self) -> None:
        if not self.upper > 1:
            raise ValueError(f"upper={self.upper} must be > 1 (a ratio of 1 is on-policy)")

    def keep(self, view: CorrectionView) -> Tensor:
        """(B,) bool: the largest token log-ratio of each trajectory's kept tokens is within log(upper)."""
        largest = torch.where(view.mask, view.token_log_ratio, -math.inf).amax(dim=-1)
        return largest <= math.log(self.upper)
