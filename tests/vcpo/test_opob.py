"""The off-policy optimal baseline: closed form, minimality, the IS-factor-once rule, fallbacks."""

import math

import pytest
import torch

from tests.vcpo.helpers import tensor
from vcpo.groups import index_groups, single_group
from vcpo.opob import (
    BASELINE_AGGREGATIONS,
    opob_advantages,
    opob_baseline_weights,
    vcpo_coefficients,
    vcpo_loss,
    weighted_mean_baseline,
    weighted_median_baseline,
    winsorized_mean_baseline,
)


def test_baseline_weights_are_w_squared_times_unweighted_norms():
    norms, w = tensor([1.0, 4.0]), tensor([2.0, 0.5])
    # ω = w² ‖∇ℓ‖²: [4·1, 0.25·4] = [4, 1]
    assert opob_baseline_weights(norms, w).tolist() == [4.0, 1.0]
    # without IS: ω = ‖∇ℓ‖²; divided by |M|² = [4, 1]: [4/4, 1/1]
    assert opob_baseline_weights(norms).tolist() == [1.0, 4.0]
    assert opob_baseline_weights(norms, w, num_tokens=tensor([2.0, 1.0])).tolist() == [1.0, 1.0]
    # non-finite or negative norms get weight 0
    assert opob_baseline_weights(tensor([float("nan"), float("inf"), -1.0])).tolist() == [0.0, 0.0, 0.0]


def test_weighted_mean_baseline_hand_computed_per_group():
    groups = index_groups(torch.tensor([0, 0, 0, 1, 1]))
    rewards = tensor([1.0, 0.0, 1.0, 0.0, 1.0])
    omega = tensor([1.0, 2.0, 1.0, 3.0, 1.0])
    result = weighted_mean_baseline(rewards, omega, torch.ones(5, dtype=torch.bool), groups)
    # group 0: (1·1 + 2·0 + 1·1)/4 = 0.5; group 1: (3·0 + 1·1)/4 = 0.25
    assert result.per_group.tolist() == [0.5, 0.25]
    assert result.per_trajectory.tolist() == [0.5, 0.5, 0.5, 0.25, 0.25]
    assert not result.is_fallback.any()


def test_zero_total_weight_falls_back_to_the_group_mean_and_is_reported():
    groups = index_groups(torch.tensor([0, 0, 1, 1]))
    rewards = tensor([1.0, 0.0, 1.0, 1.0])
    omega = tensor([0.0, 0.0, 2.0, 1.0])
    for aggregate in BASELINE_AGGREGATIONS.values():
        result = aggregate(rewards, omega, torch.ones(4, dtype=torch.bool), groups)
        # group 0 has Σω = 0 → plain mean (1 + 0)/2 = 0.5
        assert result.per_group[0].item() == 0.5
        assert result.is_fallback.tolist() == [True, False]


def _single_group_median(rewards: list[float], omega: list[float]) -> float:
    valid = torch.ones(len(rewards), dtype=torch.bool)
    return weighted_median_baseline(
        tensor(rewards), tensor(omega), valid, single_group(len(rewards))
    ).per_group.item()


def test_weighted_median_is_the_lower_weighted_median():
    # sorted R [0, 1, 1] with ω [2, 1, 1]: total 4, half 2, cumulative [2, 3, 4] → first at R = 0
    assert _single_group_median([0.0, 1.0, 1.0], [2.0, 1.0, 1.0]) == 0.0
    # ω [1, 1, 1]: cumulative [1, 2, 3], half 1.5 → R = 1
    assert _single_group_median([0.0, 1.0, 1.0], [1.0, 1.0, 1.0]) == 1.0
    # unsorted input, two groups at once:
    # group 1 = {R 3 (ω 1), R 2 (ω 5)} → sorted [2, 3], cumulative [5, 6], half 3 → 2
    # group 0 = {R 0 (ω 1), R 1 (ω 3)} → cumulative [1, 4], half 2 → 1
    groups = index_groups(torch.tensor([1, 0, 1, 0]))
    result = weighted_median_baseline(
        tensor([3.0, 0.0, 2.0, 1.0]), tensor([1.0, 1.0, 5.0, 3.0]), torch.ones(4, dtype=torch.bool), groups
    )
    assert result.per_group.tolist() == [1.0, 2.0]


def test_winsorized_mean_caps_the_heaviest_weights():
    rewards, omega = tensor([0.0, 0.0, 1.0]), tensor([1.0, 2.0, 100.0])
    valid, groups = torch.ones(3, dtype=torch.bool), single_group(3)
    # q = 0.5: sorted ω [1, 2, 100], index floor(0.5·2) = 1 → cap 2 → ω' = [1, 2, 2] → b = 2/5 = 0.4
    torch.testing.assert_close(
        winsorized_mean_baseline(rewards, omega, valid, groups, upper_quantile=0.5).per_group,
        torch.tensor([0.4], dtype=torch.float64),
    )
    # q = 1 keeps the weighted mean: 100/103
    torch.testing.assert_close(
        winsorized_mean_baseline(rewards, omega, valid, groups, upper_quantile=1.0).per_group,
        torch.tensor([100 / 103], dtype=torch.float64),
    )
    # an invalid member does not count toward the quantile: valid ω [1, 2] → index floor(0.5·1) = 0 → cap 1
    result = winsorized_mean_baseline(rewards, omega, torch.tensor([True, False, True]), groups, 0.5)
    # ω' = [1, –, 1] → (0 + 1)/2 = 0.5
    assert result.per_group.item() == 0.5


def _second_moments(baselines: torch.Tensor, weights, rewards, gradients) -> torch.Tensor:
    """Σ_i ‖w_i (R_i − b) g_i‖² for each b, from the vectors themselves (B·E‖X‖² of the single-sample
    estimator X = w_I (R_I − b) g_I with I uniform over the batch)."""
    terms = (weights * (rewards - baselines[:, None]))[:, :, None] * gradients[None]
    return (terms * terms).sum(dim=(1, 2))


def test_opob_is_the_variance_minimising_scalar_on_a_grid():
    generator = torch.Generator().manual_seed(0)
    batch, dim = 16, 32
    gradients = torch.randn(batch, dim, generator=generator, dtype=torch.float64)
    gradients *= torch.rand(batch, 1, generator=generator, dtype=torch.float64) * 3  # heterogeneous norms
    log_w = torch.randn(batch, generator=generator, dtype=torch.float64)
    weights = log_w.exp()
    rewards = torch.randint(0, 2, (batch,), generator=generator).double() + 0.1 * torch.rand(
        batch, generator=generator
    )
    sq_norms = (gradients * gradients).sum(dim=1)
    b_star = weighted_mean_baseline(
        rewards,
        opob_baseline_weights(sq_norms, weights),
        torch.ones(batch, dtype=torch.bool),
        single_group(batch),
    ).per_group.item()
    grid = torch.linspace(-1.0, 2.0, 3001, dtype=torch.float64)  # spacing 0.001
    moments = _second_moments(grid, weights, rewards, gradients)
    argmin = grid[moments.argmin()].item()
    # the closed form equals the grid argmin to grid precision and is no worse than any grid point
    assert abs(argmin - b_star) <= 0.001
    at_b_star = _second_moments(torch.tensor([b_star], dtype=torch.float64), weights, rewards, gradients)
    assert at_b_star.item() <= moments.min().item() + 1e-9
    # and it is a different scalar from the plain mean or the unweighted (on-policy) optimum
    assert abs(b_star - rewards.mean().item()) > 0.01
    on_policy = (sq_norms * rewards).sum().item() / sq_norms.sum().item()
    assert abs(b_star - on_policy) > 0.01


def test_is_factor_appears_once_in_the_baseline_and_once_in_the_coefficients():
    # two trajectories of one group, w = [4, 1] (w̄ = min(w, 8) = w), unweighted ‖∇ℓ‖² = [1, 1], R = [1, 0]
    w, norms, rewards = tensor([4.0, 1.0]), tensor([1.0, 1.0]), tensor([1.0, 0.0])
    valid, groups = torch.ones(2, dtype=torch.bool), single_group(2)
    ours = weighted_mean_baseline(rewards, opob_baseline_weights(norms, w), valid, groups).per_group.item()
    # correct: ω = w²‖∇ℓ‖² = [16, 1] → b* = 16/17 = 0.941176
    assert ours == pytest.approx(16 / 17)
    # the trap: norms of the already-weighted gradient w̄∇ℓ (‖w̄∇ℓ‖² = w̄²‖∇ℓ‖² = [16, 1]) times w² again
    # → ω = [256, 1] → b = 256/257 = 0.996109 ≠ 16/17
    trap_norms = w * w * norms
    trap = weighted_mean_baseline(
        rewards, opob_baseline_weights(trap_norms, w), valid, groups
    ).per_group.item()
    assert trap == pytest.approx(256 / 257) and abs(trap - ours) > 0.05
    # coefficients carry w̄ exactly once: a = w̄R/(σB), s = w̄/(σB) with σ = 1, B = 2 → a = [2, 0], s = [2, 0.5]
    coefficients = vcpo_coefficients(w, rewards, tensor([1.0, 1.0]), valid, batch_size=2, eps=0.0)
    assert coefficients.reward_coef.tolist() == [2.0, 0.0]
    assert coefficients.baseline_coef.tolist() == [2.0, 0.5]


def test_two_buffer_update_equals_the_vcpo_gradient():
    generator = torch.Generator().manual_seed(1)
    gradients = torch.randn(4, 5, generator=generator, dtype=torch.float64)
    truncated, rewards = tensor([2.0, 0.5, 1.0, 8.0]).double(), tensor([1.0, 0.0, 1.0, 0.0]).double()
    std, baseline, keep = torch.full((4,), 0.5, dtype=torch.float64), 0.3, torch.ones(4, dtype=torch.bool)
    a, s = vcpo_coefficients(truncated, rewards, std, keep, batch_size=4, eps=0.0)
    buffer_a, buffer_s = (a[:, None] * gradients).sum(0), (s[:, None] * gradients).sum(0)
    # A − b* S = (1/B) Σ w̄ (R − b*) / σ ∇ℓ
    direct = ((truncated * (rewards - baseline) / 0.5 / 4)[:, None] * gradients).sum(0)
    torch.testing.assert_close(buffer_a - baseline * buffer_s, direct)


def test_degenerate_members_get_exactly_zero_advantage_and_coefficients():
    keep = torch.tensor([True, False])
    advantages = opob_advantages(tensor([1.0, 1.0]), tensor([0.5, 1.0]), tensor([0.5, 0.0]), keep)
    # kept: (1 − 0.5)/(0.5 + 1e-6) ≈ 1; the degenerate one is exactly 0 (never 0/0)
    assert advantages[1].item() == 0.0 and advantages[0].item() == pytest.approx(1.0, rel=1e-5)
    coefficients = vcpo_coefficients(tensor([1.0, 1.0]), tensor([1.0, 1.0]), tensor([0.5, 0.0]), keep, 2)
    assert coefficients.reward_coef[1].item() == 0.0 and coefficients.baseline_coef[1].item() == 0.0
    # without the std division: R − b*
    assert (
        opob_advantages(tensor([1.0]), tensor([0.25]), tensor([0.5]), torch.tensor([True]), False).item()
        == 0.75
    )


def test_vcpo_loss_gradient_is_minus_w_bar_a_over_b():
    seq_logliks = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    truncated, advantages = tensor([2.0, 1.0, 5.0]), tensor([0.5, -1.0, 1.0])
    valid = torch.tensor([True, True, False])
    loss = vcpo_loss(seq_logliks, truncated, advantages, valid)
    # −(1/2)(2·0.5·(−1) + 1·(−1)·(−2)) = −(1/2)(−1 + 2) = −0.5; grad −w̄A/B = [−0.5, 0.5, 0]
    torch.testing.assert_close(loss, tensor(-0.5))
    loss.backward()
    torch.testing.assert_close(seq_logliks.grad, tensor([-0.5, 0.5, 0.0]))
    assert math.isfinite(loss.item())
