"""The one interface of every policy objective: inputs, outputs, and the shared pipeline.

An objective is a frozen dataclass of plain hyperparameters and is called on a
`PolicyLossInputs`; it returns a `PolicyLossOutput` (scalar loss, advantages, metrics, counts).
`ObjectiveBase.__call__` runs the steps every objective shares, so each objective only writes
its surrogate:

1. checks that the inputs it declares it needs are present (`needs_*`);
2. sanitises: a trajectory with a non-finite reward or a non-finite logprob on a trained token is
   excluded (mask off, reward 0) and counted — the loss and its gradient stay finite;
3. computes the sequence log-ratio L_i = Σ log π_old − log μ (the behaviour correction every
   objective's IS weights and the is/* metrics use), groups, degenerate groups;
4. calls the objective's `_surrogate`;
5. adds the optional KL-to-reference and entropy terms and the shared metrics.

Ratios: the behaviour correction is always π_old/μ (detached; π_old = the learner's logprobs at
the start of the step, which is π_θ when the step's gradient is taken) and the drift
π_θ/π_old, where an objective uses it, is PPO's clipped ratio — the decoupled PPO split of Hilton
et al. 2022, "Batch size-invariance for policy optimization". Each objective's docstring says which.

Whole prompt groups must be in one call (group statistics, M2PO and BAPO are batch statistics).
With micro-batching, pass `num_units` (the minibatch's global denominator) and sum the losses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor

from vcpo import metrics as m
from vcpo.aggregation import LOSS_AGGREGATIONS, seq_mean_token_sum_norm
from vcpo.groups import GroupIndex, degenerate_groups, index_groups
from vcpo.is_weights import DEFAULT_MAX_LOG_RATIO, sequence_log_ratios
from vcpo.regularizers import KL_ESTIMATORS


@dataclass(frozen=True)
class PolicyLossInputs:
    """Everything an objective may use for one minibatch (B trajectories, T padded positions).

    logprobs: (B, T) log π_θ of the sampled tokens, current policy, with grad.
    old_logprobs: (B, T) log π_old, the proximal policy (learner's recomputed logprobs at the start
        of the step), detached.
    behavior_logprobs: (B, T) log μ the engine reported when sampling each token.
    loss_mask: (B, T) bool, True on model-generated tokens (M_i); prompt and tool tokens are False.
    rewards: (B,) scalar reward R_i.
    group_ids: (B,) long prompt-group id; equal ids were sampled from the same prompt.
    lags: (B,) long policy lag v − v_start, for the staleness metrics; None skips them.
    ref_logprobs: (B, T) log π_ref, for the KL term and TBA; None when not needed.
    seq_sq_grad_norms: (B,) ‖∇_θ ℓ_i‖² of each trajectory's unweighted aggregated log-likelihood,
        over all trainable parameters (VCPO/OPOB); None when not needed.
    sum_probs_squared: (B, T) Σ_v π_old(v|y_<t)², for OTB's logit-gradient proxy; None otherwise.
    entropy: (B, T) entropy of π_θ(·|y_<t) with grad, for the entropy bonus; None otherwise.
    num_units: the aggregation denominator of the whole minibatch (global token count for
        token-mean, global trajectory count otherwise); None = this call's own count.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    behavior_logprobs: Tensor
    loss_mask: Tensor
    rewards: Tensor
    group_ids: Tensor
    lags: Tensor | None = None
    ref_logprobs: Tensor | None = None
    seq_sq_grad_norms: Tensor | None = None
    sum_probs_squared: Tensor | None = None
    entropy: Tensor | None = None
    num_units: float | Tensor | None = None

    def __post_init__(self) -> None:
        if self.logprobs.dim() != 2:
            raise ValueError(f"logprobs must be (B, T), got shape {tuple(self.logprobs.shape)}")
        token_shape = tuple(self.logprobs.shape)
        batch = token_shape[0]
        problems = []
        for name in (
            "old_logprobs",
            "behavior_logprobs",
            "loss_mask",
            "ref_logprobs",
            "sum_probs_squared",
            "entropy",
        ):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != token_shape:
                problems.append(
                    f"{name} has shape {tuple(value.shape)}, expected {token_shape} like logprobs"
                )
        for name in ("rewards", "group_ids", "lags", "seq_sq_grad_norms"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (batch,):
                problems.append(f"{name} has shape {tuple(value.shape)}, expected ({batch},)")
        if self.loss_mask.dtype != torch.bool:
            problems.append(f"loss_mask must be bool, got {self.loss_mask.dtype}; pass loss_mask.bool()")
        if self.group_ids.dtype != torch.long:
            problems.append(f"group_ids must be torch.long, got {self.group_ids.dtype}")
        if problems:
            raise ValueError("invalid PolicyLossInputs: " + "; ".join(problems))


class LossCounts(NamedTuple):
    """Counts (0-d long tensors) of what the objective did with the batch.

    trajectories: valid trajectories with at least one trained token.
    nonfinite_trajectories: excluded for a non-finite reward / logprob on a trained token.
    degenerate_groups: groups that are singletons or have all rewards equal (advantage 0).
    trained_tokens: trained tokens of valid trajectories.
    clipped_tokens: tokens a clip acted on — whose gradient a PPO-style clip zeroed (GSPO: every token of
        a clipped trajectory), or whose IS weight CISPO held at a bound (the gradient is kept).
    masked_tokens: tokens a stabilizer dropped.
    baseline_fallbacks: baseline cells (OPOB groups, OTB group×position) with zero total weight.
    nonfinite_grad_norms: trajectories whose squared gradient norm was non-finite (OPOB weight 0).
    """

    trajectories: Tensor
    nonfinite_trajectories: Tensor
    degenerate_groups: Tensor
    trained_tokens: Tensor
    clipped_tokens: Tensor
    masked_tokens: Tensor
    baseline_fallbacks: Tensor
    nonfinite_grad_norms: Tensor


@dataclass(frozen=True)
class PolicyLossOutput:
    """loss: 0-d scalar to minimise (finite). advantages: (B, T) fp32, 0 off trained tokens.
    metrics: metric name → tensor (names in vcpo.metrics). counts: see `LossCounts`.
    log_is_weights: (B,) L_i = Σ log π_old − log μ (0 for excluded trajectories), for the ESS rule.
    valid: (B,) bool, trajectories that entered the loss (gather both across ranks for ESS)."""

    loss: Tensor
    advantages: Tensor
    metrics: dict[str, Tensor]
    counts: LossCounts
    log_is_weights: Tensor
    valid: Tensor


@runtime_checkable
class Objective(Protocol):
    """What the learner relies on: a name, declared needs, and a call."""

    name: ClassVar[str]

    @property
    def needs_grad_norms(self) -> bool: ...

    @property
    def needs_ref_logprobs(self) -> bool: ...

    @property
    def needs_sum_probs_squared(self) -> bool: ...

    @property
    def needs_entropy(self) -> bool: ...

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput: ...


class PreparedBatch(NamedTuple):
    """Sanitised inputs: tensors are finite, zero off `loss_mask`, and invalid trajectories are
    masked out. Shapes as in `PolicyLossInputs`; `rewards` is fp32 and 0 for invalid trajectories.

    valid: (B,) bool. groups: dense prompt groups. is_degenerate: (B,) bool member of a degenerate
    group. seq_log_ratios: (B,) L_i = Σ log π_old − log μ (fp32, unclamped, 0 if invalid).
    """

    logprobs: Tensor
    old_logprobs: Tensor
    behavior_logprobs: Tensor
    loss_mask: Tensor
    rewards: Tensor
    valid: Tensor
    groups: GroupIndex
    is_degenerate: Tensor
    num_degenerate_groups: Tensor
    seq_log_ratios: Tensor
    ref_logprobs: Tensor | None
    seq_sq_grad_norms: Tensor | None
    sum_probs_squared: Tensor | None
    entropy: Tensor | None
    lags: Tensor | None
    num_units: float | Tensor | None


class Surrogate(NamedTuple):
    """What an objective's `_surrogate` returns.

    loss: 0-d policy loss. advantages: (B, T) or (B,) advantages (broadcast over tokens).
    clipped, masked: (B, T) bool tokens a clip acted on (see `LossCounts.clipped_tokens`) / dropped by
        a mask, or None.
    metrics: extra objective-specific metrics. baseline_fallbacks, nonfinite_grad_norms: 0-d counts.
    """

    loss: Tensor
    advantages: Tensor
    clipped: Tensor | None = None
    masked: Tensor | None = None
    metrics: dict[str, Tensor] | None = None
    baseline_fallbacks: Tensor | None = None
    nonfinite_grad_norms: Tensor | None = None


def _finite_on_mask(values: Tensor, mask: Tensor) -> Tensor:
    """(B,) bool: every trained entry of the (B, T) `values` is finite."""
    return (torch.isfinite(values.detach()) | ~mask).all(dim=-1)


def _zero_off(values: Tensor | None, mask: Tensor) -> Tensor | None:
    """Entries off `mask` → 0, without letting NaN there reach the loss or the gradient."""
    return None if values is None else torch.where(mask, values, torch.zeros_like(values))


def prepare_batch(
    inputs: PolicyLossInputs, use_ref: bool, use_sum_probs: bool, use_entropy: bool
) -> PreparedBatch:
    """Sanitise `inputs` (see module docstring). The `use_*` flags say which optional tensors count."""
    mask = inputs.loss_mask
    valid = torch.isfinite(inputs.rewards)
    checked = [
        (inputs.logprobs, True),
        (inputs.old_logprobs, True),
        (inputs.behavior_logprobs, True),
        (inputs.ref_logprobs, use_ref),
        (inputs.sum_probs_squared, use_sum_probs),
        (inputs.entropy, use_entropy),
    ]
    for values, used in checked:
        if used and values is not None:
            valid = valid & _finite_on_mask(values, mask)
    mask = mask & valid[:, None]
    rewards = torch.where(
        valid, inputs.rewards.float(), torch.zeros_like(inputs.rewards, dtype=torch.float32)
    )
    old_logprobs = _zero_off(inputs.old_logprobs.detach(), mask)
    behavior_logprobs = _zero_off(inputs.behavior_logprobs.detach(), mask)
    groups = index_groups(inputs.group_ids)
    degenerate = degenerate_groups(rewards, valid, groups)
    return PreparedBatch(
        logprobs=_zero_off(inputs.logprobs.float(), mask),  # fp32 ratios and IS weights
        old_logprobs=old_logprobs,
        behavior_logprobs=behavior_logprobs,
        loss_mask=mask,
        rewards=rewards,
        valid=valid,
        groups=groups,
        is_degenerate=degenerate[groups.index] & valid,
        num_degenerate_groups=degenerate.sum(),
        seq_log_ratios=sequence_log_ratios(old_logprobs, behavior_logprobs, mask),
        ref_logprobs=_zero_off(None if inputs.ref_logprobs is None else inputs.ref_logprobs.detach(), mask),
        seq_sq_grad_norms=inputs.seq_sq_grad_norms,
        sum_probs_squared=_zero_off(inputs.sum_probs_squared, mask),
        entropy=_zero_off(inputs.entropy, mask),
        lags=inputs.lags,
        num_units=inputs.num_units,
    )


@dataclass(frozen=True)
class ObjectiveBase:
    """Shared options and pipeline. Subclasses set `name`, declare needs, implement `_surrogate`.

    loss_aggregation: one of `vcpo.aggregation.LOSS_AGGREGATIONS`.
    token_sum_normalizer: N of seq-mean-token-sum-norm (None = T); only with that mode.
    kl_coef: weight of the KL(π_θ‖π_ref) term (0 = off; > 0 needs ref_logprobs).
    kl_estimator: "k1", "k2" or "k3" (see regularizers.py).
    entropy_coef: weight of the entropy bonus (0 = off; > 0 needs `entropy`).
    max_log_ratio: clamp of log-ratios before exp.
    """

    name: ClassVar[str] = ""
    uses_grad_norms: ClassVar[bool] = False
    uses_ref_logprobs: ClassVar[bool] = False
    uses_sum_probs_squared: ClassVar[bool] = False

    loss_aggregation: str = "token-mean"
    token_sum_normalizer: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    max_log_ratio: float = field(default=DEFAULT_MAX_LOG_RATIO)

    def __post_init__(self) -> None:
        problems = list(self._check_options())
        if self.loss_aggregation not in LOSS_AGGREGATIONS:
            problems.append(f"loss_aggregation={self.loss_aggregation!r}; valid: {sorted(LOSS_AGGREGATIONS)}")
        if self.token_sum_normalizer is not None and self.loss_aggregation != "seq-mean-token-sum-norm":
            problems.append(
                f"token_sum_normalizer={self.token_sum_normalizer} only applies to "
                f"loss_aggregation='seq-mean-token-sum-norm', not {self.loss_aggregation!r}"
            )
        if self.kl_estimator not in KL_ESTIMATORS:
            problems.append(f"kl_estimator={self.kl_estimator!r}; valid: {sorted(KL_ESTIMATORS)}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            problems.append(f"kl_coef={self.kl_coef} and entropy_coef={self.entropy_coef} must be ≥ 0")
        if self.max_log_ratio <= 0:
            problems.append(f"max_log_ratio={self.max_log_ratio} must be > 0")
        if problems:
            raise ValueError(f"invalid {self.name!r} objective: " + "; ".join(problems))

    def _check_options(self) -> list[str]:
        """Problems with the subclass's own options (empty = fine)."""
        return []

    @property
    def needs_grad_norms(self) -> bool:
        return self.uses_grad_norms

    @property
    def needs_ref_logprobs(self) -> bool:
        return self.uses_ref_logprobs or self.kl_coef > 0

    @property
    def needs_sum_probs_squared(self) -> bool:
        return self.uses_sum_probs_squared

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef > 0

    @property
    def ess_clip_cap(self) -> float:
        """C used for is/ess_ratio_clipped (VCPO.md default 8; objectives with an is_cap use theirs)."""
        return 8.0

    def aggregate(self, token_losses: Tensor, loss_mask: Tensor, num_units: float | Tensor | None) -> Tensor:
        """The configured aggregation of (B, T) per-token losses over the (B, T) bool mask."""
        if self.token_sum_normalizer is not None:
            return seq_mean_token_sum_norm(token_losses, loss_mask, num_units, self.token_sum_normalizer)
        return LOSS_AGGREGATIONS[self.loss_aggregation](token_losses, loss_mask, num_units)

    def _surrogate(self, batch: PreparedBatch) -> Surrogate:
        raise NotImplementedError

    def _check_inputs(self, inputs: PolicyLossInputs) -> None:
        missing = [
            name
            for name, needed in (
                ("seq_sq_grad_norms", self.needs_grad_norms),
                ("ref_logprobs", self.needs_ref_logprobs),
                ("sum_probs_squared", self.needs_sum_probs_squared),
                ("entropy", self.needs_entropy),
            )
            if needed and getattr(inputs, name) is None
        ]
        if missing:
            raise ValueError(
                f"objective {self.name!r} needs PolicyLossInputs.{', '.join(missing)} (None given); "
                "the learner must compute them when objective.needs_* is True"
            )

    def __call__(self, inputs: PolicyLossInputs) -> PolicyLossOutput:
        self._check_inputs(inputs)
        batch = prepare_batch(
            inputs, self.needs_ref_logprobs, self.needs_sum_probs_squared, self.needs_entropy
        )
        surrogate = self._surrogate(batch)
        loss, extra = surrogate.loss, dict(surrogate.metrics or {})
        if self.kl_coef > 0:
            kl = self.aggregate(
                KL_ESTIMATORS[self.kl_estimator](batch.logprobs, batch.ref_logprobs),
                batch.loss_mask,
                batch.num_units,
            )
            loss, extra["loss/kl"] = loss + self.kl_coef * kl, kl.detach()
        if self.entropy_coef > 0:
            entropy = self.aggregate(batch.entropy, batch.loss_mask, batch.num_units)
            loss, extra["loss/entropy"] = loss - self.entropy_coef * entropy, entropy.detach()
        return _assemble_output(self, batch, surrogate, loss, extra)


def _assemble_output(
    objective: ObjectiveBase,
    batch: PreparedBatch,
    surrogate: Surrogate,
    loss: Tensor,
    extra: dict[str, Tensor],
) -> PolicyLossOutput:
    mask = batch.loss_mask
    no_tokens = torch.zeros_like(mask)
    clipped = no_tokens if surrogate.clipped is None else surrogate.clipped & mask
    masked = no_tokens if surrogate.masked is None else surrogate.masked & mask
    advantages = surrogate.advantages.detach().float()
    advantages = advantages[:, None].expand(mask.shape) if advantages.dim() == 1 else advantages
    metrics = {
        **m.is_weight_metrics(
            batch.seq_log_ratios, batch.valid, objective.ess_clip_cap, objective.max_log_ratio
        ),
        m.IS_KL_K3: m.behavior_kl_k3(
            batch.old_logprobs, batch.behavior_logprobs, mask, objective.max_log_ratio
        ),
        m.PG_CLIP_FRAC: m.token_fraction(clipped, mask),
        m.PG_MASKED_FRAC: m.token_fraction(masked, mask),
        m.TOKENS_TRAINED: mask.sum(),
        **m.reward_metrics(batch.rewards, batch.valid),
        m.IS_LOG_W_REWARD_CORR: m.log_w_reward_correlation(batch.seq_log_ratios, batch.rewards, batch.valid),
        "loss/policy": surrogate.loss.detach(),
        **extra,
    }
    if batch.lags is not None:
        metrics.update(m.staleness_metrics(batch.lags, batch.valid))
    zero = torch.zeros((), dtype=torch.long, device=mask.device)
    counts = LossCounts(
        trajectories=(batch.valid & mask.any(dim=-1)).sum(),
        nonfinite_trajectories=(~batch.valid).sum(),
        degenerate_groups=batch.num_degenerate_groups,
        trained_tokens=mask.sum(),
        clipped_tokens=clipped.sum(),
        masked_tokens=masked.sum(),
        baseline_fallbacks=zero if surrogate.baseline_fallbacks is None else surrogate.baseline_fallbacks,
        nonfinite_grad_norms=zero
        if surrogate.nonfinite_grad_norms is None
        else surrogate.nonfinite_grad_norms,
    )
    return PolicyLossOutput(
        loss=loss,
        advantages=torch.where(mask, advantages, torch.zeros_like(advantages)),
        metrics=metrics,
        counts=counts,
        log_is_weights=batch.seq_log_ratios,
        valid=batch.valid,
    )
