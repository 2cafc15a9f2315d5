"""Context parallelism for the megatron learner's local layers: all-gather attention.

With context parallel size CP > 1 a packed row of N tokens (padded to a multiple of CP by a dummy
trajectory) is cut into CP contiguous chunks; CP rank r embeds and runs only the tokens of chunk r
through every layer. Everything but attention is per token. Attention gathers the keys and values of
the whole row from the CP group and lets the chunk's queries attend to them under the packed causal
mask in global coordinates (`chunk_causal_mask`): the all-gather variant of context parallelism (as in
Llama 3's training), not a ring — simpler, one collective per layer, and the full row's K/V per layer in
memory. The backward sums every rank's gradient of the gathered keys and values (all-reduce) and keeps
this chunk's rows.

The logits of the target positions in each chunk are computed on that chunk's rank and gathered to
every CP rank (`gather_rows_over_context`), whose backward keeps this rank's rows: every CP rank then
holds the same logits, computes the same loss and, from the backward, the gradient of its own tokens'
share of the computation. Those partial gradients sum over the data-parallel × context-parallel group
(megatron's DDP does that) to the whole gradient; VCPO's per-trajectory norms need the sum before
squaring, so the megatron learner all-reduces each trajectory's gradient over CP first.

Imports megatron-core at module level: import it only where megatron is used.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention
from torch import Tensor

from learner.forward.packing import PackedMicroBatch
from learner.traj_grads.split_rows import SplitRows, shared_trajectories


def context_chunk(length: int) -> tuple[int, int, int]:
    """(padded length, start, end) of this CP rank's chunk of a row of `length` tokens."""
    ranks = parallel_state.get_context_parallel_world_size()
    padded = length + (-length % ranks)
    size = padded // ranks
    start = parallel_state.get_context_parallel_rank() * size
    return padded, start, start + size


def split_rows(batch: PackedMicroBatch) -> SplitRows:
    """This CP rank's share of `batch` for VCPO's per-trajectory norm hooks: its chunk of the packed row, the
    target positions inside it (the rows `MegatronCausalLM` computes logits of here), the trajectories that
    cross a chunk boundary, and the CP group's sum."""
    _, start, end = context_chunk(batch.num_tokens)
    targets = batch.target_positions
    first, last = int((targets < start).sum()), int((targets < end).sum())
    group = parallel_state.get_context_parallel_group()

    def reduce(tensor: Tensor) -> None:
        dist.all_reduce(tensor, group=group)

    return SplitRows(tokens=(start, end), targets=(first, last),
                     shared=shared_trajectories(batch.seq_lengths, end - start), reduce=reduce,
                     counts_shared=parallel_state.get_context_parallel_rank() == 0)


def chunk_causal_mask(position_ids: Tensor, start: int, end: int) -> Tensor:
    """(1, 1, end − start, N) bool, True where masked: query t of the chunk [start, end) sees the tokens
    s ≤ t of its own trajectory in the whole row. `position_ids`: (1, N), restarting at 0 where a
    trajectory starts."""
    segments = torch.cumsum(position_ids[0] == 0, dim=0)
    queries = torch.arange(start, end, device=position_ids.device)
    keys = torch.arange(position_ids.shape[1], device=position_ids.device)
    visible = (segments[start:end, None] == segments[None, :]) & (keys[None, :] <= queries[:, None])
    return ~visible[None, None]


class _GatherSequence(torch.autograd.Function):
    """Forward: the CP ranks' chunks concatenated along dim 0. Backward: the sum over the ranks of the
    gathered tensor's gradient, this rank's chunk of it."""

    @staticmethod
    def forward(ctx: Any, chunk: Tensor) -> Tensor:
        group = parallel_state.get_context_parallel_group()
        parts = [torch.empty_like(chunk) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, chunk.contiguous(), group=group)
        ctx.rows = chunk.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=parallel_state.get_context_parallel_group())
        start = parallel_state.get_context_parallel_rank() * ctx.rows
        return summed[start:start + ctx.rows]


class _GatherRows(torch.autograd.Function):
    """Forward: every CP rank's (n_r, ...) rows, concatenated in rank order (`counts[r]` = n_r, known to
    all ranks). Backward: this rank's rows of the gradient (each rank holds the same loss of the gathered
    rows, so no sum)."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, counts: tuple[int, ...]) -> Tensor:
        group = parallel_state.get_context_parallel_group()
        widest = max(max(counts), 1)  # gloo cannot gather empty tensors
        padded = rows.new_zeros((widest, *rows.shape[1:]))
        padded[:rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        rank = parallel_state.get_context_parallel_rank()
        ctx.start, ctx.count = sum(counts[:rank]), counts[rank]
        return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad[ctx.start:ctx.start + ctx.count], None


def gather_rows_over_context(rows: Tensor, counts: tuple[int, ...]) -> Tensor:
    """The rows of every CP rank in rank order, on every rank; see `_GatherRows`."""
    return _GatherRows.apply(rows, counts)


class ContextParallelDotProductAttention(DotProductAttention):
    """megatron's local `DotProductAttention` over keys and values gathered from the CP group: queries
    (s/CP, b, np, hn) of this chunk, keys/values of the whole row. The attention mask must be the
    chunk's (1, 1, s/CP, s) mask in global coordinates (`chunk_causal_mask`)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        # DotProductAttention refuses CP > 1 (megatron's CP is TE's ring attention); the gather is here
        local = copy.copy(config)
        local.context_parallel_size = 1
        super().__init__(local, *args, **kwargs)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                *args: Any, **kwargs: Any) -> Tensor:
        if attention_mask is None:
            raise ValueError("context-parallel attention needs the chunk's packed causal mask")
        key, value = _GatherSequence.apply(key), _GatherSequence.apply(value)
        return super().forward(query, key, value, attention_mask, *args, **kwargs)


def context_parallel_layer_spec(spec: Any) -> Any:
    """megatron's local GPT layer spec, copied, with `ContextParallelDotProductAttention` as its core
    attention."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = ContextParallelDotProductAttention
    return spec
