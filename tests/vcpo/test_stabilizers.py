"""M2PO's second-moment mask, BAPO's adaptive bounds."""

import math

import pytest
import torch

from tests.vcpo.helpers import tensor
from vcpo.stabilizers import (
    bapo_bounds,
    bapo_candidate_bounds,
    m2po_mask,
)


def test_m2po_masks_the_largest_squared_log_ratios_until_the_mean_is_below_tau():
    log_ratio = tensor([[0.1, -0.5, 0.1], [0.3, 2.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    result = m2po_mask(log_ratio, mask, tau=0.04)
    # trained (log r)² = [0.01, 0.25, 0.01, 0.09]
    # sorted prefix means: 0.01, 0.01, 0.11/3 = 0.0367, 0.36/4 = 0.09
    # → keep 3, mask the 0.25 token
    assert result.kept.tolist() == [[True, False, True], [True, False, False]]
    torch.testing.assert_close(result.second_moment, tensor(0.09))
    torch.testing.assert_close(result.kept_second_moment, tensor(0.11 / 3))


def _greedy_m2po(squared: list[float], tau: float) -> int:
    """The definition: drop the largest value until the mean of the rest is ≤ τ; returns the kept count."""
    kept = sorted(squared)
    while kept and sum(kept) / len(kept) > tau:
        kept.pop()
    return len(kept)


def test_m2po_vectorised_mask_matches_the_greedy_definition():
    generator = torch.Generator().manual_seed(0)
    for scale in (0.05, 0.2, 0.5, 2.0):
        log_ratio = scale * torch.randn(4, 16, generator=generator)
        mask = torch.rand(4, 16, generator=generator) > 0.3
        result = m2po_mask(log_ratio, mask, tau=0.04)
        assert int(result.kept.sum()) == _greedy_m2po(log_ratio[mask].square().tolist(), 0.04)
        assert result.kept_second_moment.item() <= 0.04 + 1e-7


def test_bapo_candidates_raise_the_upper_bound_first_then_the_lower_bound():
    lows, highs = bapo_candidate_bounds((0.6, 0.9), (1.2, 3.0), 0.05)
    # (3.0 − 1.2)/0.05 = 36 upper steps → 37 candidates at c_low = 0.6, then 6 lower steps → 43 in all
    assert len(lows) == 43
    torch.testing.assert_close((lows[0], highs[0]), (tensor(0.6), tensor(1.2)))
    torch.testing.assert_close((lows[36], highs[36]), (tensor(0.6), tensor(3.0)))
    torch.testing.assert_close((lows[-1], highs[-1]), (tensor(0.9), tensor(3.0)))


def test_bapo_widens_the_upper_bound_until_positive_tokens_contribute_enough():
    # positive token (A = +1) at r = 1.5 is clipped until c_high > 1.5; negative token (A = −1) at r = 1
    ratio, advantages = tensor([[1.5, 1.0]]), tensor([[1.0, -1.0]])
    result = bapo_bounds(ratio, advantages, torch.ones(1, 2, dtype=torch.bool))
    # first c_high with 1.5 < c_high is 1.55: ρ = 1.5 / (1.5 + 1.0) = 0.6 ≥ 0.5
    assert result.upper_bound.item() == pytest.approx(1.55) and result.lower_bound.item() == pytest.approx(
        0.6
    )
    torch.testing.assert_close(result.positive_fraction, tensor(0.6))


def test_bapo_raises_the_lower_bound_to_clip_away_negative_tokens():
    # positive r = 1.0, A = 1 (contributes 1); negative r = 0.68, A = −3 (contributes 2.04 while c_low < 0.68)
    ratio, advantages = tensor([[1.0, 0.68]]), tensor([[1.0, -3.0]])
    result = bapo_bounds(ratio, advantages, torch.ones(1, 2, dtype=torch.bool))
    # c_high up to 3.0 changes nothing (ρ = 1/3.04); then c_low 0.65 → still; 0.70 clips it → ρ = 1
    assert result.upper_bound.item() == pytest.approx(3.0) and result.lower_bound.item() == pytest.approx(0.7)
    assert result.positive_fraction.item() == 1.0


def test_bapo_uses_the_widest_bounds_when_the_target_is_unreachable():
    ratio, advantages = tensor([[1.0, 1.0]]), tensor([[1.0, -3.0]])
    result = bapo_bounds(ratio, advantages, torch.ones(1, 2, dtype=torch.bool))
    # the negative token at r = 1 > 0.9 always contributes 3: ρ = 1/4 at the widest bounds (0.9, 3.0)
    assert result.lower_bound.item() == pytest.approx(0.9) and result.upper_bound.item() == pytest.approx(3.0)
    torch.testing.assert_close(result.positive_fraction, tensor(0.25))
    assert math.isfinite(result.positive_fraction.item())
