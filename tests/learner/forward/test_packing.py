"""Packing: trajectory boundaries, the target shift, aggregation weights, group-aligned layout."""

from __future__ import annotations

import pytest
import torch

from learner.forward.packing import (
    TrajectoryTokens,
    build_microbatch,
    pack_trajectories,
    plan_microbatches,
    share_prefixes,
)

# A: prompt [5, 6], generated [7, 8]; B: prompt [9], generated [10], tool output [11].
A = TrajectoryTokens([5, 6, 7, 8], [False, False, True, True], group_id=1)
B = TrajectoryTokens([9, 10, 11], [False, True, False], group_id=2)


def test_packed_layout_restarts_positions_and_never_targets_across_a_boundary() -> None:
    batch = build_microbatch([A, B], [0, 1], aggregation="mean")
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert batch.cu_seqlens.tolist() == [0, 4, 7]
    assert batch.token_trajectory.tolist() == [0, 0, 0, 0, 1, 1, 1]
    # Position t predicts token t+1 of its own trajectory: 1→7, 2→8, 4→10. Position 3 (A's last
    # token) would "predict" B's 9 and must not; 5→11 is a tool token, 6 is B's last position.
    assert batch.target_mask.tolist() == [False, True, True, False, True, False, False]
    assert batch.target_positions.tolist() == [1, 2, 4]
    assert batch.target_ids.tolist() == [0, 7, 8, 0, 10, 0, 0]
    # Mean aggregation: A has |M| = 2 → c = 1/2; B has |M| = 1 → c = 1.
    assert batch.target_weights.tolist() == [0.0, 0.5, 0.5, 0.0, 1.0, 0.0, 0.0]
    assert batch.target_counts == (2, 1)
    assert batch.trajectory_indices.tolist() == [0, 1]
    assert batch.group_ids.tolist() == [1, 2]


def test_sum_aggregation_and_explicit_token_weights() -> None:
    summed = build_microbatch([A, B], [0, 1], aggregation="sum")
    assert summed.target_weights.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    # Explicit weights are used as given on loss tokens and zeroed elsewhere (the 9.0 on a prompt token).
    weighted = TrajectoryTokens(
        [5, 6, 7, 8], [False, False, True, True], group_id=1, token_weights=[9, 9, 2, 3]
    )
    assert build_microbatch([weighted], [0]).target_weights.tolist() == [0.0, 2.0, 3.0, 0.0]


def test_select_gives_the_unpacked_trajectory() -> None:
    single = build_microbatch([A, B], [0, 1]).select(1)
    assert single.input_ids.tolist() == [[9, 10, 11]]
    assert single.position_ids.tolist() == [[0, 1, 2]]
    assert single.target_positions.tolist() == [0]
    assert single.target_ids.tolist() == [10, 0, 0]
    assert single.trajectory_indices.tolist() == [1]


def test_a_generated_first_token_is_rejected() -> None:
    with pytest.raises(ValueError, match="first token"):
        TrajectoryTokens([1, 2], [True, True], group_id=0)


def test_groups_are_kept_whole_when_they_fit() -> None:
    # Group tokens: g1 = 4+3 = 7, g2 = 5+2 = 7, g3 = 6. Budget 10: g2 does not fit after g1 (14),
    # so it starts a new micro-batch; g3 likewise (13).
    assert plan_microbatches([4, 3, 5, 2, 6], [1, 1, 2, 2, 3], max_tokens=10) == [[0, 1], [2, 3], [4]]


def test_only_oversized_groups_span_micro_batches() -> None:
    # Budget 5, groups of 6 tokens each: g1 = [0, 1] | [2, then g2's 3] | [4]. At every boundary
    # exactly one group is open.
    assert plan_microbatches([2, 2, 2, 3, 3], [1, 1, 1, 2, 2], max_tokens=5) == [[0, 1], [2, 3], [4]]


def test_group_members_are_made_contiguous_in_first_appearance_order() -> None:
    assert plan_microbatches([2, 2, 2], [1, 2, 1], max_tokens=4) == [[0, 2], [1]]


def test_pack_trajectories_covers_every_trajectory_once() -> None:
    batches = pack_trajectories([A, B, A], max_tokens=7)
    indices = torch.cat([b.trajectory_indices for b in batches]).tolist()
    assert sorted(indices) == [0, 1, 2]
    assert all(b.num_tokens <= 7 for b in batches)


def test_share_prefixes_keeps_a_groups_prompt_once_up_to_the_token_before_the_first_sampled_one() -> None:
    prompt = list(range(1, 21))  # 20 prompt tokens; both members then sample 30 first
    first = TrajectoryTokens([*prompt, 30, 31, 32], [False] * 20 + [True] * 3, group_id=1)
    second = TrajectoryTokens([*prompt, 30, 40], [False] * 20 + [True] * 2, group_id=1)
    untrained = TrajectoryTokens([*prompt, 50], [False] * 21, group_id=1)
    other = TrajectoryTokens([7, 8, 9], [False, True, True], group_id=2)
    batch = build_microbatch([first, second, untrained, other], [0, 1, 2, 3])
    layout = share_prefixes(batch)
    assert layout is not None
    # the common prefix is 21 tokens (prompt + 30) but position 19 predicts the first sampled token, so
    # 19 are shared: `second` keeps packed 23 + 19.. (its positions 19, 20, 21), `untrained` is left out
    assert layout.keep.tolist() == [*range(23), 42, 43, 44, 45 + 21, 45 + 22, 45 + 23]
    assert layout.position_ids(batch).tolist() == [[*range(23), 19, 20, 21, 0, 1, 2]]
    assert layout.input_ids(batch)[0, 23:].tolist() == [20, 30, 40, 7, 8, 9]
    # the micro-batch's targets, in its order: first's 19..21, second's 19..20, other's 0..1
    assert batch.target_positions.tolist() == [19, 20, 21, 42, 43, 66, 67]
    assert layout.target_positions.tolist() == [19, 20, 21, 23, 24, 26, 27]
    assert torch.equal(layout.input_ids(batch)[0, layout.target_positions + 1],
                       batch.input_ids[0, batch.target_positions + 1])


def test_share_prefixes_leaves_short_or_different_prompts_alone() -> None:
    prompt = list(range(1, 21))
    first = TrajectoryTokens([*prompt, 30, 31], [False] * 20 + [True] * 2, group_id=1)
    second = TrajectoryTokens([*prompt, 40], [False] * 20 + [True], group_id=1)
    assert share_prefixes(build_microbatch([first, second], [0, 1]), min_shared=20) is None  # 19 < 20
    assert share_prefixes(build_microbatch([first, second], [0, 1]), min_shared=19) is not None
    strangers = TrajectoryTokens([99, *prompt[1:], 40], [False] * 20 + [True], group_id=1)
    assert share_prefixes(build_microbatch([first, strangers], [0, 1])) is None  # first tokens differ
    other_group = TrajectoryTokens([*prompt, 40], [False] * 20 + [True], group_id=2)
    assert share_prefixes(build_microbatch([first, other_group], [0, 1])) is None  # groups never share
