"""Degenerate groups and non-finite inputs give counted, finite results for every objective."""

import dataclasses
import math

import pytest
import torch

from tests.vcpo.helpers import tensor
from vcpo.groups import index_groups
from vcpo.objectives import PolicyLossInputs
from vcpo.registry import OBJECTIVES, make_objective

NAN, INF = float("nan"), float("inf")
# trajectory: group  reward  note
#   0          0      1
#   1          0      0
#   2          0      1      NaN log π on a trained token → excluded
#   3          1      1      group 1: all rewards equal → degenerate
#   4          1      1
#   5          2      1      group 2: singleton → degenerate
#   6          3      1      inf behaviour log-prob on an UNtrained position → still valid; L = +500 (clamped)
#   7          3      0
#   8          3      inf    inf reward → excluded
GROUP_IDS = [0, 0, 0, 1, 1, 2, 3, 3, 3]
REWARDS = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, INF]
EXCLUDED = [2, 8]
DEGENERATE_MEMBERS = [3, 4, 5]


def _hostile_inputs(norms=None) -> tuple[PolicyLossInputs, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    params = torch.randn(9, 3, generator=generator).requires_grad_(True)
    nan_mask = torch.zeros(9, 3, dtype=torch.bool)
    nan_mask[2, 1] = True
    logprobs = torch.where(nan_mask, torch.full((9, 3), NAN), torch.nn.functional.logsigmoid(params))
    loss_mask = torch.ones(9, 3, dtype=torch.bool)
    loss_mask[6, 2] = False
    behavior = logprobs.detach() - 0.2 * torch.randn(9, 3, generator=generator)
    behavior[6, 0] = logprobs[6, 0].detach() - 500.0  # w_6 = e^500 before the clamp
    behavior[6, 2] = INF
    inputs = PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=logprobs.detach().clone(),
        behavior_logprobs=behavior,
        loss_mask=loss_mask,
        rewards=tensor(REWARDS),
        group_ids=torch.tensor(GROUP_IDS),
        lags=torch.arange(9),
        ref_logprobs=logprobs.detach() - 0.1,
        seq_sq_grad_norms=torch.rand(9, generator=generator) + 0.1 if norms is None else norms,
        sum_probs_squared=torch.full((9, 3), 0.4),
        entropy=torch.full((9, 3), 0.5),
    )
    return inputs, params


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_hostile_batch_gives_finite_loss_and_gradient_with_counts(name):
    inputs, params = _hostile_inputs()
    out = make_objective(name, kl_coef=0.01, entropy_coef=0.01)(inputs)
    (grad,) = torch.autograd.grad(out.loss, params)
    assert math.isfinite(out.loss.item()) and torch.isfinite(grad).all()
    # finite, but for a staleness bin that holds no trajectory of this batch (NaN: "none"), never ±inf
    for key, value in out.metrics.items():
        empty_allowed = key.startswith(("is/by_lag/", "is/mismatch/", "is/staleness/"))
        ok = (torch.isfinite(value) | torch.isnan(value)) if empty_allowed else torch.isfinite(value)
        assert ok.all(), key
    # excluded trajectories: no gradient, no advantage, counted
    assert grad[EXCLUDED].abs().sum().item() == 0.0
    assert out.advantages[EXCLUDED].abs().sum().item() == 0.0
    assert out.valid.tolist() == [index not in EXCLUDED for index in range(9)]
    assert out.counts.nonfinite_trajectories.item() == 2
    # groups 1 (all equal) and 2 (singleton); groups 0 and 3 keep signal after the exclusions
    assert out.counts.degenerate_groups.item() == 2
    assert out.counts.trained_tokens.item() == 7 * 3 - 1
    assert torch.isfinite(out.log_is_weights).all()


@pytest.mark.parametrize("name", sorted(set(OBJECTIVES) - {"reinforce", "tba"}))
def test_degenerate_group_members_get_exactly_zero_advantage(name):
    inputs, _ = _hostile_inputs()
    out = make_objective(name)(inputs)
    assert out.advantages[DEGENERATE_MEMBERS].abs().sum().item() == 0.0


def test_zero_gradient_norms_fall_back_to_the_group_mean_and_are_counted():
    inputs, _ = _hostile_inputs(norms=torch.zeros(9))
    vcpo = make_objective("vcpo")(inputs)
    # every group with valid members (4) falls back to its mean reward: b* = mean_g → GRPO's advantages;
    # counted where b* is used: groups 0 and 3 (groups 1 and 2 are degenerate, their advantages exactly 0)
    assert vcpo.counts.baseline_fallbacks.item() == 2
    grpo = make_objective("grpo")(inputs)
    torch.testing.assert_close(vcpo.advantages, grpo.advantages)


def test_nonfinite_gradient_norms_are_counted_and_ignored():
    norms = torch.ones(9)
    norms[0] = NAN
    inputs, _ = _hostile_inputs(norms=norms)
    out = make_objective("vcpo")(inputs)
    assert out.counts.nonfinite_grad_norms.item() == 1
    # group 0 = {0 (ω = 0 now), 1}: b* = R_1 = 0 → trajectory 1's advantage R − b* = 0
    assert out.advantages[1].abs().sum().item() == 0.0 and math.isfinite(out.loss.item())


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_all_trajectories_excluded_gives_zero_loss_and_zero_gradient(name):
    inputs, params = _hostile_inputs()
    inputs = dataclasses.replace(inputs, rewards=torch.full((9,), NAN))
    out = make_objective(name)(inputs)
    (grad,) = torch.autograd.grad(out.loss, params, allow_unused=False)
    assert out.loss.item() == 0.0 and grad.abs().sum().item() == 0.0
    assert out.counts.nonfinite_trajectories.item() == 9 and out.counts.trajectories.item() == 0


@pytest.mark.parametrize("divide_by_std", [True, False])
def test_an_all_equal_group_of_an_inexact_reward_is_degenerate_for_vcpo(divide_by_std):
    # eight rewards of 0.1 (the default run's format reward): float32 σ_g is ~8e-9, not 0; the group is still
    # degenerate (advantages and the learner's two-buffer coefficients exactly 0); the other group is kept
    rewards = torch.tensor([0.1] * 8 + [0.1] * 7 + [1.0])
    groups_ids = torch.tensor([0] * 8 + [1] * 8)
    valid = torch.ones(16, dtype=torch.bool)
    inputs = PolicyLossInputs(
        logprobs=torch.full((16, 2), -1.0), old_logprobs=torch.full((16, 2), -1.0),
        behavior_logprobs=torch.full((16, 2), -1.1), loss_mask=torch.ones(16, 2, dtype=torch.bool),
        rewards=rewards, group_ids=groups_ids, lags=torch.zeros(16, dtype=torch.long),
        seq_sq_grad_norms=torch.linspace(0.5, 2.0, 16))
    vcpo = make_objective("vcpo", divide_by_std=divide_by_std)
    out = vcpo(inputs)
    assert out.advantages[:8].abs().sum().item() == 0.0
    assert out.advantages[8:].abs().sum().item() > 0.0
    coefficients = vcpo.gradient_coefficients(torch.ones(16), rewards, valid, index_groups(groups_ids), 16)
    assert coefficients.reward_coef[:8].abs().sum().item() == 0.0
    assert coefficients.baseline_coef[:8].abs().sum().item() == 0.0
    assert coefficients.baseline_coef[8:].min().item() > 0.0
    assert out.counts.degenerate_groups.item() == 1
