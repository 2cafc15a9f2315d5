"""`SplitRows`: a rank's window onto a packed row cut into contiguous chunks, and norms completed over the
ranks — by hand, two ranks simulated in one process (the gloo CP tests run the real thing)."""

from __future__ import annotations

import torch

from learner.traj_grads.split_rows import SplitRows, shared_trajectories

SEGMENTS = ((0, 3), (3, 9), (9, 10))
"""Three trajectories in a row of 10 tokens (padded to 12 for 2 ranks: chunks [0, 6) and [6, 12))."""


def _split(rank: int, reduce: object = None) -> SplitRows:
    tokens = (0, 6) if rank == 0 else (6, 12)
    return SplitRows(tokens=tokens, targets=(0, 4) if rank == 0 else (4, 7), shared=(1,),
                     reduce=reduce or (lambda tensor: None), counts_shared=rank == 0)


def test_shared_trajectories_are_those_crossing_a_chunk_boundary() -> None:
    lengths = (3, 6, 1)  # SEGMENTS
    assert shared_trajectories(lengths, 6) == (1,)
    assert shared_trajectories(lengths, 3) == (1,)  # (0, 3) ends exactly at a boundary
    assert shared_trajectories(lengths, 2) == (0, 1)
    assert shared_trajectories(lengths, 12) == ()


def test_a_window_clips_the_segments_to_the_rank_rows_and_maps_pad_rows_to_zero() -> None:
    row_trajectory = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1, 2])
    segments, local = _split(0).window(False, SEGMENTS, row_trajectory)
    assert segments == ((0, 3), (3, 6), (6, 6))
    assert local.tolist() == [0, 0, 0, 1, 1, 1]
    segments, local = _split(1).window(False, SEGMENTS, row_trajectory)
    assert segments == ((0, 0), (0, 3), (3, 4))
    assert local.tolist() == [1, 1, 1, 2, 0, 0]  # rows 10 and 11: the padding
    target_segments = ((0, 2), (2, 6), (6, 7))
    segments, local = _split(1).window(True, target_segments, torch.tensor([0, 0, 1, 1, 1, 1, 2]))
    assert segments == ((0, 0), (0, 2), (2, 3)) and local.tolist() == [1, 1, 2]


def test_norms_completed_over_the_ranks_are_those_of_the_summed_gradients() -> None:
    """Each rank holds a partial per-trajectory gradient (zero where it has no row of the trajectory):
    the ranks' completed norms sum to the norms of the whole gradients — the shared trajectory's of the
    sum, not the sum of the two squares (which differs by the cross term)."""
    generator = torch.Generator().manual_seed(0)
    partial = [torch.randn(3, 4, 5, generator=generator) for _ in range(2)]
    partial[0][2] = 0.0  # trajectory 2 lives on rank 1 only
    partial[1][0] = 0.0  # trajectory 0 on rank 0 only
    whole = partial[0] + partial[1]
    completed = []
    for rank in (0, 1):
        other = partial[1 - rank]
        completed.append(_split(rank, lambda tensor, other=other: tensor.add_(other[1:2]))
                         .complete_norms(partial[rank]))
    want = whole.reshape(3, -1).square().sum(1)
    torch.testing.assert_close(completed[0] + completed[1], want, rtol=1e-6, atol=0)
    apart = partial[0][1].square().sum() + partial[1][1].square().sum()
    assert abs(float(apart - want[1])) > 1e-2 * float(want[1])  # the cross term matters here
