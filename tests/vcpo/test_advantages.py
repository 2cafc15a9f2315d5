"""Outcome advantages: GRPO, Dr. GRPO, RLOO, REINFORCE."""

import torch

from tests.vcpo.helpers import tensor
from vcpo.advantages import dr_grpo_advantages, grpo_advantages, reinforce_advantages, rloo_advantages
from vcpo.groups import index_groups

GROUPS = index_groups(torch.tensor([0, 0, 0, 0, 1, 1]))
ALL_VALID = torch.ones(6, dtype=torch.bool)


def test_grpo_normalises_by_group_mean_and_std():
    rewards = tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    # group 0: mean 0.25, σ = sqrt((0.5625 + 3·0.0625)/3) = 0.5 → (1 − 0.25)/0.5 = 1.5, (0 − 0.25)/0.5 = −0.5
    # group 1: all equal → exactly 0
    expected = tensor([1.5, -0.5, -0.5, -0.5, 0.0, 0.0])
    torch.testing.assert_close(grpo_advantages(rewards, GROUPS, ALL_VALID, eps=0.0), expected)
    assert grpo_advantages(rewards, GROUPS, ALL_VALID)[4:].tolist() == [0.0, 0.0]


def test_dr_grpo_only_centres():
    rewards = tensor([1.0, 0.0, 0.0, 0.0, 2.0, 0.0])
    # group 0: 1 − 0.25 = 0.75, −0.25; group 1: mean 1 → ±1
    expected = tensor([0.75, -0.25, -0.25, -0.25, 1.0, -1.0])
    torch.testing.assert_close(dr_grpo_advantages(rewards, GROUPS, ALL_VALID), expected)


def test_rloo_uses_the_mean_of_the_other_members():
    rewards = tensor([1.0, 0.0, 0.0, 0.0, 2.0, 0.0])
    # group 0: 1 − (0+0+0)/3 = 1, 0 − (1+0+0)/3 = −1/3; group 1: 2 − 0 = 2, 0 − 2 = −2
    expected = tensor([1.0, -1 / 3, -1 / 3, -1 / 3, 2.0, -2.0])
    torch.testing.assert_close(rloo_advantages(rewards, GROUPS, ALL_VALID), expected)


def test_reinforce_uses_the_batch_mean():
    rewards = tensor([1.0, 0.0, 0.0, 3.0])
    # batch mean 1 → [0, −1, −1, 2]
    assert reinforce_advantages(rewards, torch.ones(4, dtype=torch.bool)).tolist() == [0.0, -1.0, -1.0, 2.0]


def test_singleton_group_has_zero_advantage():
    groups = index_groups(torch.tensor([0, 1, 1]))
    rewards = tensor([5.0, 1.0, 0.0])
    valid = torch.ones(3, dtype=torch.bool)
    for advantages in (
        grpo_advantages(rewards, groups, valid),
        dr_grpo_advantages(rewards, groups, valid),
        rloo_advantages(rewards, groups, valid),
    ):
        assert advantages[0].item() == 0.0 and advantages[1].item() > 0


def test_invalid_trajectories_are_excluded_from_group_statistics():
    groups = index_groups(torch.tensor([0, 0, 0]))
    rewards = tensor([1.0, 0.0, float("inf")])
    valid = torch.tensor([True, True, False])
    # the inf reward is ignored: group {1, 0} → mean 0.5, σ = sqrt(0.5) = 0.707107 → ±0.707107, and 0
    torch.testing.assert_close(
        grpo_advantages(rewards, groups, valid, eps=0.0), tensor([0.707107, -0.707107, 0.0])
    )
    torch.testing.assert_close(rloo_advantages(rewards, groups, valid), tensor([1.0, -1.0, 0.0]))
    assert reinforce_advantages(rewards, valid).tolist() == [0.5, -0.5, 0.0]
