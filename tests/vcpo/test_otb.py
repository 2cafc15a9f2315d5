"""Optimal token baseline: logit-gradient proxy, realized energy, per-token baseline."""

import torch

from tests.vcpo.helpers import tensor
from vcpo.groups import index_groups
from vcpo.otb import (
    logit_gradient_energy,
    optimal_token_baseline,
    otb_advantages,
    realized_energy,
    sum_probs_squared_from_logits,
)


def test_energy_equals_the_squared_norm_of_the_logit_gradient():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 7, generator=generator, dtype=torch.float64).requires_grad_(True)
    tokens = torch.randint(0, 7, (2, 3), generator=generator)
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)
    (grad,) = torch.autograd.grad(logprobs.sum(), logits)  # per position: e_y − p
    exact = (grad * grad).sum(dim=-1)
    energy = logit_gradient_energy(
        logprobs, sum_probs_squared_from_logits(logits), torch.ones(2, 3, dtype=torch.bool)
    )
    torch.testing.assert_close(energy, exact.float(), rtol=1e-5, atol=1e-6)


def test_sum_probs_squared_hand_computed():
    # logits [0, log 3] → p = [1/4, 3/4] → Σp² = 1/16 + 9/16 = 0.625
    torch.testing.assert_close(sum_probs_squared_from_logits(tensor([[[0.0, 1.0986123]]])), tensor([[0.625]]))


def test_realized_energy_accumulates_along_generated_tokens_only():
    energy = tensor([[0.5, 9.0, 0.25, 1.0]])
    mask = torch.tensor([[True, False, True, True]])
    # W = cumsum over M: [0.5, –, 0.75, 1.75]; with w̄ = 2: × 4
    assert realized_energy(energy, mask).tolist() == [[0.5, 0.0, 0.75, 1.75]]
    assert realized_energy(energy, mask, tensor([2.0])).tolist() == [[2.0, 0.0, 3.0, 7.0]]


def test_optimal_token_baseline_hand_computed_and_aligned_by_generated_index():
    # trajectory 1 has a tool token at position 1 (mask False): its k-th generated tokens are at 0, 2
    mask = torch.tensor([[True, True, False], [True, False, True]])
    logprobs = torch.log(tensor([[0.5, 0.5, 1.0], [0.9, 1.0, 0.25]]))
    sum_sq = tensor([[0.5, 0.5, 0.0], [0.82, 0.0, 0.25]])
    # e = 1 − 2p + Σp²: traj 0 [0.5, 0.5] → W [0.5, 1.0]; traj 1 [0.02, 0.75] → W [0.02, 0.77]
    realized = realized_energy(logit_gradient_energy(logprobs, sum_sq, mask), mask)
    returns = tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    result = optimal_token_baseline(returns, realized, mask, index_groups(torch.tensor([0, 0])))
    # k = 0: (1·0.5 + 0·0.02)/0.52 = 0.961538; k = 1: (1·1.0 + 0·0.77)/1.77 = 0.564972
    expected = tensor([[0.961538, 0.564972, 0.0], [0.961538, 0.0, 0.564972]])
    torch.testing.assert_close(result.baseline, expected)
    advantages = otb_advantages(returns, result.baseline, mask)
    torch.testing.assert_close(advantages, tensor([[0.038462, 0.435028, 0.0], [-0.961538, 0.0, -0.564972]]))
    assert not result.is_fallback.any()


def test_zero_energy_cells_fall_back_to_the_plain_mean():
    mask = torch.ones(2, 1, dtype=torch.bool)
    result = optimal_token_baseline(
        tensor([[1.0], [0.0]]), torch.zeros(2, 1), mask, index_groups(torch.tensor([0, 0]))
    )
    # Σ W = 0 → mean of G = 0.5, reported as a fallback
    assert result.baseline.tolist() == [[0.5], [0.5]]
    assert result.is_fallback.all()
