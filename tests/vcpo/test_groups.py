"""Group statistics as index operations."""

import torch

from tests.vcpo.helpers import tensor
from vcpo.groups import (
    degenerate_groups,
    group_count,
    group_mean,
    group_std,
    group_sum,
    index_groups,
    single_group,
)


def test_index_groups_numbers_distinct_ids_densely():
    groups = index_groups(torch.tensor([7, 3, 7, 9]))
    # sorted unique ids [3, 7, 9] → dense [1, 0, 1, 2]
    assert groups.num_groups == 3
    assert groups.index.tolist() == [1, 0, 1, 2]


def test_group_sum_count_mean_ignore_invalid_members():
    groups = index_groups(torch.tensor([0, 0, 0, 1]))
    values = tensor([1.0, 2.0, 100.0, 5.0])
    valid = torch.tensor([True, True, False, True])
    # group 0 valid: 1 + 2 = 3 over 2 members → mean 1.5; group 1: 5
    assert group_count(valid, groups).tolist() == [2.0, 1.0]
    assert group_mean(values, valid, groups).tolist() == [1.5, 5.0]
    assert group_sum(tensor([1.0, 2.0, 0.0, 5.0]), groups).tolist() == [3.0, 5.0]


def test_group_std_uses_bessel_and_is_zero_for_singletons():
    groups = index_groups(torch.tensor([0, 0, 0, 1]))
    values = tensor([1.0, 2.0, 3.0, 5.0])
    valid = torch.ones(4, dtype=torch.bool)
    # group 0: mean 2, Σ(x − 2)² = 2, / (3 − 1) = 1 → σ = 1; without Bessel 2/3 → 0.8165; singleton → 0
    torch.testing.assert_close(group_std(values, valid, groups), tensor([1.0, 0.0]))
    torch.testing.assert_close(
        group_std(values, valid, groups, use_bessel_correction=False)[0], tensor(0.816497)
    )


def test_degenerate_groups_are_singletons_and_all_equal_groups():
    groups = index_groups(torch.tensor([0, 0, 1, 2, 2, 3, 3]))
    values = tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 9.0])
    valid = torch.tensor([True, True, True, True, True, True, False])
    # group 0 all equal; group 1 singleton; group 2 has signal; group 3 has one valid member → singleton
    assert degenerate_groups(values, valid, groups).tolist() == [True, True, False, True]


def test_single_group_puts_everything_in_group_zero():
    groups = single_group(3)
    assert groups.num_groups == 1 and groups.index.tolist() == [0, 0, 0]
