"""Behaviour corrections that stack under any objective (`algo.corrections`): truncation and rejection.

An objective in `vcpo.objectives` carries its own behaviour correction, or none (GRPO's clip is to
π_old). The stages here act *before* the objective, on what it then sees: the token mask M (a rejected
token leaves it, a rejected trajectory loses all its tokens) and a detached per-token weight that
multiplies the objective's per-token policy loss (a truncation). So the same stage runs under VCPO,
GRPO, GSPO, …, and every quantity computed from the mask afterwards — the objective's sequence log-ratio
L_i and its IS weights, the ESS, OPOB's ω — is over the tokens the corrections kept.

With ℓ_t = log π_old(y_t) − log μ(y_t) on the sampled tokens (π_old is π_θ at the gradient point of a
one-step-per-minibatch learner; ℓ_t is clamped to ±max_log_ratio where a stage reads a single token):

| stage                       | keeps / weighs                                     | veRL / others        |
| --------------------------- | -------------------------------------------------- | -------------------- |
| `TokenTruncation` (cap C)   | weight min(e^ℓ_t, C) on every kept token           | rollout_is=token     |
| `SequenceTruncation` (C)    | weight min(e^{L_i}, C) on every kept token of i    | rollout_is=sequence  |
| `TokenRejection` [a, b]     | tokens with a ≤ e^ℓ_t ≤ b (IcePop)                 | rollout_rs=token_k1  |
| `SequenceRejection` [a, b]  | trajectories with a ≤ e^{L_i} ≤ b (sequence MIS)   | seq_sum_k1           |
| `GeometricRejection` [a, b] | trajectories with a ≤ e^{L_i/n_i} ≤ b              | seq_mean_k1; SkyRL   |
| `K3Rejection` δ, reduce     | trajectories with mean/sum/max_t k3_t ≤ δ          | seq_{mean,sum,max}_k3 |
| `OffPolicySequenceMasking`  | drops i when R_i < mean_g and mean_t(−ℓ_t) > δ     | slime / DeepSeek     |

(L_i = Σ ℓ_t over the trajectory's kept tokens, n_i their number, k3_t = e^ℓ_t − 1 − ℓ_t ≥ 0.)

Order, whatever the list's: (1) the token rejections, each on the sampled tokens (independent, so
their order is moot); (2) the sequence rejections, each on the tokens (1) kept — a sequence statistic
judges what would be trained; (3) the truncation (at most one), on the tokens (1) and (2) kept. A
trajectory whose sampled tokens are all removed is *rejected*: it stays in its group's reward
statistics (as a trajectory a task filter left out of the loss does) and weighs 0 in the ESS.

Deliberately not here: applying the weights in a loss (objectives/), reading configs, and the
learner's re-packing of the kept tokens (learner/backends/torch_learner.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, NamedTuple

import torch
from torch import Tensor

from vcpo.advantages import dr_grpo_advantages
from vcpo.groups import index_groups
from vcpo.is_weights import DEFAULT_MAX_LOG_RATIO
from vcpo.metrics import STALENESS_HIST_BINS, staleness_bin

if TYPE_CHECKING:
    from vcpo.objectives.base import PolicyLossInputs

TOKEN, SEQUENCE, TRUNCATION = "token", "sequence", "truncation"
"""A stage's level: what it acts on, and so its place in the order (module docstring)."""

CORRECTION_REJECTED_TOKENS = "correction/rejected_tokens"
CORRECTION_REJECTED_TRAJECTORIES = "correction/rejected_trajectories"
CORRECTION_REJECTED_BY_LAG = "correction/rejected_tokens_by_lag"
"""The corrections' metrics; each stage adds `correction/<label>/…` (`stage_metric`)."""


def stage_metric(label: str, what: str) -> str:
    """The name of a stage's metric: `correction/<label>/<what>`."""
    return f"correction/{label}/{what}"


class CorrectionView(NamedTuple):
    """What a stage reads. token_log_ratio: (B, T) ℓ_t clamped to ±max_log_ratio on `mask`, 0 elsewhere.
    raw_log_ratio: (B, T) the same unclamped (finite). mask: (B, T) bool, the tokens the stage judges.
    negative: (B,) bool, R_i below its group's mean (a degenerate group: never). max_log_ratio: the clamp."""

    token_log_ratio: Tensor
    raw_log_ratio: Tensor
    mask: Tensor
    negative: Tensor
    max_log_ratio: float

    @classmethod
    def of(cls, old_logprobs: Tensor, behavior_logprobs: Tensor, sampled: Tensor, max_log_ratio: float,
           negative: Tensor | None = None) -> CorrectionView:
        """The view of finite (B, T) log π_old and log μ on the `sampled` tokens (`negative` None: no
        trajectory is negative — only OPSM reads it)."""
        raw = torch.where(sampled, old_logprobs.detach().float() - behavior_logprobs.detach().float(), 0.0)
        if negative is None:
            negative = torch.zeros(sampled.shape[0], dtype=torch.bool, device=sampled.device)
        return cls(raw.clamp(-max_log_ratio, max_log_ratio), raw, sampled, negative, max_log_ratio)

    def sequence_log_ratio(self) -> Tensor:
        """(B,) L_i = Σ ℓ_t over `mask`, unclamped (the objective's L_i)."""
        return torch.where(self.mask, self.raw_log_ratio, 0.0).sum(dim=-1)

    def counts(self) -> Tensor:
        """(B,) n_i: the tokens in `mask`."""
        return self.mask.sum(dim=-1)


def _check_band(lower: float, upper: float) -> None:
    if not (0.0 < lower <= 1.0 <= upper and lower < upper and math.isfinite(upper)):
        raise ValueError(f"the kept band [lower={lower}, upper={upper}] must satisfy 0 < lower ≤ 1 ≤ upper "
                         "< ∞ with lower < upper: a band without 1 rejects on-policy tokens (ratio 1)")


def _in_band(log_values: Tensor, lower: float, upper: float) -> Tensor:
    # compared in log space, so a band never overflows: a ≤ e^x ≤ b ⇔ log a ≤ x ≤ log b
    return (log_values >= math.log(lower)) & (log_values <= math.log(upper))


@dataclass(frozen=True)
class TokenTruncation:
    """Token TIS: every kept token weighs min(π_old/μ, cap) (detached). Reference: Yao et al. 2025, "Your
    Efficient RL Framework Secretly Brings You Off-Policy RL Training"."""

    label: ClassVar[str] = "token_tis"
    level: ClassVar[str] = TRUNCATION
    cap: float = 2.0

    def __post_init__(self) -> None:
        if not self.cap > 0:
            raise ValueError(f"token_tis: cap={self.cap} must be > 0")

    def uncapped(self, view: CorrectionView) -> Tensor:
        """(B, T) π_old/μ of each token, before the cap."""
        return view.token_log_ratio.exp()

    def weights(self, view: CorrectionView) -> Tensor:
        """(B, T) the detached weight of every token in `view.mask`, the cap applied; 0 elsewhere."""
        return torch.where(view.mask, self.uncapped(view).clamp(max=self.cap), 0.0)


@dataclass(frozen=True)
class SequenceTruncation:
    """Sequence TIS: every kept token of i weighs min(w_i, cap), w_i = exp(clamp(L_i)) over the kept
    tokens (detached)."""

    label: ClassVar[str] = "seq_tis"
    level: ClassVar[str] = TRUNCATION
    cap: float = 8.0

    def __post_init__(self) -> None:
        if not self.cap > 0:
            raise ValueError(f"seq_tis: cap={self.cap} must be > 0")

    def uncapped(self, view: CorrectionView) -> Tensor:
        """(B, T) w_i on every position of trajectory i, before the cap."""
        log_w = view.sequence_log_ratio().clamp(-view.max_log_ratio, view.max_log_ratio)
        return log_w.exp()[:, None].expand(view.mask.shape)

    def weights(self, view: CorrectionView) -> Tensor:
        """(B, T) the detached weight of every token in `view.mask`, the cap applied; 0 elsewhere."""
        return torch.where(view.mask, self.uncapped(view).clamp(max=self.cap), 0.0)


@dataclass(frozen=True)
class TokenRejection:
    """Token rejection by a ratio band: a token with π_old/μ outside [lower, upper] leaves the mask
    (IcePop's token masking; MIS at token level without its weight)."""

    label: ClassVar[str] = "token_reject"
    level: ClassVar[str] = TOKEN
    lower: float = 0.5
    upper: float = 2.0

    def __post_init__(self) -> None:
        _check_band(self.lower, self.upper)

    def keep(self, view: CorrectionView) -> Tensor:
        return _in_band(view.token_log_ratio, self.lower, self.upper)


@dataclass(frozen=True)
class SequenceRejection:
    """Sequence rejection by a band on the trajectory's IS weight w_i = Π_t π_old/μ (sequence MIS)."""

    label: ClassVar[str] = "seq_reject"
    level: ClassVar[str] = SEQUENCE
    lower: float = 0.125
    upper: float = 8.0

    def __post_init__(self) -> None:
        _check_band(self.lower, self.upper)

    def keep(self, view: CorrectionView) -> Tensor:
        return _in_band(view.sequence_log_ratio(), self.lower, self.upper)


@dataclass(frozen=True)
class GeometricRejection:
    """Sequence rejection by a band on the geometric mean of the token ratios, (Π_t π_old/μ)^(1/n_i):
    length-independent, unlike w_i. Reference: Liu, Li, et al. 2025, "When Speed Kills Stability", part 3
    (geometric-level rejection); SkyRL's `sequence_mask_metric: geometric`."""

    label: ClassVar[str] = "geo_reject"
    level: ClassVar[str] = SEQUENCE
    lower: float = 0.999
    upper: float = 1.001

    def __post_init__(self) -> None:
        _check_band(self.lower, self.upper)

    def keep(self, view: CorrectionView) -> Tensor:
        mean_log = view.sequence_log_ratio() / view.counts().clamp_min(1)
        return _in_band(mean_log, self.lower, self.upper)


K3_REDUCTIONS = ("mean", "sum", "max")


@dataclass(frozen=True)
class K3Rejection:
    """Sequence rejection by the K3 estimate of KL(μ‖π_old): k_t = e^ℓ_t − 1 − ℓ_t ≥ 0 reduced over the
    trajectory's kept tokens (mean, sum or max) must be ≤ threshold. Reference: veRL's seq_*_k3."""

    level: ClassVar[str] = SEQUENCE
    threshold: float = 0.01
    reduce: str = "mean"

    def __post_init__(self) -> None:
        if self.reduce not in K3_REDUCTIONS:
            raise ValueError(f"k3_reject: reduce={self.reduce!r}; valid: {list(K3_REDUCTIONS)}")
        if not self.threshold > 0:
            raise ValueError(f"k3_reject: threshold={self.threshold} must be > 0")

    @property
    def label(self) -> str:
        return "k3_reject" if self.reduce == "mean" else f"k3_reject_{self.reduce}"

    def statistic(self, view: CorrectionView) -> Tensor:
        ell = view.token_log_ratio
        k3 = torch.where(view.mask, ell.exp() - 1.0 - ell, 0.0)
        if self.reduce == "sum":
            return k3.sum(dim=-1)
        if self.reduce == "max":
            return k3.max(dim=-1).values  # k3 ≥ 0 and 0 off the mask: the max over the kept tokens
        return k3.sum(dim=-1) / view.counts().clamp_min(1)

    def keep(self, view: CorrectionView) -> Tensor:
        return self.statistic(view) <= self.threshold


@dataclass(frozen=True)
class OffPolicySequenceMasking:
    """OPSM: drop a trajectory whose reward is below its group's mean (negative group-relative advantage)
    and whose mean per-token log μ/π_old — the k1 estimate of KL(μ‖π_old) — exceeds delta. Pushing such a
    sample's probability further down is what destabilises stale training; positive samples are kept.
    Reference: DeepSeek-AI 2025, "DeepSeek-V3.2" (off-policy sequence masking); slime's
    `compute_opsm_mask`."""

    label: ClassVar[str] = "opsm"
    level: ClassVar[str] = SEQUENCE
    delta: float = 1e-4

    def __post_init__(self) -> None:
        if not self.delta >= 0:
            raise ValueError(f"opsm: delta={self.delta} must be ≥ 0")

    def keep(self, view: CorrectionView) -> Tensor:
        kl = -view.sequence_log_ratio() / view.counts().clamp_min(1)
        return ~(view.negative & (kl > self.delta))


Stage = (TokenTruncation | SequenceTruncation | TokenRejection | SequenceRejection | GeometricRejection
         | K3Rejection | OffPolicySequenceMasking)
"""A stage: a `label` (its metrics' names, unique in a list), a `level`, and `keep` (a rejection: (B, T) bool
for a token stage, (B,) bool for a sequence stage) or `uncapped` and `cap` (the truncation)."""


def check_stages(stages: Sequence[Stage]) -> None:
    """Raise ValueError when `stages` cannot run together: two stages with one label (the second would
    add nothing a band could not say, and their metrics would collide) or more than one truncation."""
    labels = [stage.label for stage in stages]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"corrections {repeated} appear more than once; give each stage once (narrow its "
                         "band instead of repeating it)")
    truncations = [stage.label for stage in stages if stage.level == TRUNCATION]
    if len(truncations) > 1:
        raise ValueError(f"corrections {truncations} both weight the loss; keep one truncation stage")


class Correction(NamedTuple):
    """What the stages did to a minibatch.

    loss_mask: (B, T) bool, the tokens kept (trajectories with non-finite inputs are passed through: the
        objective excludes them). token_weights: (B, T) fp32 detached weight of the truncation stage,
        0 off `loss_mask`; None without one. rejected: (B,) bool, trajectories that had sampled tokens
        and kept none. metrics: name → 0-d tensor, or (STALENESS_HIST_BINS,) per lag bin (`_by_lag`,
        NaN where the bin holds no sampled token).
    """

    loss_mask: Tensor
    token_weights: Tensor | None
    rejected: Tensor
    metrics: dict[str, Tensor]


def _fraction(selected: Tensor, total: Tensor) -> Tensor:
    return selected.sum().float() / total.sum().clamp_min(1).float()


def _by_lag(removed: Tensor, sampled: Tensor, lags: Tensor) -> Tensor:
    """Per staleness bin: the removed share of the bin's sampled tokens (NaN for an empty bin)."""
    bins = staleness_bin(lags)
    removed_count = torch.zeros(STALENESS_HIST_BINS, dtype=torch.float32, device=sampled.device)
    sampled_count = torch.zeros_like(removed_count)
    removed_count.index_add_(0, bins, (removed & sampled).sum(dim=-1).float())
    sampled_count.index_add_(0, bins, sampled.sum(dim=-1).float())
    return torch.where(sampled_count > 0, removed_count / sampled_count.clamp_min(1), math.nan)


def apply_corrections(
    stages: Sequence[Stage],
    old_logprobs: Tensor,
    behavior_logprobs: Tensor,
    loss_mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    lags: Tensor | None = None,
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO,
) -> Correction:
    """Run `stages` (order in the module docstring) on a minibatch; no gradient.

    old_logprobs, behavior_logprobs: (B, T) log π_old, log μ. loss_mask: (B, T) bool sampled tokens.
    rewards: (B,). group_ids: (B,) long. lags: (B,) long, for the per-lag metrics (None skips them).
    The whole minibatch at once: OPSM's group means need every member of a group.
    """
    check_stages(stages)
    with torch.no_grad():
        old, behavior = old_logprobs.detach().float(), behavior_logprobs.detach().float()
        finite_values = torch.isfinite(old) & torch.isfinite(behavior)
        usable = torch.isfinite(rewards) & (finite_values | ~loss_mask).all(dim=-1)
        sampled = loss_mask & usable[:, None]
        safe_rewards = torch.where(usable, rewards.float(), 0.0)
        negative = dr_grpo_advantages(safe_rewards, index_groups(group_ids), usable) < 0
        view = CorrectionView.of(old, behavior, sampled, max_log_ratio, negative)
        metrics: dict[str, Tensor] = {}

        def report(label: str, removed: Tensor) -> None:
            metrics[stage_metric(label, "rejected_tokens")] = _fraction(removed, sampled)
            if lags is not None:
                metrics[stage_metric(label, "rejected_tokens_by_lag")] = _by_lag(removed, sampled, lags)

        kept = sampled
        for stage in (s for s in stages if s.level == TOKEN):
            keep = stage.keep(view) & sampled
            report(stage.label, sampled & ~keep)
            kept = kept & keep
        token_kept = view._replace(mask=kept)
        has_tokens = kept.any(dim=-1)
        for stage in (s for s in stages if s.level == SEQUENCE):
            keep = stage.keep(token_kept) | ~has_tokens  # nothing left to drop
            removed = token_kept.mask & ~keep[:, None]
            report(stage.label, removed)
            present = has_tokens.sum().clamp_min(1).float()
            metrics[stage_metric(stage.label, "rejected_trajectories")] = (~keep).sum().float() / present
            kept = kept & keep[:, None]
        removed = sampled & ~kept
        rejected = sampled.any(dim=-1) & ~kept.any(dim=-1)
        metrics[CORRECTION_REJECTED_TOKENS] = _fraction(removed, sampled)
        with_tokens = sampled.any(dim=-1).sum().clamp_min(1)
        metrics[CORRECTION_REJECTED_TRAJECTORIES] = rejected.sum().float() / with_tokens
        if lags is not None:
            metrics[CORRECTION_REJECTED_BY_LAG] = _by_lag(removed, sampled, lags)
        weights = None
        final = view._replace(mask=kept)
        for stage in (s for s in stages if s.level == TRUNCATION):
            weights = stage.weights(final)
            capped = kept & (stage.uncapped(final) > stage.cap)
            metrics[stage_metric(stage.label, "truncated_tokens")] = _fraction(capped, kept)
            metrics[stage_metric(stage.label, "weight_mean")] = weights.sum() / kept.sum().clamp_min(1)
        passed = loss_mask & ~usable[:, None]  # non-finite rows: left for the objective to exclude
        return Correction(kept | passed, weights, rejected, metrics)


def correct_inputs(
    stages: Sequence[Stage], inputs: PolicyLossInputs, max_log_ratio: float = DEFAULT_MAX_LOG_RATIO
) -> tuple[PolicyLossInputs, Correction]:
    """`inputs` as the objective sees them after `stages`: the kept mask, the truncation's weights and the
    rejected trajectories (`PolicyLossInputs.token_weights`, `.rejected`), with the `Correction`."""
    if inputs.token_weights is not None or inputs.rejected is not None:
        raise ValueError("these inputs were corrected already (token_weights or rejected is set); correct "
                         "the sampled minibatch once, with every stage in one list")
    correction = apply_corrections(stages, inputs.old_logprobs, inputs.behavior_logprobs, inputs.loss_mask,
                                   inputs.rewards, inputs.group_ids, inputs.lags, max_log_ratio)
    corrected = dataclasses.replace(inputs, loss_mask=correction.loss_mask,
                                    token_weights=correction.token_weights, rejected=correction.rejected)
    return corrected, correction
