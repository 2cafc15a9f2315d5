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

Micro-batching. The loss of several objectives depends on statistics of the WHOLE minibatch (group
means and σ, REINFORCE's batch mean, M2PO's mask, BAPO's bounds, Dr. GRPO's constant N, TBA's log Ẑ and
trajectory count, OTB's token baseline, the aggregation denominator). A learner that back-propagates the
minibatch in micro-batches therefore splits the call in two:

    context = objective.batch_context(whole_minibatch)         # once, no grad, from values only
    for rows, inputs in micro_batches:                         # each back-propagated on its own
        objective(inputs, context.select(rows, width)).loss.backward()

`batch_context` computes every such statistic (`BatchContext`) with no gradient; the per-micro-batch call
then holds them fixed, so the summed gradient is the whole-minibatch gradient however the minibatch is
split. It is exact because a learner takes one optimizer step per minibatch: at the gradient point
log π_θ = log π_old in value, so the learner computes the context from inputs whose `logprobs` are
`old_logprobs`. `objective(inputs)` without a context computes the context from its own inputs — one call
on a whole batch behaves as it always has.
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
        token-mean, global trajectory count otherwise); None = this call's own count. Read by
        `batch_context`; a call given a context takes the context's.
    token_weights: (B, T) detached weights of a truncation correction (`vcpo.corrections`), multiplied
        into the per-token policy loss; None = 1. Only objectives without a behaviour weight of their own
        take them (`accepts_token_weights`).
    rejected: (B,) bool, trajectories a correction rejected whole (no token left in `loss_mask`): they
        keep their place in the group statistics and weigh 0 in the ESS; None = none.
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
    token_weights: Tensor | None = None
    rejected: Tensor | None = None

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
            "token_weights",
        ):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != token_shape:
                problems.append(
                    f"{name} has shape {tuple(value.shape)}, expected {token_shape} like logprobs"
                )
        for name in ("rewards", "group_ids", "lags", "seq_sq_grad_norms", "rejected"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (batch,):
                problems.append(f"{name} has shape {tuple(value.shape)}, expected ({batch},)")
        if self.loss_mask.dtype != torch.bool:
            problems.append(f"loss_mask must be bool, got {self.loss_mask.dtype}; pass loss_mask.bool()")
        if self.rejected is not None and self.rejected.dtype != torch.bool:
            problems.append(f"rejected must be bool, got {self.rejected.dtype}")
        if self.group_ids.dtype != torch.long:
            problems.append(f"group_ids must be torch.long, got {self.group_ids.dtype}")
        if problems:
            raise ValueError("invalid PolicyLossInputs: " + "; ".join(problems))


ADVANTAGES = "advantages"
"""`BatchContext.rows` key of the advantages (per trajectory (B,), or per token (B, T) for OTB) that an
objective computes from the whole minibatch (group means and σ, baselines)."""


class BatchContext(NamedTuple):
    """What an objective's loss takes from the whole minibatch: values only, no gradient (module docstring).

    size: B, the trajectories the context has rows for.
    num_units: 0-d aggregation denominator (global token count for token-mean, trajectory count
        otherwise) — `PolicyLossInputs.num_units` when given, else the minibatch's own count.
    token_sum_normalizer: N of seq-mean-token-sum-norm: the objective's option, else the width T of the
        minibatch's (B, T) tensors (in the learner: its longest trained length).
    rows: name → (B,) or (B, T) values, row i belonging to trajectory i (advantages, M2PO's kept-token
        mask, TBA's log Ẑ of the trajectory's group, OTB's per-token advantages).
    shared: name → 0-d batch-wide values (BAPO's bounds, TBA's trajectory count) and the batch-wide
        statistics the objective reports as metrics.
    """

    size: int
    num_units: Tensor
    token_sum_normalizer: float
    rows: dict[str, Tensor]
    shared: dict[str, Tensor]

    def select(self, rows: Tensor, width: int) -> BatchContext:
        """The context of a micro-batch: its trajectories' rows (`rows` (n,) long, in the micro-batch's
        order), per-token values cut or zero-padded to its `width` columns; batch-wide values unchanged.
        Cutting is right for the learner's layout, where each row holds its trained tokens left-aligned
        (a micro-batch's width is its longest trained length, at most the minibatch's)."""
        selected = {}
        for name, values in self.rows.items():
            picked = values[rows]
            if picked.dim() == 2:
                picked = picked[:, :width]
                if picked.shape[1] < width:
                    picked = torch.nn.functional.pad(picked, (0, width - picked.shape[1]))
            selected[name] = picked
        return self._replace(size=int(rows.numel()), rows=selected)


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
    log_is_weights: (B,) L_i = Σ log π_old − log μ (0 for excluded trajectories, −inf for rejected ones:
    w = 0), for the ESS rule.
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

    @property
    def silent_when_degenerate(self) -> bool: ...

    def batch_context(self, inputs: PolicyLossInputs) -> BatchContext: ...

    def __call__(self, inputs: PolicyLossInputs, context: BatchContext | None = None) -> PolicyLossOutput: ...

    def regularizer_loss(self, inputs: PolicyLossInputs, context: BatchContext) -> Tensor: ...


class PreparedBatch(NamedTuple):
    """Sanitised inputs: tensors are finite, zero off `loss_mask`, and invalid trajectories are
    masked out. Shapes as in `PolicyLossInputs`; `rewards` is fp32 and 0 for invalid trajectories.

    valid: (B,) bool. groups: dense prompt groups. is_degenerate: (B,) bool member of a degenerate
    group. seq_log_ratios: (B,) L_i = Σ log π_old − log μ (fp32, unclamped, 0 if invalid).
    token_weights: (B, T) a correction's detached weights, 0 off the mask, or None. rejected: (B,) bool,
    valid trajectories a correction rejected whole.
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
    token_weights: Tensor | None
    rejected: Tensor


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
    weights = inputs.token_weights
    token_weights = None if weights is None else _zero_off(weights.detach().float(), mask)
    rejected = valid & (torch.zeros_like(valid) if inputs.rejected is None else inputs.rejected)
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
        token_weights=token_weights,
        rejected=rejected,
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
    takes_token_weights: ClassVar[bool] = False
    silent_degenerate_groups: ClassVar[bool] = False
    """The policy loss is linear in a group-relative advantage that is exactly 0 for every member of a
    degenerate group (all alike, or a singleton: `vcpo.advantages._finalize`), so such a group adds exactly
    nothing to the gradient — with no KL or entropy term (`silent_when_degenerate`). Checked per objective
    by tests/vcpo/test_objectives.py."""

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
    def silent_when_degenerate(self) -> bool:
        """Whether a degenerate group's gradient is exactly 0 here (the learner then leaves it out of the
        gradient pass): the objective's policy loss says so, and no KL or entropy term adds one."""
        return self.silent_degenerate_groups and self.kl_coef == 0 and self.entropy_coef == 0

    @property
    def accepts_token_weights(self) -> bool:
        """Whether a truncation correction's weights (`PolicyLossInputs.token_weights`) may multiply this
        objective's per-token policy loss: not where the objective weighs the loss by its own behaviour
        ratio (the sample would be corrected twice) or has no per-token policy loss (TBA)."""
        return self.takes_token_weights

    def weighted(self, token_losses: Tensor, batch: PreparedBatch) -> Tensor:
        """(B, T) per-token policy losses × the correction's detached token weights, where given."""
        return token_losses if batch.token_weights is None else token_losses * batch.token_weights

    @property
    def ess_clip_cap(self) -> float:
        """C used for is/ess_ratio_clipped (8, docs/algorithm.md; an objective's own is_cap if it has one)."""
        return 8.0

    def aggregate(self, token_losses: Tensor, loss_mask: Tensor, context: BatchContext) -> Tensor:
        """The configured aggregation of (B, T) per-token losses over the (B, T) bool mask, with the
        minibatch's denominator and N from `context`."""
        if self.loss_aggregation == "seq-mean-token-sum-norm":
            return seq_mean_token_sum_norm(
                token_losses, loss_mask, context.num_units, context.token_sum_normalizer
            )
        return LOSS_AGGREGATIONS[self.loss_aggregation](token_losses, loss_mask, context.num_units)

    def _statistics(self, batch: PreparedBatch) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """(rows, shared) of `BatchContext`: the objective's statistics of the whole `batch`, from
        values only (run under no_grad). Where an objective uses log π_θ here, the learner's context
        gives it log π_old, the same value at the gradient point."""
        return {}, {}

    def _surrogate(self, batch: PreparedBatch, context: BatchContext) -> Surrogate:
        """The policy loss of `batch` (the whole minibatch or a micro-batch of it), taking every
        batch-wide statistic from `context`."""
        raise NotImplementedError

    def _prepare(self, inputs: PolicyLossInputs) -> PreparedBatch:
        needs = (self.needs_ref_logprobs, self.needs_sum_probs_squared, self.needs_entropy)
        return prepare_batch(inputs, *needs)

    def _context(self, batch: PreparedBatch) -> BatchContext:
        mask = batch.loss_mask
        if batch.num_units is not None:
            num_units = torch.as_tensor(batch.num_units, device=mask.device)
        elif self.loss_aggregation == "token-mean":
            num_units = mask.sum()
        else:  # the sequence-mean modes count the trajectories with a trained token
            num_units = mask.any(dim=-1).sum()
        normalizer = self.token_sum_normalizer
        with torch.no_grad():
            rows, shared = self._statistics(batch)
        return BatchContext(
            size=int(mask.shape[0]),
            num_units=num_units,
            token_sum_normalizer=float(mask.shape[-1]) if normalizer is None else float(normalizer),
            rows=rows,
            shared=shared,
        )

    def batch_context(self, inputs: PolicyLossInputs) -> BatchContext:
        """The statistics of the whole minibatch `inputs` that every micro-batch's loss holds fixed
        (module docstring). A learner passes `logprobs = old_logprobs` (the value of log π_θ at its
        gradient point) and the minibatch's `num_units`."""
        self._check_inputs(inputs)
        with torch.no_grad():
            return self._context(self._prepare(inputs))

    def _add_regularizers(
        self, loss: Tensor, batch: PreparedBatch, context: BatchContext
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """loss + kl_coef · agg(KL) − entropy_coef · agg(H) (each term only when its coefficient is > 0),
        and the terms' metrics."""
        metrics = {}
        if self.kl_coef > 0:
            kl = self.aggregate(
                KL_ESTIMATORS[self.kl_estimator](batch.logprobs, batch.ref_logprobs), batch.loss_mask, context
            )
            loss, metrics["loss/kl"] = loss + self.kl_coef * kl, kl.detach()
        if self.entropy_coef > 0:
            entropy = self.aggregate(batch.entropy, batch.loss_mask, context)
            loss, metrics["loss/entropy"] = loss - self.entropy_coef * entropy, entropy.detach()
        return loss, metrics

    def regularizer_loss(self, inputs: PolicyLossInputs, context: BatchContext) -> Tensor:
        """The KL and entropy terms of the loss alone, for a learner that forms the policy-gradient term
        itself (VCPO's two-buffer gradient) and back-propagates these per micro-batch. Does not need
        `seq_sq_grad_norms`; 0-d zero when kl_coef = entropy_coef = 0."""
        missing = [name for name, needed in (("ref_logprobs", self.kl_coef > 0),
                                             ("entropy", self.entropy_coef > 0))
                   if needed and getattr(inputs, name) is None]
        if missing:
            raise ValueError(f"objective {self.name!r} needs PolicyLossInputs.{', '.join(missing)} for its "
                             "regularizers (None given)")
        self._check_context(inputs, context)
        batch = self._prepare(inputs)
        return self._add_regularizers(torch.zeros((), device=batch.loss_mask.device), batch, context)[0]

    @staticmethod
    def _check_context(inputs: PolicyLossInputs, context: BatchContext) -> None:
        if context.size != inputs.logprobs.shape[0]:
            raise ValueError(
                f"the context has {context.size} rows but the inputs {inputs.logprobs.shape[0]} "
                "trajectories; pass context.select(rows, width) for a micro-batch"
            )

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
        if inputs.token_weights is not None and not self.accepts_token_weights:
            raise ValueError(
                f"objective {self.name!r} does not take a truncation correction's token_weights: it weighs "
                "its loss by a behaviour ratio of its own (or has no per-token policy loss); drop the "
                "truncation stage or use an objective without one (grpo, dr_grpo, reinforce, rloo)"
            )

    def __call__(self, inputs: PolicyLossInputs, context: BatchContext | None = None) -> PolicyLossOutput:
        """The loss of `inputs`. `context`: the whole minibatch's statistics (`batch_context`, `select`ed
        to these rows) when `inputs` is a micro-batch of it; None = `inputs` is the whole batch."""
        self._check_inputs(inputs)
        batch = self._prepare(inputs)
        if context is None:
            context = self._context(batch)
        else:
            self._check_context(inputs, context)
        surrogate = self._surrogate(batch, context)
        loss, extra = self._add_regularizers(surrogate.loss, batch, context)
        return _assemble_output(self, batch, surrogate, loss, {**(surrogate.metrics or {}), **extra})


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
            batch.seq_log_ratios, batch.valid, objective.ess_clip_cap, objective.max_log_ratio, batch.rejected
        ),
        m.IS_KL_K3: m.behavior_kl_k3(
            batch.old_logprobs, batch.behavior_logprobs, mask, objective.max_log_ratio
        ),
        m.PG_CLIP_FRAC: m.token_fraction(clipped, mask),
        m.PG_MASKED_FRAC: m.token_fraction(masked, mask),
        m.TOKENS_TRAINED: mask.sum(),
        **m.reward_metrics(batch.rewards, batch.valid),
        m.IS_LOG_W_REWARD_CORR: m.log_w_reward_correlation(
            batch.seq_log_ratios, batch.rewards, batch.valid & ~batch.rejected
        ),
        "loss/policy": surrogate.loss.detach(),
        **extra,
    }
    if batch.lags is not None:
        metrics.update(m.staleness_metrics(batch.lags, batch.valid))
        token_k3 = m.trajectory_kl_k3(batch.old_logprobs, batch.behavior_logprobs, mask,
                                      objective.max_log_ratio)
        weighed = batch.valid if batch.rejected is None else batch.valid & ~batch.rejected
        metrics.update(m.behavior_ratio_by_lag(batch.seq_log_ratios, token_k3, batch.lags, weighed))
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
        # a rejected trajectory weighs w = 0 in the ESS: B_valid samples, fewer of them count
        log_is_weights=torch.where(batch.rejected, -torch.inf, batch.seq_log_ratios),
        valid=batch.valid,
    )
