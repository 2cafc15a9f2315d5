"""VCPO's policy gradient: the truncated sequence weight with the off-policy optimal baseline (OPOB)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch
from torch import Tensor

from vcpo.groups import GroupIndex, degenerate_groups, group_count, group_mean, group_std, single_group
from vcpo.is_weights import sequence_is_weights, truncated_is_weights
from vcpo.metrics import opob_concentration, opob_metrics
from vcpo.objectives.base import ADVANTAGES, BatchContext, ObjectiveBase, PreparedBatch, Surrogate
from vcpo.objectives.weighted import (
    FALLBACKS,
    NONFINITE_NORMS,
    SequenceTisOptions,
    Statistics,
    weighted_loglik_loss,
)
from vcpo.opob import (
    BASELINE_AGGREGATIONS,
    OPOB_FORMS,
    REFERENCE_AGGREGATION_MODES,
    REFERENCE_AGGREGATIONS,
    GroupBaseline,
    TwoBufferCoefficients,
    opob_baseline_weights,
    reference_baseline_weights,
    reference_coefficients,
    reference_group_std,
    reference_is_weights,
    reference_loglik_scale,
    reference_loss_weights,
    reference_std_divisor,
    vcpo_coefficients,
    winsorized_mean_baseline,
)

BASELINE_SCOPES = ("group", "minibatch")


@dataclass(frozen=True)
class VCPO(SequenceTisOptions, ObjectiveBase):
    """VCPO's policy gradient: −(1/B) Σ_i w̄_i (R_i − b*_g)/σ_g · ℓ_i with the OPOB b* (opob.py).

    Needs `seq_sq_grad_norms` = ‖∇ℓ_i‖² of the same aggregated ℓ_i this loss uses, unweighted.
    form: "spec" (docs/algorithm.md: ω_i = w_i² ‖∇ℓ_i‖², σ_g with Bessel + ε, degenerate groups exactly 0) or
    "reference" (the authors' code: ω_i = w̄_i² w_i² ‖∇Σ_t log π‖², b = Σ ωR / (Σ ω + 1e-8), σ_g the
    population std without ε, applied only where σ_g > 1e-8; opob.py's reference section).
    is_cap: C of w̄ in the gradient. scope: "group" (b* per prompt) or "minibatch" (spec only).
    use_is_weights: w_i² in b*'s weights (off = on-policy optimal baseline).
    use_clipped_weights: w̄_i² instead of w_i² there. normalize_by_length: divide b*'s weight by |M_i|².
    divide_by_std: divide R_i − b* by σ_g. aggregation: "weighted_mean" (closed form),
    "weighted_median" or "winsorized_mean" — spec: ω capped at winsorize_quantile; reference: the
    rewards clipped to their ω-weighted 5%/95% quantiles, as the authors'. eps: ε (spec).
    A KL term (kl_coef > 0) adds kl_coef · agg(KL) to the loss; b* stays the policy-gradient term's (the
    learner back-propagates the KL term separately, `regularizer_loss`).
    Reference: Huang et al. 2026, "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs".
    """

    name: ClassVar[str] = "vcpo"
    uses_grad_norms: ClassVar[bool] = True
    loss_aggregation: str = "seq-mean-token-mean"
    form: str = "spec"
    scope: str = "group"
    use_is_weights: bool = True
    use_clipped_weights: bool = False
    normalize_by_length: bool = False
    divide_by_std: bool = True
    aggregation: str = "weighted_mean"
    winsorize_quantile: float = 0.75
    eps: float = 1e-6

    def _check_options(self) -> list[str]:
        problems = SequenceTisOptions._check_options(self)
        if self.form not in OPOB_FORMS:
            problems.append(f"form={self.form!r}; valid: {list(OPOB_FORMS)}")
        if self.scope not in BASELINE_SCOPES:
            problems.append(f"scope={self.scope!r}; valid: {list(BASELINE_SCOPES)}")
        if self.aggregation not in BASELINE_AGGREGATIONS:
            problems.append(f"aggregation={self.aggregation!r}; valid: {sorted(BASELINE_AGGREGATIONS)}")
        if not 0.0 <= self.winsorize_quantile <= 1.0:
            problems.append(f"winsorize_quantile={self.winsorize_quantile} must be in [0, 1]")
        if self.form == "reference":
            if self.scope != "group":
                problems.append("form='reference' supports scope='group' only")
            if self.loss_aggregation not in REFERENCE_AGGREGATION_MODES:
                problems.append(f"form='reference' needs loss_aggregation in "
                                f"{sorted(REFERENCE_AGGREGATION_MODES)}, not {self.loss_aggregation!r}")
        return problems

    # --- the pieces the learner's two-buffer gradient uses too (learner/backends/torch_learner.py) ---------

    def sequence_weights(self, seq_log_ratios: Tensor) -> tuple[Tensor, Tensor]:
        """(w, w̄) → two (B,) fp32 tensors from L_i. spec: w = exp(clamp(L_i, ±max_log_ratio)), always
        finite, and w̄ = min(w, is_cap); reference: w the authors' unclamped fp32 exp(L_i) (inf past
        L ≈ 88.7: only b*'s weights read w, and `reference_baseline_weights` keeps them finite), w̄ their
        loss weight min(exp(clamp(L_i, ±20)), is_cap) (`reference_loss_weights`)."""
        if self.form == "reference":
            weights = reference_is_weights(seq_log_ratios).float()
            return weights, reference_loss_weights(seq_log_ratios, self.is_cap).float()
        weights = sequence_is_weights(seq_log_ratios, self.max_log_ratio)
        return weights, truncated_is_weights(weights, self.is_cap)

    def baseline_weights(self, sq_grad_norms: Tensor, seq_log_ratios: Tensor, num_tokens: Tensor,
                         scope: GroupIndex) -> Tensor:
        """(B,) fp64 ω_i of b* for this form. sq_grad_norms: ‖∇ℓ_i‖² (unweighted); seq_log_ratios: L_i;
        num_tokens: |M_i| (trained tokens); scope: the baseline's groups."""
        lengths = num_tokens if self.normalize_by_length else None
        if self.form == "reference":
            scale = reference_loglik_scale(self.loss_aggregation, num_tokens)
            # ω_i = w̄_i² · w_i² · ‖∇Σ_t log π‖² [/ |M_i|²], w_i = e^{L_i} unclamped
            return reference_baseline_weights(
                sq_grad_norms, seq_log_ratios, self.is_cap, scale, scope, use_is_weights=self.use_is_weights,
                use_clipped_weights=self.use_clipped_weights, num_tokens=lengths)
        weights, truncated = self.sequence_weights(seq_log_ratios)
        baseline_is = (truncated if self.use_clipped_weights else weights) if self.use_is_weights else None
        return opob_baseline_weights(sq_grad_norms, baseline_is, lengths)  # ω_i = w_i² ‖∇ℓ_i‖² [/ |M_i|²]

    def group_baseline(self, rewards: Tensor, omega: Tensor, valid: Tensor,
                       scope: GroupIndex) -> GroupBaseline:
        """b* per group of `scope` from ω (this form's aggregation)."""
        if self.form == "reference":
            return REFERENCE_AGGREGATIONS[self.aggregation](rewards, omega, valid, scope)
        aggregate = BASELINE_AGGREGATIONS[self.aggregation]
        if aggregate is winsorized_mean_baseline:
            aggregate = partial(winsorized_mean_baseline, upper_quantile=self.winsorize_quantile)
        return aggregate(rewards, omega, valid, scope)

    def advantage_divisor(self, rewards: Tensor, valid: Tensor, groups: GroupIndex) -> tuple[Tensor, Tensor]:
        """((B,) fp64 divisor d_i of R_i − b*, (B,) bool keep). spec: σ_g (Bessel) + ε, the members of
        degenerate groups dropped (`spec_keep`); reference: population σ_g where > 1e-8 else 1, nothing
        dropped."""
        if self.form == "reference":
            sigma = reference_group_std(rewards, valid, groups)[groups.index]
            return reference_std_divisor(sigma, self.divide_by_std), valid
        sigma = group_std(rewards, valid, groups)[groups.index].double()
        keep = self.spec_keep(rewards, valid, groups)
        return (sigma + self.eps if self.divide_by_std else torch.ones_like(sigma)), keep

    def spec_keep(self, rewards: Tensor, valid: Tensor, groups: GroupIndex) -> Tensor:
        """(B,) bool: the valid members outside degenerate groups (the spec form's advantage is exactly 0
        elsewhere) — the prompt groups σ_g is taken over, or, without the σ division, the baseline's scope.

        Exact reward equality decides (`degenerate_groups`), never σ_g > 0: σ_g of eight rewards of 0.1 is
        8e-9 in float32, not 0, and (R − b*)/(σ_g + ε) of that rounding was ~0.007 — a gradient of rounding
        noise from every all-0.1 group (the default run's format reward)."""
        scope = groups
        if not self.divide_by_std and self.scope != "group":
            scope = single_group(rewards.numel(), rewards.device)
        return valid & ~degenerate_groups(rewards, valid, scope)[scope.index]

    def gradient_coefficients(self, truncated: Tensor, rewards: Tensor, valid: Tensor, groups: GroupIndex,
                              batch_size: int | Tensor) -> TwoBufferCoefficients:
        """a_i = w̄_i R_i/(d_i B), s_i = w̄_i/(d_i B) (0 where not kept): A − b*_g S = VCPO's ĝ. In the
        spec form both are exactly 0 for every member of a degenerate group, so such a group adds nothing
        to the gradient whatever its ∇ℓ_i (the learner does not compute them)."""
        if self.form == "reference":
            divisor, keep = self.advantage_divisor(rewards, valid, groups)
            return reference_coefficients(truncated, rewards, divisor, keep, batch_size)
        sigma = group_std(rewards, valid, groups)[groups.index]
        keep = self.spec_keep(rewards, valid, groups)
        return vcpo_coefficients(truncated, rewards, sigma, keep, batch_size, self.divide_by_std, self.eps)

    def _statistics(self, batch: PreparedBatch) -> Statistics:
        norms = batch.seq_sq_grad_norms.detach()
        nonfinite_norms = (batch.valid & ~(torch.isfinite(norms) & (norms >= 0))).sum()
        scope = batch.groups if self.scope == "group" else single_group(batch.rewards.numel(), norms.device)
        omega = self.baseline_weights(norms, batch.seq_log_ratios, batch.loss_mask.sum(dim=-1), scope)
        baseline = self.group_baseline(batch.rewards, omega, batch.valid, scope)
        divisor, keep = self.advantage_divisor(batch.rewards, batch.valid, batch.groups)
        centred = batch.rewards.double() - baseline.per_trajectory.double()
        advantages = torch.where(keep, centred / divisor, torch.zeros_like(centred)).float()
        per_prompt = group_mean(baseline.per_trajectory, batch.valid, batch.groups)
        present = group_count(batch.valid, batch.groups) > 0
        metrics = opob_metrics(per_prompt, group_mean(batch.rewards, batch.valid, batch.groups), present)
        # b* of a scope whose members are all dropped (a degenerate group, in the spec form) moves nothing:
        # its weights' concentration and its fallback are not counted (the learner skips its ∇ℓ_i, so ω = 0)
        used = group_count(keep, scope) > 0
        metrics.update(opob_concentration(omega, keep, batch.groups))
        counts = {FALLBACKS: (baseline.is_fallback & used).sum(), NONFINITE_NORMS: nonfinite_norms}
        return {ADVANTAGES: advantages}, {**metrics, **counts}

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        _, truncated = self.sequence_weights(batch.seq_log_ratios)
        advantages = context.rows[ADVANTAGES]
        loss = weighted_loglik_loss(self, batch, truncated * advantages, context)  # IS factor w̄_i once, here
        shared = dict(context.shared)
        fallbacks, nonfinite = shared.pop(FALLBACKS), shared.pop(NONFINITE_NORMS)
        return Surrogate(loss, advantages, metrics=shared, baseline_fallbacks=fallbacks,
                         nonfinite_grad_norms=nonfinite)

