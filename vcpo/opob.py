"""VCPO part 2: the off-policy optimal baseline (OPOB) and VCPO's per-trajectory coefficients.

For ĝ(b) = Σ_i w_i (R_i − b) ∇ℓ_i the scalar minimising the second moment Σ_i w_i²(R_i − b)²‖∇ℓ_i‖²
(the variance of the single-sample estimator drawn from the batch) is the closed form

    b* = Σ_i ω_i R_i / Σ_i ω_i,    ω_i = w_i² ‖∇ℓ_i‖²          (Huang et al. 2026, arXiv:2602.17616)

per prompt group (default) or per minibatch. The IS factor appears exactly once in each place:
‖∇ℓ_i‖² is the norm of the *unweighted* gradient of trajectory i's aggregated log-likelihood ℓ_i,
w_i² enters only ω_i, and the gradient estimator multiplies by w̄_i only once:

    ĝ = (1/B) Σ_i w̄_i (R_i − b*_g) / σ_g · ∇ℓ_i.

(The reference code's trap: its per-trajectory gradient already carries w̄_i, so using that
gradient's norm together with w_i² weights trajectories by w_i²w̄_i² ≈ w_i⁴.)

Robust aggregations replace the weighted mean: a weighted median, or a mean with winsorized ω.
When a group's total baseline weight is 0 (all norms or weights zero) b* falls back to the group's
mean reward, and the fallback is reported. Members of degenerate groups (singletons, all rewards
equal) get advantage and coefficients exactly 0.

Deliberately not here: computing the gradient norms (the learner's job: per-trajectory backward or
hooks on packed micro-batches) and any reduction across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from vcpo.groups import GroupIndex, group_count, group_mean, group_sum


class GroupBaseline(NamedTuple):
    """A per-group baseline.

    per_group: (G,) fp64 b*_g. per_trajectory: (B,) fp64 b*_{g(i)}.
    is_fallback: (G,) bool, groups whose total baseline weight was 0 (b* = group mean reward).
    """

    per_group: Tensor
    per_trajectory: Tensor
    is_fallback: Tensor


class TwoBufferCoefficients(NamedTuple):
    """Coefficients of the two-buffer learner: A += a_i ∇ℓ_i, S += s_i ∇ℓ_i, then A −= b*_g S.

    reward_coef: (B,) a_i = w̄_i R_i / (σ_g B). baseline_coef: (B,) s_i = w̄_i / (σ_g B).
    Both are exactly 0 for invalid trajectories and members of degenerate groups.
    """

    reward_coef: Tensor
    baseline_coef: Tensor


def opob_baseline_weights(
    sq_grad_norms: Tensor,
    is_weights: Tensor | None = None,
    num_tokens: Tensor | None = None,
) -> Tensor:
    """ω_i = w_i² ‖∇ℓ_i‖² [/ |M_i|²] → (B,) fp64; 0 where the product is non-finite or negative.

    sq_grad_norms: (B,) ‖∇_θ ℓ_i‖² of the UNWEIGHTED aggregated log-likelihood of trajectory i, over
        all trainable parameters (summed across shards by the caller).
    is_weights: (B,) w_i (or w̄_i to use clipped weights in b*); None = on-policy optimal baseline
        (ω_i = ‖∇ℓ_i‖²).
    num_tokens: (B,) |M_i|; when given ω_i is divided by |M_i|² (e.g. norms of a token-sum ℓ_i
        turned into norms of a token-mean ℓ_i).
    """
    weights = sq_grad_norms.detach().double()
    if is_weights is not None:
        w = is_weights.detach().double()
        weights = w * w * weights  # docs/algorithm.md: b* weight w_i² ‖∇ℓ_i‖² (the only place w² appears)
    if num_tokens is not None:
        length = num_tokens.detach().double().clamp_min(1.0)
        weights = weights / (length * length)  # option: divide the weight by |M_i|²
    usable = torch.isfinite(weights) & (weights >= 0)
    return torch.where(usable, weights, torch.zeros_like(weights))


def _with_fallback(
    candidate: Tensor, total_weight: Tensor, rewards: Tensor, valid: Tensor, groups: GroupIndex
) -> GroupBaseline:
    """b*_g = candidate where the group's Σω > 0, else the group's mean reward."""
    is_fallback = (total_weight <= 0) & (group_count(valid, groups) > 0)
    mean_reward = group_mean(rewards.double(), valid, groups)
    per_group = torch.where(total_weight > 0, candidate, mean_reward)
    return GroupBaseline(per_group, per_group[groups.index], is_fallback)


def weighted_mean_baseline(
    rewards: Tensor, baseline_weights: Tensor, valid: Tensor, groups: GroupIndex
) -> GroupBaseline:
    """b*_g = Σ_{i∈g} ω_i R_i / Σ_{i∈g} ω_i (the closed-form OPOB; docs/algorithm.md).

    rewards: (B,) R_i. baseline_weights: (B,) ω_i from `opob_baseline_weights`.
    valid: (B,) bool, trajectories that count (others get ω = 0). groups: the baseline's scope
    (prompt groups, or `single_group` for the minibatch scope).
    """
    omega = torch.where(
        valid, baseline_weights.double(), torch.zeros_like(baseline_weights, dtype=torch.float64)
    )
    rewards64 = torch.where(valid, rewards.double(), torch.zeros_like(omega))
    total = group_sum(omega, groups)
    # b*_g = Σ_i w_i² ‖∇ℓ_i‖² R_i / Σ_i w_i² ‖∇ℓ_i‖²
    candidate = group_sum(omega * rewards64, groups) / torch.where(total > 0, total, torch.ones_like(total))
    return _with_fallback(candidate, total, rewards64, valid, groups)


def _sort_within_groups(keys: Tensor, groups: GroupIndex) -> Tensor:
    """Permutation (B,) sorting by group, then by `keys` ascending inside each group (stable)."""
    by_key = torch.argsort(keys, stable=True)
    return by_key[torch.argsort(groups.index[by_key], stable=True)]


def _group_starts(groups: GroupIndex) -> Tensor:
    """(G,) position of each group's first member in the group-sorted order."""
    sizes = torch.bincount(groups.index, minlength=groups.num_groups)
    return torch.cumsum(sizes, 0) - sizes


def weighted_median_baseline(
    rewards: Tensor, baseline_weights: Tensor, valid: Tensor, groups: GroupIndex
) -> GroupBaseline:
    """b*_g = lower weighted median of the group's rewards under weights ω (robust to one huge ω).

    The lower weighted median is the smallest R_(j) (rewards sorted ascending) whose cumulative
    weight reaches half of the group's total weight. Arguments as in `weighted_mean_baseline`.
    """
    omega = torch.where(
        valid, baseline_weights.double(), torch.zeros_like(baseline_weights, dtype=torch.float64)
    )
    rewards64 = torch.where(valid, rewards.double(), torch.zeros_like(omega))
    order = _sort_within_groups(rewards64, groups)
    sorted_rewards, sorted_omega, sorted_group = rewards64[order], omega[order], groups.index[order]
    total = group_sum(omega, groups)
    offset = torch.cumsum(total, 0) - total  # weight of all earlier groups in the sorted order
    cumulative = torch.cumsum(sorted_omega, 0) - offset[sorted_group]
    reached = (cumulative >= 0.5 * total[sorted_group]) & (sorted_omega > 0)
    batch_size = rewards.numel()
    position = torch.arange(batch_size, device=rewards.device)
    first = torch.full((groups.num_groups,), batch_size, dtype=torch.long, device=rewards.device)
    first = first.scatter_reduce(0, sorted_group, torch.where(reached, position, batch_size), "amin")
    candidate = sorted_rewards[first.clamp(max=max(batch_size - 1, 0))]
    return _with_fallback(candidate, total, rewards64, valid, groups)


def winsorized_mean_baseline(
    rewards: Tensor,
    baseline_weights: Tensor,
    valid: Tensor,
    groups: GroupIndex,
    upper_quantile: float = 0.75,
) -> GroupBaseline:
    """b*_g = weighted mean with ω winsorized: ω_i ← min(ω_i, q-quantile of ω in its group).

    The heavy tail of OPOB is in ω = w²‖∇ℓ‖², not in the (bounded) rewards, so the weights are what
    gets winsorized. The quantile is the "lower" one: the sorted valid weight at index
    floor(q·(n_g − 1)). Other arguments as in `weighted_mean_baseline`.
    """
    if not 0.0 <= upper_quantile <= 1.0:
        raise ValueError(f"upper_quantile={upper_quantile} must be in [0, 1]")
    omega = torch.where(
        valid, baseline_weights.double(), torch.zeros_like(baseline_weights, dtype=torch.float64)
    )
    # Invalid members sort first (key −1 < any ω ≥ 0), so a group's valid weights are its last n_valid.
    order = _sort_within_groups(torch.where(valid, omega, torch.full_like(omega, -1.0)), groups)
    members = torch.bincount(groups.index, minlength=groups.num_groups)
    n_valid = group_count(valid, groups).long()
    rank = torch.floor(upper_quantile * (n_valid - 1).clamp_min(0).double()).long()
    position = _group_starts(groups) + (members - n_valid) + rank
    cap = omega[order][position.clamp(0, max(rewards.numel() - 1, 0))]
    return weighted_mean_baseline(rewards, torch.minimum(omega, cap[groups.index]), valid, groups)


BASELINE_AGGREGATIONS = {
    "weighted_mean": weighted_mean_baseline,
    "weighted_median": weighted_median_baseline,
    "winsorized_mean": winsorized_mean_baseline,
}
"""How b* combines a group's rewards, by name (docs/algorithm.md: weighted mean is the default)."""


def opob_advantages(
    rewards: Tensor,
    baseline: Tensor,
    group_std: Tensor,
    keep: Tensor,
    divide_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """A_i = (R_i − b*_g) / (σ_g + ε) (or R_i − b*_g without divide_by_std) → (B,) fp32.

    rewards: (B,) R_i. baseline: (B,) b*_{g(i)}. group_std: (B,) σ_{g(i)}.
    keep: (B,) bool, False for invalid trajectories and members of degenerate groups: their
        advantage is exactly 0 (never 0/0).
    """
    centred = rewards.double() - baseline.double()
    if divide_by_std:
        centred = centred / (group_std.double() + eps)  # docs/algorithm.md: (R_i − b*_g) / σ_g
    return torch.where(keep, centred, torch.zeros_like(centred)).float()


def vcpo_coefficients(
    truncated_weights: Tensor,
    rewards: Tensor,
    group_std: Tensor,
    keep: Tensor,
    batch_size: int | Tensor,
    divide_by_std: bool = True,
    eps: float = 1e-6,
) -> TwoBufferCoefficients:
    """a_i = w̄_i R_i / (σ_g B), s_i = w̄_i / (σ_g B) for the exact two-buffer learner.

    With A = Σ a_i ∇ℓ_i and S = Σ s_i ∇ℓ_i accumulated per group, A − b*_g S equals
    (1/B) Σ w̄_i (R_i − b*_g)/σ_g ∇ℓ_i: the IS factor w̄_i appears here once, and b* needs only the
    unweighted norms. truncated_weights: (B,) w̄_i. rewards: (B,) R_i. group_std: (B,) σ_{g(i)}.
    keep: (B,) bool as in `opob_advantages`. batch_size: B, the global minibatch size.
    """
    scale = truncated_weights.detach().double() / torch.as_tensor(batch_size, dtype=torch.float64)
    if divide_by_std:
        scale = scale / (group_std.double() + eps)
    scale = torch.where(keep, scale, torch.zeros_like(scale))
    # a_i = w̄_i R_i / (σ_g B),  s_i = w̄_i / (σ_g B)
    return TwoBufferCoefficients(reward_coef=scale * rewards.double(), baseline_coef=scale)


def vcpo_loss(seq_logliks: Tensor, truncated_weights: Tensor, advantages: Tensor, valid: Tensor) -> Tensor:
    """−(1/B) Σ_i w̄_i A_i ℓ_i, whose gradient is VCPO's ĝ when A_i = (R_i − b*_g)/σ_g → 0-d.

    seq_logliks: (B,) ℓ_i, each trajectory's aggregated log-likelihood (with grad; default the mean
        log π over M_i). truncated_weights: (B,) w̄_i (detached inside). advantages: (B,) from
        `opob_advantages`. valid: (B,) bool; B counts the valid trajectories.
    """
    coefficient = (truncated_weights.detach().float() * advantages.float()).to(seq_logliks.dtype)
    loglik = torch.where(valid, seq_logliks, torch.zeros_like(seq_logliks))
    count = valid.sum().clamp_min(1).to(seq_logliks.dtype)
    # docs/algorithm.md: ĝ = (1/B) Σ_i w̄_i (R_i − b*_g)/σ_g ∇ℓ_i  (loss = −that objective)
    return -(coefficient * loglik).sum() / count


# ---------------------------------------------------------------------------------------------
# The reference form: the authors' code (mit-han-lab/vcpo), exactly.
#
# Their learner back-propagates, per trajectory, the loss w̄_i · ℓ_i / B with advantage 1 and reads
# that gradient's norm rescaled by the response length: ‖w̄_i ∇_θ Σ_t log π_θ(y_t)‖
# (`megatron_actor._compute_grad_norms`). `compute_opob_baseline` then multiplies its square by the
# sequence IS weight squared again, so a trajectory's baseline weight is
#
#     ω_i = w̄_i² · w_i² · ‖∇_θ Σ_t log π_θ(y_t)‖²            (w_i unclipped by default)
#
# and b_g = Σ ω R / (Σ ω + 1e-8). The advantage divides by the group's population std (no Bessel,
# no ε) only where σ_g > 1e-8 (`_update_grad_buffers`: otherwise R − b undivided). The spec form
# above counts w_i² once against the unweighted mean-token gradient; the paper's numbers come from
# this one, which is why both are offered (`form` of the VCPO objective).

OPOB_FORMS = ("spec", "reference")
REFERENCE_AGGREGATION_MODES = {"seq-mean-token-mean": "length", "seq-mean-token-sum": "one"}
"""Loss aggregations the reference form supports, and the factor c_i with Σ_t log π = c_i ℓ_i."""
"""`spec`: ω_i = w_i² ‖∇ℓ_i‖² (docs/algorithm.md). `reference`: the authors' code,
ω_i = w̄_i² w_i² ‖∇Σ_t log π‖²."""

REFERENCE_EPS = 1e-8
"""The authors' ε: in b's denominator and as the σ floor below which the advantage is not divided."""

REFERENCE_WINSOR_QUANTILES = (0.05, 0.95)
"""`get_weighted_winsorized_mean`: rewards clipped to these weighted quantiles."""


def reference_loglik_scale(loss_aggregation: str, num_tokens: Tensor) -> Tensor:
    """(B,) c_i with Σ_t log π(y_t) = c_i ℓ_i: |M_i| for seq-mean-token-mean, 1 for seq-mean-token-sum."""
    mode = REFERENCE_AGGREGATION_MODES.get(loss_aggregation)
    if mode is None:
        raise ValueError(f"the reference OPOB form supports loss_aggregation in "
                         f"{sorted(REFERENCE_AGGREGATION_MODES)}, not {loss_aggregation!r}")
    lengths = num_tokens.detach().double()
    return lengths if mode == "length" else torch.ones_like(lengths)


def reference_is_weights(seq_log_ratios: Tensor, cap: float | None = None) -> Tensor:
    """The authors' sequence IS weight → (B,) fp64: exp(L_i) taken in fp32 and unclamped
    (`compute_is_info`: inf beyond L ≈ 88.72, 0 below L ≈ −103.97), or min(exp(L_i), cap) for their
    clipped ratio (`rollout_seq_is_clipped`). seq_log_ratios: (B,) L_i in fp32."""
    weights = seq_log_ratios.detach().float().exp().double()
    return weights if cap is None else weights.clamp(max=cap)


REFERENCE_LOSS_LOG_BOUND = 20.0
"""veRL's `SAFETY_BOUND`: their per-trajectory loss weight exponentiates L_i clamped to ±20."""


def reference_loss_weights(seq_log_ratios: Tensor, cap: float) -> Tensor:
    """The authors' per-trajectory loss weight w̄_i → (B,) fp64: veRL's `rollout_is_weights` with
    `rollout_is="sequence"` (their `rollout_corr_helper.compute_rollout_correction_weights`),
    min(exp(clamp(L_i, ±20)), cap) with exp in fp32 — e^-20, not e^-25, at L = −25. It weighs the loss,
    so it is also the w̄_i their per-trajectory gradient norm carries into ω. seq_log_ratios: (B,) L_i."""
    bound = REFERENCE_LOSS_LOG_BOUND
    return seq_log_ratios.detach().float().clamp(-bound, bound).exp().double().clamp(max=cap)


def reference_baseline_weights(
    sq_grad_norms: Tensor,
    seq_log_ratios: Tensor,
    is_cap: float,
    loglik_scale: Tensor,
    groups: GroupIndex,
    *,
    use_is_weights: bool = True,
    use_clipped_weights: bool = False,
    num_tokens: Tensor | None = None,
) -> Tensor:
    """ω_i = w̄_i² · w_i² · ‖∇ Σ_t log π(y_t)‖² [/ |M_i|²] → (B,) fp64 (0 where not finite or < 0).

    sq_grad_norms: (B,) ‖∇ℓ_i‖² of the learner's aggregated ℓ_i (unweighted). seq_log_ratios: (B,) L_i,
    unclamped: w̄_i = `reference_loss_weights` is the weight the authors' per-trajectory gradient carries,
    w_i = e^{L_i} their unclipped sequence ratio (min(e^{L_i}, is_cap) with use_clipped_weights; left
    out with use_is_weights off). loglik_scale: (B,) c_i with Σ_t log π(y_t) = c_i ℓ_i (|M_i| for a
    token-mean ℓ_i, 1 for a token sum): the authors rescale the norm by the response length.
    groups: the baseline's groups. num_tokens: (B,) |M_i| for normalize_by_length.

    Where the authors' value is finite it is theirs: w in fp32 as they take it, the products in fp64 as
    their Python floats. Where theirs overflows (e^{L_i} = inf in fp32 for some member, so their b is
    NaN), the group's weights are computed in log space and divided by the group's largest: b, a ratio
    of weights, is then the limit theirs tends to as L_i grows (the 1e-8 of b's denominator acting
    relative to the largest weight), and stays finite.
    """
    scale = loglik_scale.detach().double()
    log_ratios = seq_log_ratios.detach().float()
    truncated = reference_loss_weights(log_ratios, is_cap)
    # ‖w̄_i ∇Σ_t log π‖² = w̄_i² c_i² ‖∇ℓ_i‖²  (the authors' grad_norm_unscaled, squared)
    base = sq_grad_norms.detach().double() * (scale * scale) * (truncated * truncated)
    if num_tokens is not None:
        length = num_tokens.detach().double().clamp_min(1.0)
        base = base / (length * length)
    if not use_is_weights:
        return torch.where(torch.isfinite(base) & (base >= 0), base, torch.zeros_like(base))
    cap = is_cap if use_clipped_weights else None
    w = reference_is_weights(log_ratios, cap)
    direct = base * (w * w)  # compute_opob_baseline: weight *= seq_is_ratio ** 2
    log_w = log_ratios.double() if cap is None else log_ratios.double().clamp(max=math.log(cap))
    log_omega = torch.log(base) + 2.0 * log_w  # log(0) = −inf: a zero weight stays zero
    overflow = torch.isinf(direct) & (base > 0) & torch.isfinite(log_omega)
    if not bool(overflow.any()):
        return torch.where(torch.isfinite(direct) & (direct >= 0), direct, torch.zeros_like(direct))
    overflowed = group_sum(overflow.double(), groups) > 0
    usable_log = torch.where(torch.isnan(log_omega) | (base < 0), torch.full_like(log_omega, -torch.inf),
                             log_omega)
    low = torch.full((groups.num_groups,), -torch.inf, dtype=torch.float64, device=log_omega.device)
    shift = low.scatter_reduce(0, groups.index, usable_log, "amax")
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    rescaled = (usable_log - shift[groups.index]).exp()
    omega = torch.where(overflowed[groups.index], rescaled, direct)
    return torch.where(torch.isfinite(omega) & (omega >= 0), omega, torch.zeros_like(omega))


def reference_group_std(rewards: Tensor, valid: Tensor, groups: GroupIndex) -> Tensor:
    """σ_g as the authors take it → (G,) fp64: `torch.std(torch.tensor(rewards, dtype=float32),
    unbiased=False)` of each group's valid rewards (`compute_grad_info`), 0 for an empty group.

    Not `group_std`: for a group of equal non-dyadic rewards the population std is rounding noise
    (16 × 0.1 → 1.49e-8 one way, 0 another), and the 1e-8 floor of `reference_std_divisor` turns that
    noise into a divisor of 1 or of ~1e-8 — the same call on the same dtype gives the authors' choice.
    """
    sigma = torch.zeros(groups.num_groups, dtype=torch.float64, device=rewards.device)
    values = rewards.detach().to(torch.float32)
    for g in range(groups.num_groups):
        members = (groups.index == g) & valid
        if members.any():
            sigma[g] = torch.std(values[members].contiguous(), unbiased=False).double()
    return sigma


def _per_group(
    rewards: Tensor,
    baseline_weights: Tensor,
    valid: Tensor,
    groups: GroupIndex,
    one: Callable[[Tensor, Tensor], Tensor],
) -> GroupBaseline:
    """Apply `one(values, weights) -> float64 0-d` to each group's valid members (no fallback)."""
    values = rewards.double()
    weights = baseline_weights.double()
    per_group = torch.zeros(groups.num_groups, dtype=torch.float64, device=rewards.device)
    for g in range(groups.num_groups):
        members = (groups.index == g) & valid
        if members.any():
            per_group[g] = one(values[members], weights[members])
    no_fallback = torch.zeros(groups.num_groups, dtype=torch.bool, device=rewards.device)
    return GroupBaseline(per_group, per_group[groups.index], no_fallback)


def _reference_mean(values: Tensor, weights: Tensor) -> Tensor:
    return (values * weights).sum() / (weights.sum() + REFERENCE_EPS)


def _reference_median(values: Tensor, weights: Tensor) -> Tensor:
    total = weights.sum()
    if total == 0:
        return values.new_zeros(())
    order = torch.argsort(values)
    cumulative = torch.cumsum(weights[order], 0)
    cut = (0.5 * total).reshape(1)
    index = torch.searchsorted(cumulative, cut, right=False).clamp(max=values.numel() - 1)
    return values[order][index[0]]


def _reference_winsorized(values: Tensor, weights: Tensor) -> Tensor:
    total = weights.sum()
    if total == 0:
        return values.new_zeros(())
    lower_q, upper_q = REFERENCE_WINSOR_QUANTILES
    order = torch.argsort(values)
    sorted_values, cumulative = values[order], torch.cumsum(weights[order], 0)
    cuts = torch.stack([lower_q * total, upper_q * total])
    index = torch.searchsorted(cumulative, cuts, right=False).clamp(max=values.numel() - 1)
    clipped = values.clamp(min=sorted_values[index[0]], max=sorted_values[index[1]])
    return (clipped * weights).sum() / (weights.sum() + REFERENCE_EPS)


def reference_mean_baseline(rewards: Tensor, baseline_weights: Tensor, valid: Tensor,
                            groups: GroupIndex) -> GroupBaseline:
    """b_g = Σ ω R / (Σ ω + 1e-8) (`get_weighted_mean`): no fallback; all-zero ω gives b_g = 0."""
    return _per_group(rewards, baseline_weights, valid, groups, _reference_mean)


def reference_median_baseline(rewards: Tensor, baseline_weights: Tensor, valid: Tensor,
                              groups: GroupIndex) -> GroupBaseline:
    """`get_weighted_median`: the first sorted reward whose cumulative ω reaches half the total."""
    return _per_group(rewards, baseline_weights, valid, groups, _reference_median)


def reference_winsorized_baseline(rewards: Tensor, baseline_weights: Tensor, valid: Tensor,
                                  groups: GroupIndex) -> GroupBaseline:
    """`get_weighted_winsorized_mean`: the *rewards* clipped to their ω-weighted 5% / 95% quantiles
    (first sorted reward whose cumulative ω reaches each cut), then the ε-weighted mean."""
    return _per_group(rewards, baseline_weights, valid, groups, _reference_winsorized)


REFERENCE_AGGREGATIONS = {
    "weighted_mean": reference_mean_baseline,
    "weighted_median": reference_median_baseline,
    "winsorized_mean": reference_winsorized_baseline,
}
"""The reference form's b by aggregation name (the authors' agg_mode mean / median / winsorized_mean)."""


def reference_std_divisor(group_std_population: Tensor, divide_by_std: bool) -> Tensor:
    """(B,) what R_i − b is divided by: σ_g (population std) where σ_g > 1e-8, else 1; all 1 when
    divide_by_std is off (the authors' norm_by_std)."""
    sigma = group_std_population.double()
    if not divide_by_std:
        return torch.ones_like(sigma)
    return torch.where(sigma > REFERENCE_EPS, sigma, torch.ones_like(sigma))


def reference_coefficients(
    truncated_weights: Tensor,
    rewards: Tensor,
    std_divisor: Tensor,
    valid: Tensor,
    batch_size: int | Tensor,
) -> TwoBufferCoefficients:
    """a_i = w̄_i R_i / (d_i B), s_i = w̄_i / (d_i B) with d_i from `reference_std_divisor`.

    As the authors' `_update_grad_buffers`: no trajectory is zeroed for its group being degenerate;
    an all-equal group gets R − b = R·ε/(Σω + ε), tiny but not exactly 0.
    """
    scale = truncated_weights.detach().double() / torch.as_tensor(batch_size, dtype=torch.float64)
    scale = torch.where(valid, scale / std_divisor.double(), torch.zeros_like(scale))
    return TwoBufferCoefficients(reward_coef=scale * rewards.double(), baseline_coef=scale)
