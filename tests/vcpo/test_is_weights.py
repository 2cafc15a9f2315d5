"""IS weights, truncation, token TIS weights and the effective sample size."""

import math

import torch

from tests.vcpo.helpers import tensor
from vcpo.is_weights import (
    effective_sample_size,
    ess_ratio,
    sequence_is_weights,
    sequence_log_ratios,
    token_log_ratios,
    truncated_is_weights,
)


def test_token_log_ratios_are_zero_off_the_mask_even_for_nonfinite_values():
    logprobs = tensor([[-1.0, -2.0, float("nan")]])
    behavior = tensor([[-1.5, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False]])
    # ℓ = log π − log μ: −1 − (−1.5) = 0.5, −2 − (−1) = −1, masked → 0
    assert token_log_ratios(logprobs, behavior, mask).tolist() == [[0.5, -1.0, 0.0]]
    # L = 0.5 − 1 = −0.5
    assert sequence_log_ratios(logprobs, behavior, mask).tolist() == [-0.5]


def test_sequence_weights_clamp_the_log_ratio_before_exp():
    weights = sequence_is_weights(tensor([math.log(2.0), 500.0, -500.0]), max_log_ratio=20.0)
    # exp(log 2) = 2; exp(500) would overflow fp32 → exp(20); exp(−500) → exp(−20)
    torch.testing.assert_close(weights, tensor([2.0, math.exp(20.0), math.exp(-20.0)]))
    assert torch.isfinite(weights).all()


def test_truncated_weights_cap_at_c():
    # w̄ = min(w, 8): 0.5 → 0.5, 8 → 8, 100 → 8
    assert truncated_is_weights(tensor([0.5, 8.0, 100.0]), cap=8.0).tolist() == [0.5, 8.0, 8.0]


def test_ess_ratio_is_exactly_one_for_equal_weights():
    for value in (-3.0, 0.0, 7.5):
        log_w = torch.full((5,), value)
        # (Σw)²/Σw² = (5w)²/(5w²) = 5 → ρ = 5/5 = 1
        assert effective_sample_size(log_w).item() == 5.0
        assert ess_ratio(log_w).item() == 1.0


def test_ess_ratio_is_one_over_b_for_one_dominant_weight():
    # w = [e^0, e^-200, ...]: the others underflow to 0 after the max shift → ESS = 1² / 1² = 1, ρ = 1/4
    log_w = tensor([0.0, -200.0, -200.0, -200.0])
    assert effective_sample_size(log_w).item() == 1.0
    assert ess_ratio(log_w).item() == 0.25
    # a huge dominant log-weight does not overflow: shifted, it is exactly 1
    assert ess_ratio(tensor([300.0, 0.0, 0.0, 0.0])).item() == 0.25


def test_ess_hand_computed_and_masked():
    log_w = torch.log(tensor([1.0, 2.0, 4.0, 16.0, 1e6]))
    valid = torch.tensor([True, True, True, True, False])
    # (1 + 2 + 4 + 16)² / (1 + 4 + 16 + 256) = 529 / 277 = 1.909747; ρ = 1.909747 / 4 = 0.477437
    torch.testing.assert_close(effective_sample_size(log_w, valid), tensor(1.909747))
    torch.testing.assert_close(ess_ratio(log_w, valid), tensor(0.477437))


def test_ess_of_nothing_valid_is_zero():
    valid = torch.zeros(3, dtype=torch.bool)
    assert effective_sample_size(tensor([1.0, 2.0, 3.0]), valid).item() == 0.0
    assert ess_ratio(tensor([1.0, 2.0, 3.0]), valid).item() == 0.0
