"""Loss aggregation modes."""

import pytest
import torch

from tests.vcpo.helpers import tensor
from vcpo.aggregation import (
    LOSS_AGGREGATIONS,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
)

LOSSES = tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [float("nan"), 7.0, 8.0]])
MASK = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])


def test_token_mean_weighs_every_token_equally():
    # (1 + 2 + 4) / 3 tokens = 7/3; the fully masked row (with a NaN) contributes nothing
    torch.testing.assert_close(token_mean(LOSSES, MASK), tensor(7 / 3))
    # a global token count of 4 from other micro-batches: 7/4
    torch.testing.assert_close(token_mean(LOSSES, MASK, num_units=4), tensor(7 / 4))


def test_seq_mean_token_mean_weighs_every_trajectory_equally():
    # ((1 + 2)/2 + 4/1) / 2 sequences with tokens = (1.5 + 4) / 2 = 2.75
    torch.testing.assert_close(seq_mean_token_mean(LOSSES, MASK), tensor(2.75))


def test_seq_mean_token_sum():
    # ((1 + 2) + 4) / 2 = 3.5
    torch.testing.assert_close(seq_mean_token_sum(LOSSES, MASK), tensor(3.5))


def test_seq_mean_token_sum_norm_divides_by_a_constant():
    # 3.5 / T = 3.5 / 3; with N = 7: 3.5 / 7 = 0.5
    torch.testing.assert_close(seq_mean_token_sum_norm(LOSSES, MASK), tensor(3.5 / 3))
    torch.testing.assert_close(seq_mean_token_sum_norm(LOSSES, MASK, normalizer=7.0), tensor(0.5))


@pytest.mark.parametrize("name", sorted(LOSS_AGGREGATIONS))
def test_every_mode_gives_finite_zero_gradient_to_masked_nan_tokens(name):
    losses = LOSSES.clone().requires_grad_(True)
    LOSS_AGGREGATIONS[name](losses, MASK).backward()
    assert torch.isfinite(losses.grad).all()
    assert losses.grad[~MASK].abs().sum().item() == 0.0


def test_empty_mask_gives_zero_loss():
    empty = torch.zeros_like(MASK)
    for aggregate in LOSS_AGGREGATIONS.values():
        assert aggregate(LOSSES, empty).item() == 0.0
