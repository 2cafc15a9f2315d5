"""Sequence packing: whole trajectories laid end to end in one row, no padding.

A packed micro-batch is one sequence of `N` tokens holding `n` trajectories. `position_ids`
restart at 0 at every trajectory boundary; with `attention_mask=None` and `use_cache=False`
HF transformers (5.x `masking_utils.find_packed_sequence_indices`) turns those restarts into
a block-diagonal causal mask for the sdpa and eager kernels, so no token attends across a
trajectory boundary (`tests/learner/forward/test_logprobs.py` pins this down).

Targets are shifted inside each trajectory: position `t` predicts token `t + 1` of the *same*
trajectory, so the last position of every trajectory has no target and the first token of a
trajectory is never a target. A trajectory of several segments (rollout/trajectory.py: contexts that do
not extend one another) is its segments end to end with `position_ids` restarting at each, so each segment
attends only to itself, exactly as separate sequences would; its tokens still belong to one trajectory
(`token_trajectory`), so everything per trajectory — the sequence log-ratio, the per-trajectory gradient
norm — sums over all its segments. A segment starts with context, so no target crosses into it. The
loss-token weight `c_{t+1}` (the per-token aggregation weight of the trajectory's log-likelihood
`ℓ_i = Σ_t c_t log π(y_t | y_<t)`) travels with it.

This module only arranges tokens. It does not run models or compute losses, and it builds CPU
tensors; move a micro-batch with `PackedMicroBatch.to(device)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["mean", "sum"]


@dataclass(frozen=True)
class TrajectoryTokens:
    """One trajectory as the packer needs it.

    `token_ids`: prompt + every turn, as the engine saw them. `loss_mask[t]` is true only for
    model-generated tokens (prompt and tool-output spans are false); `loss_mask[0]` must be false
    because the first token has no context to be predicted from. `token_weights[t]` is the
    aggregation weight `c_t` of token `t` (ignored where `loss_mask` is false); `None` means
    "use the packer's aggregation mode".
    """

    token_ids: Sequence[int]
    loss_mask: Sequence[bool]
    group_id: int
    token_weights: Sequence[float] | None = None
    segment_starts: Sequence[int] = (0,)
    """Where each segment begins (0 first): positions restart there."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0:
            raise ValueError("a trajectory needs at least one token; got an empty token_ids")
        if len(self.loss_mask) != n:
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries for {n} tokens; give one per token"
            )
        if self.token_weights is not None and len(self.token_weights) != n:
            raise ValueError(
                f"token_weights has {len(self.token_weights)} entries for {n} tokens; give one per token"
            )
        if self.loss_mask[0]:
            raise ValueError(
                "loss_mask[0] is true, but the first token of a trajectory has no context to be predicted "
                "from; start every trajectory with at least one prompt token"
            )
        starts = list(self.segment_starts)
        if not starts or starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= n:
            raise ValueError(f"segment_starts={starts} must be increasing token indices starting at 0")
        if any(self.loss_mask[start] for start in starts):
            raise ValueError(f"a segment of {starts} starts with a loss token; each starts with context")


def segment_positions(length: int, segment_starts: Sequence[int]) -> Tensor:
    """(length,) positions 0, 1, … restarting at each segment start."""
    if len(segment_starts) == 1:
        return torch.arange(length)
    positions = torch.arange(length)
    starts = torch.as_tensor(list(segment_starts), dtype=torch.long)
    owner = torch.searchsorted(starts, positions, right=True) - 1
    return positions - starts[owner]


def aggregation_weights(loss_mask: Tensor, aggregation: Aggregation) -> Tensor:
    """Per-token weights `c_t` for one trajectory: `1/|M|` on loss tokens ("mean") or 1 ("sum").

    `loss_mask`: (T,) bool. Returns (T,) float32, zero off the mask; all zeros when `|M| = 0`.
    """
    mask = loss_mask.to(torch.float32)
    if aggregation == "sum":
        return mask
    if aggregation == "mean":
        return mask / mask.sum().clamp(min=1.0)
    raise ValueError(f"aggregation={aggregation!r} is not known; use 'mean' or 'sum'")


@dataclass(frozen=True)
class PackedMicroBatch:
    """`n` whole trajectories packed into one row of `N` tokens.

    Token-level tensors are indexed by packed position `t ∈ [0, N)`. A *target* is a position
    whose next token is a loss token of the same trajectory; there are `K < N` of them (the last
    position of a trajectory never is one). Build with `build_microbatch` / `pack_trajectories`.
    """

    input_ids: Tensor
    """(1, N) long: the trajectories' tokens end to end."""
    position_ids: Tensor
    """(1, N) long: 0, 1, … restarting at each trajectory's first token."""
    cu_seqlens: Tensor
    """(n+1,) int32: trajectory `j` occupies positions `[cu_seqlens[j], cu_seqlens[j+1])`."""
    trajectory_indices: Tensor
    """(n,) long: index of packed trajectory `j` in the list given to the packer (minibatch index)."""
    group_ids: Tensor
    """(n,) long: group of packed trajectory `j`."""
    token_trajectory: Tensor
    """(N,) long: packed trajectory `j` that position `t` belongs to."""
    target_mask: Tensor
    """(N,) bool: position `t` is a target."""
    target_ids: Tensor
    """(N,) long: token `t + 1` at targets, 0 elsewhere."""
    target_weights: Tensor
    """(N,) float32: aggregation weight `c_{t+1}` at targets, 0 elsewhere."""
    target_positions: Tensor
    """(K,) long: the target positions, ascending (what the model's `logits_to_keep` gets)."""
    seq_lengths: tuple[int, ...]
    """Length of each packed trajectory (host ints: slicing needs no device sync)."""
    target_counts: tuple[int, ...]
    """Targets of each packed trajectory; trajectory `j`'s targets are a contiguous run of
    `target_positions` because targets are ordered by position."""

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lengths)

    @property
    def num_trajectories(self) -> int:
        return len(self.seq_lengths)

    def to(self, device: torch.device | str) -> PackedMicroBatch:
        """A copy with every tensor on `device` (the host tuples are unchanged)."""
        moved = {}
        for spec in fields(self):
            value = getattr(self, spec.name)
            moved[spec.name] = value.to(device) if isinstance(value, Tensor) else value
        return PackedMicroBatch(**moved)

    def select(self, j: int) -> PackedMicroBatch:
        """Packed trajectory `j` alone, as a one-trajectory micro-batch (an unpacked sequence)."""
        start = sum(self.seq_lengths[:j])
        end = start + self.seq_lengths[j]
        mask = self.target_mask[start:end]
        return PackedMicroBatch(
            input_ids=self.input_ids[:, start:end],
            position_ids=self.position_ids[:, start:end],
            cu_seqlens=torch.tensor([0, end - start], dtype=torch.int32, device=self.cu_seqlens.device),
            trajectory_indices=self.trajectory_indices[j : j + 1],
            group_ids=self.group_ids[j : j + 1],
            token_trajectory=torch.zeros_like(self.token_trajectory[start:end]),
            target_mask=mask,
            target_ids=self.target_ids[start:end],
            target_weights=self.target_weights[start:end],
            target_positions=torch.nonzero(mask).flatten(),
            seq_lengths=(end - start,),
            target_counts=(self.target_counts[j],),
        )


def build_microbatch(
    trajectories: Sequence[TrajectoryTokens], indices: Sequence[int], aggregation: Aggregation = "mean"
) -> PackedMicroBatch:
    """Pack `trajectories[i]` for `i in indices`, in that order, into one micro-batch.

    `aggregation` gives `c_t` for trajectories without explicit `token_weights`. The shift is
    done per trajectory, so no target ever crosses a boundary. Cost: O(N) host work.
    """
    if not indices:
        raise ValueError("a micro-batch needs at least one trajectory; indices is empty")
    parts: dict[str, list[Tensor]] = {k: [] for k in ("ids", "pos", "traj", "mask", "tgt", "w")}
    lengths: list[int] = []
    counts: list[int] = []
    for j, i in enumerate(indices):
        trajectory = trajectories[i]
        ids = torch.as_tensor(list(trajectory.token_ids), dtype=torch.long)
        loss_mask = torch.as_tensor(list(trajectory.loss_mask), dtype=torch.bool)
        if trajectory.token_weights is None:
            weights = aggregation_weights(loss_mask, aggregation)
        else:
            weights = torch.as_tensor(list(trajectory.token_weights), dtype=torch.float32) * loss_mask
        length = ids.numel()
        # Position t predicts token t+1 of the same trajectory; the last position has no target (nor the
        # last of a segment: the next segment starts with context, whose loss_mask is false).
        target_mask = torch.cat([loss_mask[1:], torch.zeros(1, dtype=torch.bool)])
        parts["ids"].append(ids)
        parts["pos"].append(segment_positions(length, trajectory.segment_starts))
        parts["traj"].append(torch.full((length,), j, dtype=torch.long))
        parts["mask"].append(target_mask)
        parts["tgt"].append(torch.cat([ids[1:], ids.new_zeros(1)]) * target_mask)
        parts["w"].append(torch.cat([weights[1:], weights.new_zeros(1)]) * target_mask)
        lengths.append(length)
        counts.append(int(target_mask.sum()))
    target_mask = torch.cat(parts["mask"])
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return PackedMicroBatch(
        input_ids=torch.cat(parts["ids"]).unsqueeze(0),
        position_ids=torch.cat(parts["pos"]).unsqueeze(0),
        cu_seqlens=cu_seqlens,
        trajectory_indices=torch.tensor(list(indices), dtype=torch.long),
        group_ids=torch.tensor([trajectories[i].group_id for i in indices], dtype=torch.long),
        token_trajectory=torch.cat(parts["traj"]),
        target_mask=target_mask,
        target_ids=torch.cat(parts["tgt"]),
        target_weights=torch.cat(parts["w"]),
        target_positions=torch.nonzero(target_mask).flatten(),
        seq_lengths=tuple(lengths),
        target_counts=tuple(counts),
    )


def plan_microbatches(lengths: Sequence[int], group_ids: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group-aligned token-budget packing: which trajectory indices go in which micro-batch.

    Groups are laid out contiguously in order of first appearance (members in input order).
    A group that fits in the current micro-batch joins it; one that fits in an empty micro-batch
    starts a new one; only a group larger than `max_tokens` is split across micro-batches (filled
    trajectory by trajectory). Hence at most one group is open at a micro-batch boundary, which
    bounds the OPOB baseline buffers (`learner/traj_grads/opob_grad.py`). A single trajectory longer than
    `max_tokens` gets a micro-batch of its own (over budget rather than truncated).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens} must be positive")
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(int(g), []).append(i)
    plans: list[list[int]] = []
    current: list[int] = []
    used = 0
    for group in members.values():
        group_tokens = sum(lengths[i] for i in group)
        if used + group_tokens <= max_tokens:
            current, used = [*current, *group], used + group_tokens
            continue
        if group_tokens <= max_tokens:
            plans.append(current)
            current, used = list(group), group_tokens
            continue
        for i in group:
            if current and used + lengths[i] > max_tokens:
                plans.append(current)
                current, used = [], 0
            current.append(i)
            used += lengths[i]
    plans.append(current)
    return [plan for plan in plans if plan]


def pack_trajectories(
    trajectories: Sequence[TrajectoryTokens], max_tokens: int, aggregation: Aggregation = "mean"
) -> list[PackedMicroBatch]:
    """Pack a minibatch into group-aligned micro-batches of at most `max_tokens` tokens each.

    `trajectory_indices` of the result index `trajectories`. See `plan_microbatches` for the
    layout rule and `build_microbatch` for the tensors.
    """
    lengths = [len(t.token_ids) for t in trajectories]
    plans = plan_microbatches(lengths, [t.group_id for t in trajectories], max_tokens)
    return [build_microbatch(trajectories, plan, aggregation) for plan in plans]


SHARED_PREFIX_MIN_TOKENS = 16
"""Shorter common prefixes are not worth a branch's extra attention call."""


@dataclass(frozen=True)
class SharedPrefixLayout:
    """A micro-batch with each group's common prompt kept once: the subsequence `keep` of its packed
    tokens. The first member of a run of consecutive trajectories with one prompt keeps all its tokens
    (the *root*); the others keep only what follows the shared prefix, with their original positions, so
    `learner/forward/varlen_attention.py` lets them attend to the root's prefix (a *branch*).
    Trajectories without targets are left out. Every kept position computes what it would in the full
    row; the members' copies of the prompt are not computed at all, so the layout serves forwards that are
    read at the targets (log-probs and what autograd derives from them), not hooks that need each
    trajectory's own activations at every position."""

    keep: Tensor
    """(N',) long: the packed positions that remain, ascending."""
    target_positions: Tensor
    """(K,) long: the micro-batch's targets, in its order, as positions of the kept row."""

    @property
    def num_tokens(self) -> int:
        return self.keep.numel()

    def input_ids(self, batch: PackedMicroBatch) -> Tensor:
        return batch.input_ids[:, self.keep]

    def position_ids(self, batch: PackedMicroBatch) -> Tensor:
        return batch.position_ids[:, self.keep]


def share_prefixes(batch: PackedMicroBatch,
                   min_shared: int = SHARED_PREFIX_MIN_TOKENS) -> SharedPrefixLayout | None:
    """The layout that computes each group's common prompt once, or None when nothing is shared.

    Consecutive members of one group with targets form a run; its shared prefix is their longest
    common token prefix, cut back so that it holds no target (the token before each trajectory's first
    sampled token predicts it, so it stays in every branch). A run shares when that prefix has at
    least `min_shared` tokens and none of its members has several segments (a branch attends to the last
    segment that started at position 0, which for a member after a segmented one would be that one's last
    segment, not the shared prompt). Cost: O(N) host work (the token ids are read to the host)."""
    ids = batch.input_ids[0].cpu()
    targets = batch.target_mask.cpu()
    starts = batch.cu_seqlens.tolist()
    restarts = batch.token_trajectory.cpu()[batch.position_ids[0].cpu() == 0]
    segmented = set(torch.nonzero(torch.bincount(restarts, minlength=batch.num_trajectories) > 1)
                    .flatten().tolist())
    groups = batch.group_ids.tolist()
    members = [j for j in range(batch.num_trajectories) if batch.target_counts[j] > 0]
    kept: list[Tensor] = []
    shared_any = False
    run: list[int] = []
    for position, j in enumerate(members):
        run.append(j)
        following = members[position + 1] if position + 1 < len(members) else None
        if following is not None and groups[following] == groups[j]:
            continue
        prefix = _shared_prefix(ids, targets, starts, run)
        shared = len(run) > 1 and prefix >= min_shared and not segmented.intersection(run)
        shared_any = shared_any or shared
        for rank, member in enumerate(run):
            skip = prefix if shared and rank > 0 else 0
            kept.append(torch.arange(starts[member] + skip, starts[member + 1]))
        run = []
    dropped = len(members) < batch.num_trajectories
    if not shared_any and not dropped:
        return None
    keep = torch.cat(kept) if kept else torch.zeros(0, dtype=torch.long)
    new_index = torch.full((ids.numel(),), -1, dtype=torch.long)
    new_index[keep] = torch.arange(keep.numel())
    device = batch.input_ids.device
    return SharedPrefixLayout(keep=keep.to(device),
                              target_positions=new_index[batch.target_positions.cpu()].to(device))


def _shared_prefix(ids: Tensor, targets: Tensor, starts: list[int], run: list[int]) -> int:
    """Tokens at the start of every trajectory in `run` that are the same and hold no target."""
    first = run[0]
    length = starts[first + 1] - starts[first]
    reference = ids[starts[first]:starts[first + 1]]
    for j in run:
        own = ids[starts[j]:starts[j + 1]]
        length = min(length, own.numel())
        differ = torch.nonzero(own[:length] != reference[:length])
        if differ.numel():
            length = int(differ[0])
        first_target = torch.nonzero(targets[starts[j]:starts[j + 1]])
        if first_target.numel():
            length = min(length, int(first_target[0]))
    return length


class TargetPadding:
    """Scatter (K,) per-target values of a micro-batch into (n, T_max) rows, one per trajectory —
    the (B, T) layout the objectives take. Row j holds trajectory j's targets left-aligned, in order;
    `mask` marks the filled cells. The indices are built once per micro-batch, on the batch's device
    (from its host-side counts, so no device sync)."""

    def __init__(self, batch: PackedMicroBatch) -> None:
        device = batch.input_ids.device
        counts = torch.tensor(batch.target_counts, device=device)
        self.rows = torch.repeat_interleave(torch.arange(batch.num_trajectories, device=device), counts)
        starts = torch.cat([torch.zeros(1, dtype=torch.long, device=device), counts.cumsum(0)[:-1]])
        self.columns = torch.arange(sum(batch.target_counts), device=device) - starts[self.rows]
        self.shape = (batch.num_trajectories, max(batch.target_counts))
        self.mask = torch.zeros(self.shape, dtype=torch.bool, device=device)
        self.mask[self.rows, self.columns] = True

    def __call__(self, values: Tensor) -> Tensor:
        return values.new_zeros(self.shape).index_put((self.rows, self.columns), values)
