"""TBA: trajectory balance with asynchrony, the VarGrad form of the trajectory-balance loss.

No ratio and no IS weights: the balance condition log Z + log π_θ(τ) = log π_ref(τ) + R(τ)/β
holds for every trajectory, whichever policy sampled it, so the loss is off-policy valid and pairs
with a replay buffer. Needs `ref_logprobs`. Reference: Bartoldson et al. 2025 (arXiv:2503.18929).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vcpo.objectives.base import BatchContext, ObjectiveBase, PreparedBatch, Surrogate
from vcpo.policy_losses import TrajectoryBalance, tba_vargrad_loss

_LOG_PARTITION, _COUNT = "log_partition", "trajectories"
"""`BatchContext` keys: (B,) log Ẑ of each trajectory's group, and the minibatch's valid trajectories."""


@dataclass(frozen=True)
class TBA(ObjectiveBase):
    """loss = mean_k (log Ẑ_g + log π_θ(τ_k) − log π_ref(τ_k) − R_k/β)², log Ẑ_g the group mean.

    beta: reward temperature β (rewards enter as R/β). The loss is a per-trajectory quantity, so
    loss_aggregation applies only to the optional KL/entropy terms; log π(τ) sums over M_i.
    The reported advantage is the (negated) residual, −(log Ẑ + log π_θ − log π_ref − R/β).
    """

    name: ClassVar[str] = "tba"
    uses_ref_logprobs: ClassVar[bool] = True
    beta: float = 0.05

    def _check_options(self) -> list[str]:
        return [f"beta={self.beta} must be > 0"] if self.beta <= 0 else []

    def _balance(
        self,
        batch: PreparedBatch,
        log_partition: torch.Tensor | None = None,
        count: torch.Tensor | None = None,
    ) -> TrajectoryBalance:
        return tba_vargrad_loss(
            batch.logprobs.sum(dim=-1),
            batch.ref_logprobs.sum(dim=-1),
            batch.rewards,
            batch.valid,
            batch.groups,
            self.beta,
            log_partition=log_partition,
            count=count,
        )

    def _statistics(self, batch: PreparedBatch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        # log Ẑ_g averages over the whole group and the loss over the whole minibatch's trajectories
        log_partition = self._balance(batch).log_partition
        valid = batch.valid.to(log_partition.dtype)
        count = valid.sum().clamp_min(1.0)
        shared = {_COUNT: count, "tba/log_partition_mean": (log_partition * valid).sum() / count}
        return {_LOG_PARTITION: log_partition}, shared

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        # log Ẑ_g held fixed: the same gradient as through it (a group's residuals sum to zero)
        balance = self._balance(batch, context.rows[_LOG_PARTITION], context.shared[_COUNT])
        metrics = {"tba/log_partition_mean": context.shared["tba/log_partition_mean"]}
        return Surrogate(balance.loss, -balance.residuals.detach(), metrics=metrics)
