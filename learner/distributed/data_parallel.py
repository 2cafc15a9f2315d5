"""Data parallelism for the torch learner: whole groups per rank, one summed gradient.

Every rank receives the whole minibatch (trajectories are small next to the model) and deals its
groups out the same way (`assign_groups`: largest group first, to the rank with the fewest tokens), so
no coordination is needed to agree on who trains what. A rank then runs forwards and backwards only
for its own groups. Because a group never spans ranks, everything the objectives compute *within* a
group — GRPO's mean and σ, VCPO's optimal baseline b*_g from the members' ‖∇ℓ_i‖² — is local; the
collectives are:

1. the proximal log-probs (and the reference/OTB statistics when the objective needs them): each rank
   fills its own trajectories, a SUM all-reduce gives every rank the whole minibatch, from which it
   computes the same IS weights, ESS, step size and metrics as a single process would;
2. VCPO's per-trajectory squared norms (for its metrics), the same way;
3. the gradient: a SUM all-reduce in flat buckets (the loss is normalised by minibatch-wide
   denominators, so the per-rank gradients add up to the single-process one). Parameters that no
   rank touched keep `grad=None`, as they would in one process (AdamW skips them).

Then every replica clips and steps with identical gradients and learning rate, so the replicas stay
identical without ever broadcasting weights. Equality with one process is exact up to float summation
order for objectives whose loss is a sum over groups (all of vcpo/'s objectives compute their
statistics per group; the learner already evaluates losses per micro-batch of whole groups).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn

from learner.distributed.weight_transport import plan_buckets, weight_specs

log = logging.getLogger(__name__)


def assign_groups(group_tokens: dict[int, int], world_size: int) -> dict[int, int]:
    """group id → rank: largest group first (ties: first seen), each to the least-loaded rank (ties: the
    lowest). Deterministic, so every rank computes the same assignment from the same minibatch."""
    load = [0] * world_size
    order = sorted(group_tokens, key=lambda g: -group_tokens[g])  # stable: ties keep first-seen order
    owner = {}
    for group in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[group] = rank
        load[rank] += group_tokens[group]
    return owner


@dataclass
class DataParallel:
    """This process's place in the data-parallel group (torch.distributed must be initialised)."""

    rank: int
    world_size: int
    group: Any = None
    """The torch.distributed process group; None = the default (WORLD)."""
    bucket_mb: int = 64
    """Gradient all-reduce bucket size."""

    def all_reduce_sum_(self, tensor: Tensor) -> Tensor:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=self.group)
        return tensor

    def all_reduce_concat_(self, parts: Sequence[Tensor]) -> list[Tensor]:
        """SUM-all-reduce a list of 1-D tensors (same lengths on every rank) in one call."""
        if not parts:
            return []
        sizes = [part.numel() for part in parts]
        flat = self.all_reduce_sum_(torch.cat([part.reshape(-1).float() for part in parts]))
        return list(flat.split(sizes))

    def all_reduce_grads_(self, parameters: Sequence[nn.Parameter]) -> None:
        """Sum every parameter's gradient over the ranks (zeros stand in for a rank's missing grads);
        a parameter without a gradient on every rank keeps grad=None."""
        if not parameters:
            return
        device = parameters[0].device
        has_grad = torch.tensor([p.grad is not None for p in parameters], dtype=torch.float32, device=device)
        self.all_reduce_sum_(has_grad)
        live = [p for p, flag in zip(parameters, has_grad.tolist(), strict=True) if flag > 0]
        for p in live:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_name = {str(i): p for i, p in enumerate(live)}  # buckets as for the weight broadcast
        for bucket in plan_buckets(weight_specs((n, p.grad) for n, p in by_name.items()), self.bucket_mb):
            params = [by_name[name] for name, _, _ in bucket.members]
            flat = self.all_reduce_sum_(torch.cat([p.grad.reshape(-1) for p in params]))
            for p, chunk in zip(params, flat.split([p.grad.numel() for p in params]), strict=True):
                p.grad.copy_(chunk.view_as(p.grad))


def join_data_parallel_from_env(device: torch.device, timeout_s: float = 600.0) -> DataParallel | None:
    """A DataParallel over WORLD when the process was started as one of several ranks (torchrun, or the Ray
    launcher's learner ranks: RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT); None for a single process.
    Initialises torch.distributed (NCCL on CUDA, gloo on CPU) unless already done."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return None
    dist = torch.distributed
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        log.info("learner: data-parallel rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend)
    return DataParallel(rank=dist.get_rank(), world_size=dist.get_world_size())
