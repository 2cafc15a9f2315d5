"""Trajectories whose rows are split over ranks (megatron's context parallelism): which rows a rank's
handlers see, and how the per-trajectory norms are completed across the ranks.

With context parallelism a packed row (padded to a multiple of the rank count by a dummy trajectory) is
cut into contiguous chunks, one per rank, and every layer of a rank runs on its chunk only: its hooks see
the chunk's rows (`tokens`) and, at the output layer, the chunk's target positions (`targets`). A
trajectory inside one chunk has its whole gradient on that rank. One that crosses a chunk boundary (a
*shared* trajectory) has a partial gradient `G_j^(r)` on each rank, and its squared norm is of their sum,
`‖Σ_r G_j^(r)‖²` — not the sum of the ranks' squares. So each handler sums its shared trajectories'
partial gradients over the ranks (`reduce`, in place) before squaring them, and one rank (`counts_shared`)
adds those norms; the learner then sums every trajectory's norm over the ranks. The gradient itself is
applied from the partials: the data- × context-parallel reduction of the gradients sums them.

Contiguous chunks keep the shared trajectories few: at most (ranks − 1) per packed row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

Segments = tuple[tuple[int, int], ...]
"""Per packed trajectory, the `[start, end)` rows it owns in a module's input (host ints)."""


@dataclass
class SplitRows:
    """This rank's share of one packed micro-batch (module docstring)."""

    tokens: tuple[int, int]
    """This rank's rows `[start, end)` of the packed row (padded: rows past its tokens are the dummy
    trajectory's, whose output gradients are zero)."""
    targets: tuple[int, int]
    """This rank's rows `[start, end)` of the micro-batch's target positions (those inside `tokens`)."""
    shared: tuple[int, ...]
    """Local indices of the trajectories with rows on more than one rank."""
    reduce: Callable[[Tensor], None]
    """Sums a tensor over the ranks, in place. Collective: every rank calls it in the same order, each
    handler once per micro-batch, whatever rows it holds."""
    counts_shared: bool
    """Whether this rank adds the shared trajectories' (summed) norms: one rank does."""
    _windows: dict[bool, tuple[Segments, Tensor]] = field(default_factory=dict)

    def window(self, targets: bool, segments: Segments, row_trajectory: Tensor) -> tuple[Segments, Tensor]:
        """The micro-batch's trajectory segments and row → trajectory map restricted to this rank's rows
        (of the tokens, or of the targets): segments clipped and shifted to the rank's first row (empty for
        trajectories it holds no row of), pad rows mapped to trajectory 0 (their gradient is zero)."""
        if targets not in self._windows:
            start, end = self.targets if targets else self.tokens
            clipped = tuple((min(max(low, start), end) - start, min(max(high, start), end) - start)
                            for low, high in segments)
            local = row_trajectory[start:end]
            if local.numel() < end - start:
                local = torch.cat([local, local.new_zeros(end - start - local.numel())])
            self._windows[targets] = (clipped, local)
        return self._windows[targets]

    def complete_norms(self, per_trajectory: Tensor) -> Tensor:
        """(n,) squared norms of (n, ...) per-trajectory gradients held as this rank's partials: a
        shared trajectory's summed over the ranks first, and counted on one rank only."""
        norms = per_trajectory.reshape(per_trajectory.shape[0], -1).float().square().sum(1)
        if not self.shared:
            return norms
        index = torch.tensor(self.shared, device=per_trajectory.device)
        summed = per_trajectory[index].float().clone()
        self.reduce(summed)
        norms[index] = summed.reshape(len(self.shared), -1).square().sum(1) if self.counts_shared else 0.0
        return norms


def shared_trajectories(lengths: tuple[int, ...], chunk: int) -> tuple[int, ...]:
    """Indices of the trajectories (packed one after another, `lengths` tokens each) that cross a boundary
    of contiguous chunks of `chunk` rows."""
    shared, start = [], 0
    for j, length in enumerate(lengths):
        if length and start // chunk != (start + length - 1) // chunk:
            shared.append(j)
        start += length
    return tuple(shared)
