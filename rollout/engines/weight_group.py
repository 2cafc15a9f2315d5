"""A torch.distributed group between a trainer and an inference server, for weight broadcasts.

Mirrors the `init_custom_process_group` recipe that SGLang (and verl, OpenRLHF, slime) use on the
server side of `/init_weights_update_group`: TCP rendezvous at master_address:master_port, a store
prefixed with the group name, and `_new_process_group_helper` (a private torch API — the same one
SGLang calls, which is what makes the two sides meet). It needs no default process group, so the
trainer process is free to have its own. Rank 0 broadcasts each tensor in the order of the
`names` list posted with `/update_weights_from_distributed`.

Blocking: joining waits for every rank (bounded by `timeout_s`); each broadcast blocks until all
ranks took it. Call both from a worker thread (the SGLang adapter does).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class WeightGroup:
    """A joined group: its torch ProcessGroup, name and this process's rank."""

    group: Any
    name: str
    rank: int

    @classmethod
    def join(
        cls,
        backend: str,
        master_address: str,
        master_port: int,
        world_size: int,
        rank: int,
        group_name: str,
        timeout_s: float,
    ) -> WeightGroup:
        """Join as `rank` (blocks until all ranks joined). torch registers one group per name per
        process, so the two sides of a group live in different processes."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import (
            PrefixStore,
            _new_process_group_helper,
            _world,
            rendezvous,
        )

        timeout = timedelta(seconds=timeout_s)
        store, rank, world_size = next(
            rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
        )
        store.set_timeout(timeout)
        group, _ = _new_process_group_helper(
            world_size,
            rank,
            [],
            dist.Backend(backend),
            PrefixStore(group_name, store),
            group_name=group_name,
            timeout=timeout,
        )
        _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
        return cls(group, group_name, rank)

    def destroy(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group(self.group)


def broadcast_tensors(group: WeightGroup, named_tensors: list[tuple[str, Tensor]]) -> None:
    """Rank 0 sends every tensor, in order (contiguous; on the group's device for NCCL)."""
    import torch.distributed as dist

    for _, tensor in named_tensors:
        dist.broadcast(tensor.detach().contiguous(), src=0, group=group.group)


def receive_tensors(
    group: WeightGroup, specs: list[tuple[str, str, list[int]]], device: str = "cpu"
) -> list[tuple[str, Tensor]]:
    """The receiving side (a server rank): allocate each (name, dtype, shape) and take its broadcast."""
    import torch
    import torch.distributed as dist

    out = []
    for name, dtype, shape in specs:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(tensor, src=0, group=group.group)
        out.append((name, tensor))
    return out
