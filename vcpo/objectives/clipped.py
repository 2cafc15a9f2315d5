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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vcpo.advantages import dr_grpo_advantages, grpo_advantages
from vcpo.corrections import (
    CorrectionView,
    SequenceRejection,
    SequenceTruncation,
    TokenRejection,
    TokenTruncation,
)
from vcpo.objectives.base import ADVANTAGES, BatchContext, ObjectiveBase, PreparedBatch, Surrogate
from vcpo.policy_losses import clipped_surrogate, ppo_clip_token_loss, ratio_token_loss, reinforce_token_loss
from vcpo.stabilizers import bapo_bounds, m2po_mask


def _grpo_rows(batch: PreparedBatch) -> dict[str, torch.Tensor]:
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
        return _grpo_rows(batch), {}

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


def _view(objective: ObjectiveBase, batch: PreparedBatch) -> CorrectionView:
    """What a correction stage reads of the batch: ℓ_t = log π_old − log μ on its trained tokens."""
    return CorrectionView.of(batch.old_logprobs, batch.behavior_logprobs, batch.loss_mask,
                             objective.max_log_ratio)


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
        weights = TokenTruncation(self.token_is_cap).weights(_view(self, batch))
        surrogate = self._clipped_loss(batch, context, weights)
        weight_mean = weights.sum() / batch.loss_mask.sum().clamp_min(1)
        return surrogate._replace(metrics={"is/token_weight_mean": weight_mean})


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
        view = _view(self, batch)
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
        rows = {**_grpo_rows(batch), "kept": mask.kept}
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
        rows = _grpo_rows(batch)
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


RATIO_DENOMINATORS = ("behavior", "proximal")
"""What GSPO's and CISPO's ratio divides by: the behaviour policy μ (the rollout's log-probs, as veRL's
asynchronous recipes use them as old log-probs), or the proximal π_old (then r = 1 at the gradient point
of a one-step-per-minibatch learner: no correction at all)."""


def _ratio_denominator(batch: PreparedBatch, ratio_to: str) -> torch.Tensor:
    return batch.behavior_logprobs if ratio_to == "behavior" else batch.old_logprobs


class _RatioToOptions:
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
        return _grpo_rows(batch), {}


@dataclass(frozen=True)
class GSPO(_RatioToOptions, ObjectiveBase):
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
        token_log_ratio = torch.where(mask, batch.logprobs - _ratio_denominator(batch, self.ratio_to), 0.0)
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


@dataclass(frozen=True)
class CISPO(_RatioToOptions, ObjectiveBase):
    """CISPO: REINFORCE with a clipped, detached token IS weight — every token keeps its gradient.

    loss_t = −sg[clip(r_t, 1 − ε_low, 1 + ε_high)] · A_i · log π_θ(y_t), r_t = π_θ(y_t)/ν(y_t) with ν = μ
    (`ratio_to='behavior'`) or π_old ('proximal'), GRPO's A_i, token-mean aggregation (as MiniMax-M1).
    Unlike the PPO clip, a token outside the range is not dropped: its weight is held at the bound
    (`pg/clip_frac` counts those tokens; `cispo/weight_mean` is the mean weight). clip_low: ε_low, default
    1.0 — a lower bound of 0, i.e. none (r > 0): M1 imposed no lower bound "by setting ε_low to a large
    value" and tuned only ε_high. clip_high: ε_high, default 0.28 (DAPO's clip-higher, the usual CISPO
    default; M1's own tuned value is not used here). Reference: MiniMax 2025, "MiniMax-M1: Scaling
    Test-Time Compute Efficiently with Lightning Attention" (arXiv:2506.13585), §3.1.
    """

    name: ClassVar[str] = "cispo"
    allow_zero_bound: ClassVar[bool] = True
    silent_degenerate_groups: ClassVar[bool] = True
    clip_low: float = 1.0
    clip_high: float = 0.28
    ratio_to: str = "behavior"

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        mask = batch.loss_mask
        log_ratio = (batch.logprobs.detach() - _ratio_denominator(batch, self.ratio_to)).clamp(
            -self.max_log_ratio, self.max_log_ratio
        )
        ratio = torch.where(mask, log_ratio.exp(), torch.zeros_like(log_ratio))
        lower, upper = 1.0 - self.clip_low, 1.0 + self.clip_high
        weights = ratio.clamp(lower, upper)  # detached: the IS weight changes the measure, not the loss
        advantages = context.rows[ADVANTAGES]
        token_loss = reinforce_token_loss(batch.logprobs, weights * advantages[:, None])
        loss = self.aggregate(self.weighted(token_loss, batch), mask, context)
        clipped = mask & ((ratio > upper) | (ratio < lower))
        weight_mean = torch.where(mask, weights, 0.0).sum() / mask.sum().clamp_min(1)
        return Surrogate(loss, advantages, clipped=clipped, metrics={"cispo/weight_mean": weight_mean})
