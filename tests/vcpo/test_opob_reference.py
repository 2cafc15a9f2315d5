"""The reference OPOB form (the authors' code, mit-han-lab/vcpo): hand-computed weights, the three
aggregations, the σ rule, the coefficients, and the objective's advantages — each against numbers
worked out in the comments."""

import math

import pytest
import torch

from tests.vcpo.helpers import leaf, simple_inputs, tensor
from vcpo.groups import index_groups, single_group
from vcpo.metrics import OPOB_OMEGA_MAX_SHARE, OPOB_SIGNED_GAP, opob_concentration
from vcpo.opob import (
    REFERENCE_AGGREGATIONS,
    reference_baseline_weights,
    reference_coefficients,
    reference_loglik_scale,
    reference_mean_baseline,
    reference_median_baseline,
    reference_std_divisor,
    reference_winsorized_baseline,
)
from vcpo.registry import make_objective

ALL = torch.ones(3, dtype=torch.bool)


def test_reference_weights_are_w_bar_squared_w_squared_and_the_token_sum_norm():
    # ‖∇ mean log π‖² = [0.25, 1, 0.04] with |M| = [2, 1, 5] → ‖∇ Σ log π‖² = [1, 1, 1]
    sq, lengths = tensor([0.25, 1.0, 0.04]), tensor([2.0, 1.0, 5.0])
    log_w = torch.log(tensor([2.0, 1.0, 0.5]))  # w = [2, 1, 0.5]; with C = 1.5, w̄ = [1.5, 1, 0.5]
    one = single_group(3)
    scale = reference_loglik_scale("seq-mean-token-mean", lengths)
    omega = reference_baseline_weights(sq, log_w, 1.5, scale, one)
    # ω = w̄² · w² · 1 = [2.25·4, 1·1, 0.25·0.25] = [9, 1, 0.0625]
    assert omega.tolist() == pytest.approx([9.0, 1.0, 0.0625])
    # use_is_weights off: the authors' weight is the (w̄-carrying) norm alone: [2.25, 1, 0.25]
    assert reference_baseline_weights(sq, log_w, 1.5, scale, one, use_is_weights=False).tolist() == (
        pytest.approx([2.25, 1.0, 0.25]))
    # their clipped ratio in place of w: w̄² · w̄² = [5.0625, 1, 0.0625]
    assert reference_baseline_weights(sq, log_w, 1.5, scale, one, use_clipped_weights=True).tolist() == (
        pytest.approx([5.0625, 1.0, 0.0625]))
    # a token-sum ℓ is already Σ log π: c = 1
    assert reference_loglik_scale("seq-mean-token-sum", lengths).tolist() == [1.0, 1.0, 1.0]
    # normalize_by_length divides by |M|²: [9/4, 1, 0.0625/25]
    assert reference_baseline_weights(sq, log_w, 1.5, scale, one, num_tokens=lengths).tolist() == (
        pytest.approx([2.25, 1.0, 0.0025]))
    with pytest.raises(ValueError, match="token-mean"):
        reference_loglik_scale("token-mean", lengths)


def test_reference_mean_has_the_authors_epsilon_and_no_fallback():
    one = single_group(3)
    rewards, omega = tensor([1.0, 0.0, 0.0]), tensor([9.0, 1.0, 0.0625], torch.float64)
    b = reference_mean_baseline(rewards, omega, ALL, one).per_group
    assert float(b[0]) == pytest.approx(9.0 / (10.0625 + 1e-8), rel=1e-15)
    # all weights 0: b = 0 / (0 + 1e-8) = 0 (the spec would fall back to the group mean 1/3)
    zero = reference_mean_baseline(rewards, torch.zeros(3, dtype=torch.float64), ALL, one)
    assert zero.per_group.tolist() == [0.0] and not bool(zero.is_fallback.any())


def test_reference_median_is_the_first_sorted_reward_reaching_half_the_weight():
    one = single_group(3)
    # sorted rewards [0, 0.5, 1] with ω [1, 0.0625, 9]: cumulative [1, 1.0625, 10.0625], half 5.03 → 1
    omega = tensor([9.0, 1.0, 0.0625], torch.float64)
    b = reference_median_baseline(tensor([1.0, 0.0, 0.5]), omega, ALL, one)
    assert b.per_group.tolist() == [1.0]
    # ω [4, 1, 1] on rewards [0, 0.5, 1]: cumulative [4, 5, 6], half 3 → the first, 0
    b = reference_median_baseline(tensor([0.0, 0.5, 1.0]), tensor([4.0, 1.0, 1.0], torch.float64), ALL, one)
    assert b.per_group.tolist() == [0.0]


def test_reference_winsorized_mean_clips_the_rewards_not_the_weights():
    one = single_group(3)
    rewards, omega = tensor([0.0, 0.5, 1.0]), tensor([1.0, 1.0, 98.0], torch.float64)
    # total 100: cuts 5 and 95; cumulative [1, 2, 100] → both cuts land on R = 1: every reward → 1,
    # b = (1·1 + 1·1 + 98·1)/(100 + 1e-8)
    b = reference_winsorized_baseline(rewards, omega, ALL, one)
    assert float(b.per_group[0]) == pytest.approx(100.0 / (100.0 + 1e-8), rel=1e-15)
    # without clipping (spread weights) it is the plain weighted mean: ω [40, 20, 40] → cuts 5 → R=0,
    # 95 → R=1, nothing clipped: (0·40 + 0.5·20 + 1·40)/100 = 0.5
    b = reference_winsorized_baseline(rewards, tensor([40.0, 20.0, 40.0], torch.float64), ALL, one)
    assert float(b.per_group[0]) == pytest.approx(50.0 / (100.0 + 1e-8), rel=1e-15)
    assert set(REFERENCE_AGGREGATIONS) == {"weighted_mean", "weighted_median", "winsorized_mean"}


def test_reference_aggregations_work_per_group_and_skip_invalid_members():
    groups = index_groups(torch.tensor([0, 0, 1, 1]))
    rewards, omega = tensor([1.0, 0.0, 1.0, 0.0]), tensor([3.0, 1.0, 1.0, 100.0], torch.float64)
    valid = torch.tensor([True, True, True, False])  # the heavy member of group 1 does not count
    b = reference_mean_baseline(rewards, omega, valid, groups)
    assert b.per_group.tolist() == pytest.approx([3.0 / (4.0 + 1e-8), 1.0 / (1.0 + 1e-8)], rel=1e-15)


def test_reference_std_divides_only_above_the_floor_and_has_no_bessel_or_epsilon():
    sigma = tensor([0.5, 0.0, 1e-9], torch.float64)
    assert reference_std_divisor(sigma, True).tolist() == [0.5, 1.0, 1.0]
    assert reference_std_divisor(sigma, False).tolist() == [1.0, 1.0, 1.0]


def test_reference_coefficients_keep_degenerate_groups_and_carry_w_bar_once():
    w_bar, rewards = tensor([1.5, 1.0]), tensor([1.0, 0.0])
    coefs = reference_coefficients(w_bar, rewards, tensor([0.5, 1.0], torch.float64),
                                   torch.tensor([True, True]), 4)
    # a = w̄ R / (d B) = [1.5·1/(0.5·4), 0], s = w̄/(d B) = [0.75, 0.25]
    assert coefs.reward_coef.tolist() == pytest.approx([0.75, 0.0])
    assert coefs.baseline_coef.tolist() == pytest.approx([0.75, 0.25])


def test_reference_objective_advantages_hand_computed():
    # one group: R = [1, 0, 0], every ℓ_i one token (|M| = 1), ‖∇ℓ‖² = [1, 1, 1], w = 1 (ratio 1)
    logprobs = leaf([[-1.0], [-2.0], [-0.5]])
    inputs = simple_inputs(logprobs, [1.0, 0.0, 0.0], [0, 0, 0], seq_sq_grad_norms=tensor([1.0, 1.0, 1.0]))
    out = make_objective("vcpo", form="reference")(inputs)
    # ω = [1, 1, 1] → b = 1/(3 + 1e-8); σ_pop = sqrt(2/9) = 0.4714; A = (R − b)/σ
    b, sigma = 1.0 / (3.0 + 1e-8), math.sqrt(2.0 / 9.0)
    expected = [(1.0 - b) / sigma, -b / sigma, -b / sigma]
    assert out.advantages[:, 0].tolist() == pytest.approx(expected, rel=1e-6)
    # the spec's on the same batch: σ with Bessel (sqrt(1/3)) + 1e-6, b = 1/3
    spec = make_objective("vcpo")(inputs)
    sigma_b = math.sqrt(1.0 / 3.0) + 1e-6
    assert spec.advantages[:, 0].tolist() == pytest.approx([(2 / 3) / sigma_b, (-1 / 3) / sigma_b,
                                                            (-1 / 3) / sigma_b], rel=1e-6)


def test_reference_objective_leaves_an_all_equal_group_a_tiny_residual_the_spec_zeroes():
    logprobs = leaf([[-1.0], [-2.0]])
    inputs = simple_inputs(logprobs, [1.0, 1.0], [0, 0], seq_sq_grad_norms=tensor([1.0, 1.0]))
    reference = make_objective("vcpo", form="reference")(inputs).advantages[:, 0]
    # σ = 0 → no division; b = 2/(2 + 1e-8); A = 1 − b = 1e-8/(2 + 1e-8) ≈ 5e-9 (fp32)
    assert reference.tolist() == pytest.approx([5e-9, 5e-9], rel=1e-3)
    assert make_objective("vcpo")(inputs).advantages[:, 0].tolist() == [0.0, 0.0]


def test_reference_form_rejects_what_the_authors_code_cannot_do():
    with pytest.raises(ValueError, match="form='reference' supports scope='group' only"):
        make_objective("vcpo", form="reference", scope="minibatch")
    with pytest.raises(ValueError, match="loss_aggregation"):
        make_objective("vcpo", form="reference", loss_aggregation="token-mean")
    with pytest.raises(ValueError, match="form='bogus'"):
        make_objective("vcpo", form="bogus")


def test_concentration_and_signed_gap_metrics():
    groups = index_groups(torch.tensor([0, 0, 1, 1]))
    share = opob_concentration(tensor([3.0, 1.0, 1.0, 1.0]), torch.ones(4, dtype=torch.bool), groups)
    # group 0: 3/4, group 1: 1/2 → mean 0.625
    assert float(share[OPOB_OMEGA_MAX_SHARE]) == pytest.approx(0.625)
    logprobs = leaf([[-1.0], [-2.0], [-0.5]])
    inputs = simple_inputs(logprobs, [1.0, 0.0, 0.0], [0, 0, 0], seq_sq_grad_norms=tensor([4.0, 1.0, 1.0]))
    metrics = make_objective("vcpo")(inputs).metrics
    # ω = [4, 1, 1] → b = 4/6; group mean 1/3 → b − mean = 1/3; max share 4/6
    assert float(metrics[OPOB_SIGNED_GAP]) == pytest.approx(1.0 / 3.0, rel=1e-6)
    assert float(metrics[OPOB_OMEGA_MAX_SHARE]) == pytest.approx(4.0 / 6.0, rel=1e-6)
