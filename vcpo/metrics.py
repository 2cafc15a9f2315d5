"""Staleness, importance-sampling and baseline metrics every training step logs (docs/algorithm.md).

Metric names are the constants below; every function returns dict[str, Tensor] of 0-d tensors
(the staleness histogram is a 1-d tensor of counts). Nothing is synced or logged here.

KL convention: `is/kl_k3` estimates KL(μ‖π) from the tokens sampled by μ. With ℓ = log π − log μ,
the K3 estimator under samples from μ is e^{ℓ} − 1 − ℓ (unbiased: E_μ[e^ℓ] = 1, so
E_μ[e^ℓ − 1 − ℓ] = E_μ[log μ − log π]; and ≥ 0). docs/algorithm.md writes e^{−ℓ} + ℓ − 1, which is the K3
estimator of KL(π‖μ) under samples from π; our samples come from μ, hence the form used here.
π is the proximal policy π_old (the learner's logprobs at the start of the step).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from vcpo.groups import GroupIndex, group_sum
from vcpo.is_weights import DEFAULT_MAX_LOG_RATIO, clamp_log_ratios, ess_ratio

STALENESS_MEAN = "staleness/mean"
STALENESS_MAX = "staleness/max"
STALENESS_HIST = "staleness/hist"
IS_ESS_RATIO = "is/ess_ratio"
IS_ESS_RATIO_CLIPPED = "is/ess_ratio_clipped"
IS_W_MAX = "is/w_max"
IS_W_P99 = "is/w_p99"
IS_LOG_W_MEAN = "is/log_w_mean"
IS_LOG_W_MIN = "is/log_w_min"
IS_LOG_W_MAX = "is/log_w_max"
IS_KL_K3 = "is/kl_k3"
PG_CLIP_FRAC = "pg/clip_frac"
PG_MASKED_FRAC = "pg/masked_frac"
OPOB_BASELINE_MEAN = "opob/baseline_mean"
OPOB_GAP_TO_GROUP_MEAN = "opob/gap_to_group_mean"
OPOB_SIGNED_GAP = "opob/baseline_minus_group_mean"
OPOB_OMEGA_MAX_SHARE = "opob/omega_max_share"
IS_LOG_W_REWARD_CORR = "is/log_w_reward_corr"
IS_BY_LAG_LOG_W_MEAN = "is/by_lag/log_w_mean"
IS_BY_LAG_ESS_RATIO = "is/by_lag/ess_ratio"
IS_BY_LAG_KL_K3 = "is/by_lag/kl_k3"
IS_MISMATCH_LOG_W_MEAN = "is/mismatch/log_w_mean"
IS_MISMATCH_ESS_RATIO = "is/mismatch/ess_ratio"
IS_MISMATCH_KL_K3 = "is/mismatch/kl_k3"
IS_STALENESS_LOG_W_EXCESS = "is/staleness/log_w_mean_excess"
REWARD_MEAN = "reward/mean"
REWARD_STD = "reward/std"
REWARD_MIN = "reward/min"
REWARD_MAX = "reward/max"
TOKENS_TRAINED = "tokens/trained"

STALENESS_HIST_BINS = 9
"""Histogram bins of lags: [0], [1], [2,3], [4,7], ..., [64,127], [128, ∞) (log2 bins up to k = 128)."""


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    values = torch.where(mask, values, torch.zeros_like(values))
    return values.sum() / mask.sum().clamp_min(1).to(values.dtype)


def staleness_bin(lags: Tensor, num_bins: int = STALENESS_HIST_BINS) -> Tensor:
    """Bin of each lag (any shape, long ≥ 0): 0 → 0, and lag ∈ [2^{b−1}, 2^b) → b, capped at num_bins − 1."""
    lags = lags.clamp_min(0)
    log2 = torch.floor(torch.log2(lags.clamp_min(1).double())).long() + 1
    return torch.where(lags == 0, torch.zeros_like(log2), log2).clamp(max=num_bins - 1)


def staleness_metrics(lags: Tensor, valid: Tensor, num_bins: int = STALENESS_HIST_BINS) -> dict[str, Tensor]:
    """staleness/{mean, max, hist} over valid trajectories.

    lags: (B,) long policy lag v − v_start per trajectory. valid: (B,) bool.
    hist: (num_bins,) counts in log2 bins (see `staleness_bin`).
    """
    lags_f = lags.float()
    hist = torch.zeros(num_bins, dtype=torch.long, device=lags.device)
    hist = hist.index_add_(0, staleness_bin(lags, num_bins), valid.long())
    return {
        STALENESS_MEAN: _masked_mean(lags_f, valid),
        STALENESS_MAX: torch.where(valid, lags_f, torch.zeros_like(lags_f)).max()
        if lags.numel()
        else lags_f.sum(),
        STALENESS_HIST: hist,
    }


def is_weight_metrics(
    seq_log_ratios: Tensor,
    valid: Tensor,
    cap: float = 8.0,
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO,
    weightless: Tensor | None = None,
) -> dict[str, Tensor]:
    """is/{ess_ratio, ess_ratio_clipped, w_max, w_p99, log_w_mean, log_w_min, log_w_max} over valid
    trajectories.

    seq_log_ratios: (B,) L_i = log w_i (finite where valid). valid: (B,) bool. cap: C of w̄.
    weightless: (B,) bool, valid trajectories with w = 0 (a correction rejected them): they count in the
    ESS ratio's B but in no sum, and in none of the other statistics; None = none.
    w_max and w_p99 are reported from clamped L (≤ e^max_log_ratio); log_w_mean, log_w_min and log_w_max
    are unclamped (they show whether any L_i went past the clamp).
    """
    if weightless is not None:
        zero_weight = torch.where(weightless, -torch.inf, seq_log_ratios.float())
        metrics = is_weight_metrics(seq_log_ratios, valid & ~weightless, cap, max_log_ratio)
        metrics[IS_ESS_RATIO] = ess_ratio(zero_weight, valid)
        metrics[IS_ESS_RATIO_CLIPPED] = ess_ratio(zero_weight.clamp(max=math.log(cap)), valid)
        return metrics
    log_w = torch.where(valid, seq_log_ratios.float(), torch.zeros_like(seq_log_ratios, dtype=torch.float32))
    weights = torch.where(valid, clamp_log_ratios(log_w, max_log_ratio).exp(), torch.zeros_like(log_w))
    valid_weights = weights[valid]  # one sync: the quantile needs the valid count
    empty = valid_weights.numel() == 0
    zero = torch.zeros((), device=log_w.device)
    return {
        IS_ESS_RATIO: ess_ratio(log_w, valid),
        IS_ESS_RATIO_CLIPPED: ess_ratio(log_w.clamp(max=math.log(cap)), valid),
        IS_W_MAX: zero if empty else valid_weights.max(),
        IS_W_P99: zero if empty else torch.quantile(valid_weights, 0.99),  # linear interpolation
        IS_LOG_W_MEAN: _masked_mean(log_w, valid),
        IS_LOG_W_MIN: zero if empty else log_w[valid].min(),
        IS_LOG_W_MAX: zero if empty else log_w[valid].max(),
    }


def behavior_kl_k3(
    old_logprobs: Tensor,
    behavior_logprobs: Tensor,
    loss_mask: Tensor,
    max_log_ratio: float = DEFAULT_MAX_LOG_RATIO,
) -> Tensor:
    """is/kl_k3: token-mean of e^{ℓ} − 1 − ℓ, ℓ = log π_old − log μ → 0-d, estimating KL(μ‖π_old).

    old_logprobs, behavior_logprobs: (B, T). loss_mask: (B, T) bool tokens (sampled by μ).
    """
    diff = clamp_log_ratios(old_logprobs.detach().float() - behavior_logprobs.detach().float(), max_log_ratio)
    diff = torch.where(loss_mask, diff, torch.zeros_like(diff))
    # K3 for KL(μ‖π) under samples from μ: e^{ℓ} − 1 − ℓ
    return _masked_mean(diff.exp() - 1.0 - diff, loss_mask)


def token_fraction(selected: Tensor, loss_mask: Tensor) -> Tensor:
    """Fraction of trained tokens (loss_mask (B, T) bool) that are `selected` (B, T) bool → 0-d
    (pg/clip_frac, pg/masked_frac)."""
    return (selected & loss_mask).sum().float() / loss_mask.sum().clamp_min(1).float()


def reward_metrics(rewards: Tensor, valid: Tensor) -> dict[str, Tensor]:
    """reward/{mean, std (population), min, max} over valid trajectories. rewards: (B,); valid: (B,) bool."""
    rewards = rewards.float()
    mean = _masked_mean(rewards, valid)
    centred = torch.where(valid, rewards - mean, torch.zeros_like(rewards))
    if bool(valid.any()):
        low, high = rewards[valid].min(), rewards[valid].max()
    else:
        low = high = torch.tensor(float("nan"), device=rewards.device)
    return {REWARD_MEAN: mean, REWARD_STD: _masked_mean(centred * centred, valid).sqrt(), REWARD_MIN: low,
            REWARD_MAX: high}


def opob_metrics(baseline_per_group: Tensor, group_mean_reward: Tensor, present: Tensor) -> dict[str, Tensor]:
    """opob/{baseline_mean, gap_to_group_mean} over the groups present in the batch.

    baseline_per_group: (G,) b*_g. group_mean_reward: (G,) plain mean reward of the group.
    present: (G,) bool, groups with at least one valid trajectory.
    gap_to_group_mean is the mean |b*_g − mean_g|: how far the optimal baseline moved from GRPO's.
    """
    baseline = baseline_per_group.float()
    signed = baseline - group_mean_reward.float()
    return {
        OPOB_BASELINE_MEAN: _masked_mean(baseline, present),
        OPOB_GAP_TO_GROUP_MEAN: _masked_mean(signed.abs(), present),
        OPOB_SIGNED_GAP: _masked_mean(signed, present),
    }


def opob_concentration(baseline_weights: Tensor, valid: Tensor, groups: GroupIndex) -> dict[str, Tensor]:
    """opob/omega_max_share: mean over groups (with Σω > 0) of max_i ω_i / Σ_i ω_i — 1/G when every
    trajectory weighs the same in b*, 1 when one trajectory decides the baseline alone.

    baseline_weights: (B,) ω_i. valid: (B,) bool. groups: the baseline's groups.
    """
    zeros = torch.zeros_like(baseline_weights, dtype=torch.float64)
    omega = torch.where(valid, baseline_weights.double(), zeros)
    total = group_sum(omega, groups)
    largest = torch.zeros(groups.num_groups, dtype=torch.float64, device=omega.device)
    largest = largest.scatter_reduce(0, groups.index, omega, "amax")
    present = total > 0
    share = torch.where(present, largest / torch.where(present, total, torch.ones_like(total)), 0.0)
    return {OPOB_OMEGA_MAX_SHARE: _masked_mean(share, present).float()}


def log_w_reward_correlation(seq_log_ratios: Tensor, rewards: Tensor, valid: Tensor) -> Tensor:
    """is/log_w_reward_corr: Pearson correlation of log w_i with R_i over valid trajectories → 0-d
    (0 when either is constant). Positive: the lagged sample's likelier-now trajectories are the
    rewarded ones, so the IS weights amplify the signal; negative: they fight it."""
    x = torch.where(valid, seq_log_ratios.double(), torch.zeros_like(seq_log_ratios, dtype=torch.float64))
    y = torch.where(valid, rewards.double(), torch.zeros_like(rewards, dtype=torch.float64))
    count = valid.sum().clamp_min(1).double()
    x = torch.where(valid, x - x.sum() / count, torch.zeros_like(x))
    y = torch.where(valid, y - y.sum() / count, torch.zeros_like(y))
    denominator = (x.square().sum() * y.square().sum()).sqrt()
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    return torch.where(denominator > 0, (x * y).sum() / safe, 0.0).float()


def behavior_ratio_by_lag(seq_log_ratios: Tensor, token_k3: Tensor, lags: Tensor, valid: Tensor,
                          num_bins: int = STALENESS_HIST_BINS) -> dict[str, Tensor]:
    """The behaviour ratio's two sources apart. At lag 0 the engine sampled with the learner's own weights, so
    log w there is engine/learner numerics alone (a bf16 engine's rounding, a kernel's): the mismatch.
    Per staleness bin (those of staleness/hist; NaN for an empty bin): is/by_lag/{log_w_mean, ess_ratio,
    kl_k3}; the lag-0 bin's as is/mismatch/{log_w_mean, ess_ratio, kl_k3}; and is/staleness/log_w_mean_excess,
    the lagged trajectories' mean log w less the lag-0 one's — what staleness adds on top of the mismatch
    (NaN unless the batch has both).

    seq_log_ratios: (B,) L_i; token_k3: (B,) each trajectory's token-mean k3 (e^ℓ − 1 − ℓ); lags: (B,) long;
    valid: (B,) bool."""
    bins = staleness_bin(lags, num_bins)
    device = seq_log_ratios.device
    log_w = torch.where(valid, seq_log_ratios.float(), torch.zeros_like(seq_log_ratios, dtype=torch.float32))
    nan = torch.full((num_bins,), math.nan, device=device)
    count = torch.zeros(num_bins, device=device).index_add_(0, bins, valid.float())
    safe = count.clamp_min(1.0)
    mean = torch.where(count > 0, torch.zeros(num_bins, device=device).index_add_(0, bins, log_w) / safe, nan)
    k3 = torch.where(valid, token_k3.float(), torch.zeros_like(log_w))
    kl = torch.where(count > 0, torch.zeros(num_bins, device=device).index_add_(0, bins, k3) / safe, nan)
    ess = torch.stack([ess_ratio(log_w, valid & (bins == b)) if count[b] > 0 else nan[b]
                       for b in range(num_bins)])
    lagged = valid & (bins > 0)
    excess = (_masked_mean(log_w, lagged) - mean[0]) if bool(lagged.any()) and count[0] > 0 else nan[0]
    return {IS_BY_LAG_LOG_W_MEAN: mean, IS_BY_LAG_ESS_RATIO: ess, IS_BY_LAG_KL_K3: kl,
            IS_MISMATCH_LOG_W_MEAN: mean[0], IS_MISMATCH_ESS_RATIO: ess[0], IS_MISMATCH_KL_K3: kl[0],
            IS_STALENESS_LOG_W_EXCESS: excess}


def trajectory_kl_k3(old_logprobs: Tensor, behavior_logprobs: Tensor, loss_mask: Tensor,
                     max_log_ratio: float = DEFAULT_MAX_LOG_RATIO) -> Tensor:
    """(B,) each trajectory's token-mean k3 = e^ℓ − 1 − ℓ over its sampled tokens (0 without any)."""
    diff = clamp_log_ratios(old_logprobs.detach().float() - behavior_logprobs.detach().float(), max_log_ratio)
    diff = torch.where(loss_mask, diff, torch.zeros_like(diff))
    k3 = torch.where(loss_mask, diff.exp() - 1.0 - diff, torch.zeros_like(diff))
    return k3.sum(dim=-1) / loss_mask.sum(dim=-1).clamp_min(1).to(k3.dtype)
