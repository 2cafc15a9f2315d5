"""Per-step learning-rate multipliers: the ESS rules of VCPO part 1 and the staleness-aware rule.

Each rule returns a scale s ∈ (0, 1]; the learner uses η_step = η_schedule · s for that one
optimizer step and leaves the schedule untouched. Rules are separate from the objectives, so the
ablations are compositions: "ESS lr only" = seq_tis objective + `EssLr`, "OPOB only" = vcpo
objective + `ConstantLr`, VCPO = vcpo objective + `EssLr`.

ESS is defined over the whole optimizer minibatch, across data-parallel ranks: callers gather the
(B,) log-weights of all ranks (B floats each) and call the rule once on the global vector. Nothing
here touches torch.distributed.

References: Huang et al. 2026, "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs"
(arXiv:2602.17616) for the ESS rules; the sqrt rule is the Adam batch-size ↔ lr scaling
(Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from vcpo.is_weights import ess_ratio


def ess_lr_scale_sqrt(ess_ratio_value: Tensor | float, base_ess_ratio: float = 1.0) -> Tensor:
    """s(ρ) = sqrt(min(1, ρ/ρ0)) → 0-d tensor.

    ess_ratio_value: ρ = ESS/B of the minibatch. base_ess_ratio: ρ0 (1.0 math, 0.55 multi-turn).
    """
    rho = torch.as_tensor(ess_ratio_value, dtype=torch.float32)
    # docs/algorithm.md: s(ρ) = sqrt(min(1, ρ / ρ_0))    (rule "sqrt")
    return (rho / base_ess_ratio).clamp(max=1.0).sqrt()


def ess_lr_scale_linear(ess_ratio_value: Tensor | float, base_ess_ratio: float = 1.0) -> Tensor:
    """s(ρ) = min(1, ρ/ρ0) → 0-d tensor. Arguments as in `ess_lr_scale_sqrt`."""
    rho = torch.as_tensor(ess_ratio_value, dtype=torch.float32)
    # docs/algorithm.md: s(ρ) = min(1, ρ / ρ_0)    (rule "linear")
    return (rho / base_ess_ratio).clamp(max=1.0)


def staleness_lr_scale(mean_lag: Tensor | float, s0: float = 4.0) -> Tensor:
    """s(S) = 1 / (1 + S/S0) → 0-d tensor, so that η = η0 / (1 + S/S0).

    mean_lag: S, the minibatch mean lag (policy versions). s0: S0, the lag at which lr halves.
    The per-step bias of stale SGD grows like O(S·η), so η ∝ 1/S keeps it bounded.
    """
    lag = torch.as_tensor(mean_lag, dtype=torch.float32)
    # docs/algorithm.md: η = η_0 / (1 + S / S_0)
    return 1.0 / (1.0 + lag / s0)


class StepSizeInputs(NamedTuple):
    """What a step-size rule sees: the global minibatch.

    log_is_weights: (B,) L_i = log w_i (from `PolicyLossOutput.log_is_weights`, gathered over ranks).
    valid: (B,) bool, trajectories that entered the loss (finite inputs).
    lags: (B,) long policy lag v − v_start of each trajectory, or None.
    """

    log_is_weights: Tensor
    valid: Tensor
    lags: Tensor | None = None


class LrScale(NamedTuple):
    """scale: 0-d multiplier of the scheduled lr; metrics: what to log (`lr/scale`, inputs)."""

    scale: Tensor
    metrics: dict[str, Tensor]


ESS_LR_RULES = {"sqrt": ess_lr_scale_sqrt, "linear": ess_lr_scale_linear}
"""The ESS step-size rules by name (docs/algorithm.md: "sqrt" is the default)."""


@dataclass(frozen=True)
class EssLr:
    """VCPO part 1: s = rule(ρ, ρ0), ρ = ESS/B from w (or from w̄ with use_clipped_weights).

    rule: "sqrt" (default) or "linear". base_ess_ratio: ρ0. is_cap: C, used only for w̄.
    """

    rule: str = "sqrt"
    base_ess_ratio: float = 1.0
    use_clipped_weights: bool = False
    is_cap: float = 8.0

    def __post_init__(self) -> None:
        if self.rule not in ESS_LR_RULES:
            raise ValueError(f"unknown ESS lr rule {self.rule!r}; valid: {sorted(ESS_LR_RULES)}")
        if not 0.0 < self.base_ess_ratio <= 1.0:
            raise ValueError(f"base_ess_ratio={self.base_ess_ratio} must be in (0, 1] (ρ0 is an ESS ratio)")

    def __call__(self, inputs: StepSizeInputs) -> LrScale:
        log_weights = inputs.log_is_weights
        if self.use_clipped_weights:
            log_weights = log_weights.clamp(max=math.log(self.is_cap))  # log w̄ = min(L, log C)
        rho = ess_ratio(log_weights, inputs.valid)
        scale = ESS_LR_RULES[self.rule](rho, self.base_ess_ratio)
        return LrScale(scale, {"lr/scale": scale, "lr/ess_ratio": rho})


@dataclass(frozen=True)
class StalenessLr:
    """η = η0 / (1 + S/S0) with S the mean lag of the valid trajectories (needs `lags`)."""

    s0: float = 4.0

    def __post_init__(self) -> None:
        if self.s0 <= 0:
            raise ValueError(f"s0={self.s0} must be > 0 (the lag at which the lr halves)")

    def __call__(self, inputs: StepSizeInputs) -> LrScale:
        if inputs.lags is None:
            raise ValueError(
                "the staleness lr rule needs StepSizeInputs.lags (B,) policy lags; pass the "
                "trajectories' v − v_start or use the 'constant' rule"
            )
        valid = inputs.valid.to(torch.float32)
        mean_lag = (inputs.lags.float() * valid).sum() / valid.sum().clamp_min(1.0)
        scale = staleness_lr_scale(mean_lag, self.s0)
        return LrScale(scale, {"lr/scale": scale, "lr/mean_lag": mean_lag})


@dataclass(frozen=True)
class ConstantLr:
    """No scaling (s = 1): synchronous baselines and the "OPOB only" ablation."""

    def __call__(self, inputs: StepSizeInputs) -> LrScale:
        scale = torch.ones((), dtype=torch.float32, device=inputs.log_is_weights.device)
        return LrScale(scale, {"lr/scale": scale})
