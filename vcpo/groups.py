"""Prompt groups as index tensors: per-group sums, counts, means and standard deviations.

A batch of B trajectories carries `group_ids` (B,) long: trajectories with the same id were
sampled from the same prompt. Everything here is vectorised with `index_add_` / gathers; there
are no Python loops over groups. Trajectories marked invalid (non-finite inputs) are excluded
from every statistic by giving them weight 0.

Deliberately not here: anything about advantages or baselines (see advantages.py, opob.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class GroupIndex(NamedTuple):
    """Dense group numbering of a batch.

    index: (B,) long in [0, num_groups): the dense group of each trajectory.
    num_groups: G, the number of distinct `group_ids`.
    """

    index: Tensor
    num_groups: int


def index_groups(group_ids: Tensor) -> GroupIndex:
    """Number the distinct ids of `group_ids` densely.

    group_ids: (B,) long, any values; equal ids = same prompt group.
    Cost: one device sync (`torch.unique` has a data-dependent size).
    """
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be 1-D (B,), got shape {tuple(group_ids.shape)}")
    unique_ids, inverse = torch.unique(group_ids, return_inverse=True)
    return GroupIndex(index=inverse, num_groups=int(unique_ids.numel()))


def single_group(batch_size: int, device: torch.device | str = "cpu") -> GroupIndex:
    """Every trajectory in one group (the 'minibatch' scope of a baseline)."""
    return GroupIndex(index=torch.zeros(batch_size, dtype=torch.long, device=device), num_groups=1)


def group_sum(values: Tensor, groups: GroupIndex) -> Tensor:
    """Σ of `values` (B,) over each group → (G,). Invalid entries must already be zero."""
    out = torch.zeros(groups.num_groups, dtype=values.dtype, device=values.device)
    return out.index_add_(0, groups.index, values)


def group_count(valid: Tensor, groups: GroupIndex) -> Tensor:
    """Number of valid trajectories per group → (G,) float. valid: (B,) bool."""
    return group_sum(valid.to(torch.float32), groups)


def group_mean(values: Tensor, valid: Tensor, groups: GroupIndex) -> Tensor:
    """Mean of `values` (B,) over the valid members of each group → (G,); 0 for empty groups."""
    values = torch.where(valid, values, torch.zeros_like(values))
    count = group_count(valid, groups).to(values.dtype)
    return group_sum(values, groups) / count.clamp_min(1.0)


def group_std(
    values: Tensor, valid: Tensor, groups: GroupIndex, use_bessel_correction: bool = True
) -> Tensor:
    """Standard deviation of `values` (B,) over the valid members of each group → (G,).

    σ_g = sqrt(Σ_{i∈g} (x_i − x̄_g)² / (n_g − 1))  (Bessel, like torch.std and GRPO implementations),
    or / n_g without the correction. Groups with fewer than 2 valid members (1 without Bessel)
    get σ_g = 0, which callers treat as a degenerate group.
    """
    mean = group_mean(values, valid, groups)
    centred = torch.where(valid, values - mean[groups.index], torch.zeros_like(values))
    count = group_count(valid, groups).to(values.dtype)
    dof = count - 1.0 if use_bessel_correction else count
    variance = group_sum(centred * centred, groups) / dof.clamp_min(1.0)
    return torch.where(dof > 0, variance.sqrt(), torch.zeros_like(variance))


def degenerate_groups(values: Tensor, valid: Tensor, groups: GroupIndex) -> Tensor:
    """Groups whose values carry no relative signal → (G,) bool.

    A group is degenerate when it has fewer than two valid members (a singleton) or all its valid
    values are exactly equal (σ_g = 0): every group-relative advantage there must be exactly 0.
    Groups without any valid member are not degenerate (they are simply absent).
    """
    big = torch.finfo(values.dtype).max
    low = torch.full((groups.num_groups,), big, dtype=values.dtype, device=values.device)
    high = torch.full_like(low, -big)
    low = low.scatter_reduce(
        0, groups.index, torch.where(valid, values, torch.full_like(values, big)), "amin"
    )
    high = high.scatter_reduce(
        0, groups.index, torch.where(valid, values, torch.full_like(values, -big)), "amax"
    )
    count = group_count(valid, groups)
    return (count >= 1) & ((count < 2) | (low == high))
