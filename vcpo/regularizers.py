"""Optional loss terms: per-token KL-to-reference estimators and the entropy of the policy.

KL(π_θ‖π_ref) is estimated per sampled token with x = log π_ref − log π_θ (samples from π_θ):

* k1 = −x                        unbiased, high variance, can be negative
* k2 = x² / 2                    biased, low variance
* k3 = e^{x} − 1 − x             unbiased and ≥ 0 (Schulman 2020, "Approximating KL Divergence")

Log-ratios are clamped to ±max_log_ratio before exp so k3 and its gradient stay finite.
Deliberately not here: the coefficients and the aggregation (the objectives apply both).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vcpo.is_weights import DEFAULT_MAX_LOG_RATIO


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log π_θ − log π_ref per token → (B, T).

    logprobs: (B, T) log π_θ of the sampled tokens (with grad). ref_logprobs: (B, T) log π_ref.
    """
    return logprobs - ref_logprobs.detach()


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (log π_θ − log π_ref)² / 2 per token → (B, T). Arguments as in `kl_k1`."""
    diff = logprobs - ref_logprobs.detach()
    return 0.5 * diff * diff


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, max_log_ratio: float = DEFAULT_MAX_LOG_RATIO) -> Tensor:
    """k3 = e^{x} − 1 − x, x = log π_ref − log π_θ (clamped), per token → (B, T), ≥ 0.

    Arguments as in `kl_k1`.
    """
    x = (ref_logprobs.detach() - logprobs).clamp(-max_log_ratio, max_log_ratio)
    return x.exp() - 1.0 - x


KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}
"""Per-token KL(π_θ‖π_ref) estimators by name."""


def entropy_from_logits(logits: Tensor) -> Tensor:
    """H(π(·|y_<t)) = logsumexp(z) − Σ_v softmax(z)_v z_v per position → (..., ) without the V axis.

    logits: (B, T, V) unnormalised scores (with grad). Computed in fp32.
    """
    logits = logits.float()
    log_normalizer = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    # H = −Σ p log p = log Z − Σ p z
    return log_normalizer - (probs * logits).sum(dim=-1)
