"""KL-to-reference estimators and entropy."""

import math

import torch

from tests.vcpo.helpers import tensor
from vcpo.regularizers import KL_ESTIMATORS, entropy_from_logits, kl_k1, kl_k2, kl_k3


def test_kl_estimators_hand_computed():
    logprobs, ref = tensor([-1.0]), tensor([-2.0])
    # x = log π_ref − log π_θ = −1: k1 = −x = 1, k2 = x²/2 = 0.5, k3 = e^{−1} − 1 + 1 = 0.367879
    torch.testing.assert_close(kl_k1(logprobs, ref), tensor([1.0]))
    torch.testing.assert_close(kl_k2(logprobs, ref), tensor([0.5]))
    torch.testing.assert_close(kl_k3(logprobs, ref), tensor([math.exp(-1.0)]))
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3"}


def test_k3_is_zero_at_equal_policies_and_finite_for_extreme_ratios():
    assert kl_k3(tensor([-1.0]), tensor([-1.0])).item() == 0.0
    logprobs = tensor([-500.0]).requires_grad_(True)
    value = kl_k3(logprobs, tensor([0.0]))
    value.sum().backward()
    assert torch.isfinite(value).all() and torch.isfinite(logprobs.grad).all()


def test_entropy_from_logits():
    logits = tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    # uniform over 2 → log 2 = 0.693147; p = [1/4, 3/4] → −(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    torch.testing.assert_close(entropy_from_logits(logits), tensor([[math.log(2.0), 0.562335]]))
