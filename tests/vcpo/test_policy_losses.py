"""PPO clip (clip-higher, dual clip), REINFORCE surrogate, ratio surrogate, trajectory balance."""

import math

import torch

from tests.vcpo.helpers import leaf, tensor
from vcpo.groups import index_groups
from vcpo.policy_losses import (
    clipped_surrogate,
    ppo_clip_token_loss,
    ratio_token_loss,
    reinforce_token_loss,
    tba_vargrad_loss,
)

RATIOS = [1.1, 1.5, 0.5, 2.0, 5.0, 0.9]
ADVANTAGES = tensor([[1.0, 1.0, -1.0, -1.0, -1.0, -1.0]])


def _ppo(ratios, advantages, dual_clip=3.0):
    logprobs = leaf([[math.log(r) for r in ratios]])
    result = ppo_clip_token_loss(logprobs, torch.zeros_like(logprobs), advantages, 0.2, 0.28, dual_clip)
    result.token_loss.sum().backward()
    return result, logprobs.grad


def test_ppo_clip_values_and_clipped_tokens_have_zero_gradient():
    result, grad = _ppo(RATIOS, ADVANTAGES)
    # bounds [0.8, 1.28], c = 3:
    # A=+1, r=1.1: −1.1 (grad −r = −1.1) | A=+1, r=1.5 > 1.28: −1.28 (clipped, grad 0)
    # A=−1, r=0.5 < 0.8: max(0.5, 0.8) = 0.8 (clipped) | A=−1, r=2: max(2, 1.28) = 2 ≤ 3 (grad r = 2)
    # A=−1, r=5: min(5, 3) = 3 (dual-clipped, grad 0) | A=−1, r=0.9: 0.9 (grad 0.9)
    torch.testing.assert_close(result.token_loss, tensor([[-1.1, -1.28, 0.8, 2.0, 3.0, 0.9]]))
    torch.testing.assert_close(grad, tensor([[-1.1, 0.0, 0.0, 2.0, 0.0, 0.9]]))
    assert result.is_clipped.tolist() == [[False, True, True, False, True, False]]


def test_without_dual_clip_negative_advantage_loss_grows_with_the_ratio():
    result, grad = _ppo([5.0], tensor([[-1.0]]), dual_clip=None)
    # −A r = 5, gradient r = 5
    torch.testing.assert_close(result.token_loss, tensor([[5.0]]))
    torch.testing.assert_close(grad, tensor([[5.0]]))


def test_dual_clip_bounds_negative_advantage_loss_by_c_times_abs_a():
    generator = torch.Generator().manual_seed(0)
    log_ratio = 4.0 * torch.randn(1, 200, generator=generator)
    advantages = -torch.rand(1, 200, generator=generator) * 3.0
    loss = clipped_surrogate(log_ratio, advantages, 0.8, 1.28, dual_clip=3.0).token_loss
    assert (loss <= 3.0 * advantages.abs() + 1e-6).all()


def test_extreme_ratios_give_finite_losses_and_gradients():
    # log r = 1000 would overflow exp; the clamp keeps everything finite
    logprobs = leaf([[1000.0, -1000.0]])
    out = ppo_clip_token_loss(logprobs, torch.zeros(1, 2), tensor([[1.0, -1.0]]), dual_clip=None)
    out.token_loss.sum().backward()
    assert torch.isfinite(out.token_loss).all() and torch.isfinite(logprobs.grad).all()


def test_reinforce_token_loss_gradient_is_the_coefficient():
    logprobs = leaf([[-1.0, -2.0]])
    loss = reinforce_token_loss(logprobs, tensor([[0.5]]))
    loss.sum().backward()
    # −c log π = [0.5, 1.0]; gradient −c = −0.5 per token
    torch.testing.assert_close(loss, tensor([[0.5, 1.0]]))
    torch.testing.assert_close(logprobs.grad, tensor([[-0.5, -0.5]]))


def test_ratio_token_loss_is_unclipped():
    log_ratio = leaf([[math.log(3.0)]])
    loss = ratio_token_loss(log_ratio, tensor([[2.0]]))
    loss.sum().backward()
    # −A r = −6; d/dlog r = −A r = −6
    torch.testing.assert_close(loss, tensor([[-6.0]]))
    torch.testing.assert_close(log_ratio.grad, tensor([[-6.0]]))


def test_tba_vargrad_hand_computed():
    seq_logprobs = leaf([-1.0, -2.0, -3.0])
    groups = index_groups(torch.tensor([0, 0, 1]))
    result = tba_vargrad_loss(
        seq_logprobs,
        tensor([-1.5, -1.5, -1.0]),
        tensor([1.0, 0.0, 1.0]),
        torch.ones(3, dtype=torch.bool),
        groups,
        0.5,
    )
    # group 0: δ = log π − log π_ref − R/β = [−1 + 1.5 − 2, −2 + 1.5 − 0] = [−1.5, −0.5]
    # log Ẑ = mean(R/β − log π + log π_ref) = mean([1.5, 0.5]) = 1.0; residuals [−0.5, 0.5]
    # group 1 is a singleton: residual exactly 0. loss = (0.25 + 0.25 + 0) / 3 = 1/6
    torch.testing.assert_close(result.log_partition[:2], tensor([1.0, 1.0]))
    assert result.residuals.tolist() == [-0.5, 0.5, 0.0]
    torch.testing.assert_close(result.loss, tensor(1 / 6))
    result.loss.backward()
    # d loss / d log π_k = 2 r_k / 3 (log Ẑ's own gradient cancels: residuals sum to 0): [−1/3, 1/3, 0]
    torch.testing.assert_close(seq_logprobs.grad, tensor([-1 / 3, 1 / 3, 0.0]))
