"""Moving weights between Ray actors: the object store, or a bucketed broadcast group.

* Object store: the learner puts one `{name: (dtype, ndarray)}` dict (`pack_weights`); every
  rollout worker reads it (zero-copy on a node: numpy arrays in shared memory) and loads it. bf16
  has no numpy dtype, so it travels as its int16 bit pattern.
* Broadcast: learner rank 0 and the rollout workers join one torch.distributed group
  (`rollout/engines/weight_group.py`: NCCL on GPUs, gloo on CPU); rank 0 flattens the tensors into buckets
  of about `bucket_mb` (one dtype per bucket) and broadcasts them in order; each worker receives the
  same buckets from the plan both sides derive from the same specs and splits them again.

Nothing here knows about actors or engines; `run/launch/ray_launcher.py` calls both sides.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from rollout.engines.weight_group import WeightGroup

PackedWeights = dict[str, tuple[str, np.ndarray]]
"""HF name → (torch dtype name, numpy array): what travels through the object store."""

WeightSpec = tuple[str, str, tuple[int, ...]]
"""(HF name, torch dtype name, shape) of one tensor, in the learner's order."""


def pack_weights(named_tensors: Iterable[tuple[str, Tensor]]) -> PackedWeights:
    """CPU numpy views of the tensors (a copy only when the tensor lives on a GPU or is not contiguous)."""
    packed: PackedWeights = {}
    for name, tensor in named_tensors:
        cpu = tensor.detach().to("cpu").contiguous()
        dtype = str(cpu.dtype).removeprefix("torch.")
        packed[name] = (dtype, (cpu.view(torch.int16) if cpu.dtype == torch.bfloat16 else cpu).numpy())
    return packed


def unpack_weights(packed: PackedWeights) -> list[tuple[str, Tensor]]:
    """Tensors sharing the arrays' memory (read-only object-store pages: engines copy them in)."""
    out = []
    with warnings.catch_warnings():  # object-store arrays are read-only; the engines only read them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, (dtype, array) in packed.items():
            tensor = torch.from_numpy(array)
            out.append((name, tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor))
    return out


def weight_specs(named_tensors: Iterable[tuple[str, Tensor]]) -> list[WeightSpec]:
    return [(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in named_tensors]


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors of one dtype broadcast as one flat buffer."""

    dtype: str
    members: tuple[WeightSpec, ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, _, shape in self.members)



def plan_buckets(specs: list[WeightSpec], bucket_mb: int) -> list[Bucket]:
    """Split `specs` (in order) into buckets of at most ~`bucket_mb` MB, a new one at every dtype change;
    a tensor larger than the budget gets a bucket of its own."""
    limit = bucket_mb * 1024 * 1024
    buckets: list[Bucket] = []
    current: list[WeightSpec] = []
    size = 0
    for spec in specs:
        nbytes = math.prod(spec[2]) * torch.empty(0, dtype=getattr(torch, spec[1])).element_size()
        if current and (spec[1] != current[0][1] or size + nbytes > limit):
            buckets.append(Bucket(current[0][1], tuple(current)))
            current, size = [], 0
        current.append(spec)
        size += nbytes
    if current:
        buckets.append(Bucket(current[0][1], tuple(current)))
    return buckets


def broadcast_weights(group: WeightGroup, named_tensors: Iterable[tuple[str, Tensor]], bucket_mb: int,
                      device: str | torch.device) -> int:
    """Rank 0's side: send every tensor, bucketed, in order. Returns the bytes sent."""
    import torch.distributed as dist

    tensors = dict(named_tensors)
    sent = 0
    for bucket in plan_buckets(weight_specs(tensors.items()), bucket_mb):
        flat = torch.cat([tensors[name].detach().reshape(-1) for name, _, _ in bucket.members]).to(device)
        dist.broadcast(flat, src=0, group=group.group)
        sent += flat.numel() * flat.element_size()
    return sent


def receive_weights(group: WeightGroup, specs: list[WeightSpec], bucket_mb: int,
                    device: str | torch.device) -> list[tuple[str, Tensor]]:
    """A receiver's side: the same buckets, split back into named tensors (on `device`)."""
    import torch.distributed as dist

    out = []
    for bucket in plan_buckets(specs, bucket_mb):
        flat = torch.empty(bucket.numel, dtype=getattr(torch, bucket.dtype), device=device)
        dist.broadcast(flat, src=0, group=group.group)
        offset = 0
        for name, _, shape in bucket.members:
            count = math.prod(shape)
            out.append((name, flat[offset : offset + count].view(shape)))
            offset += count
    return out
