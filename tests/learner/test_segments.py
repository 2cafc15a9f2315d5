"""Segmented trajectories through the learner: each segment its own context, the episode the unit of every
per-trajectory quantity. An episode split where its prefix still holds trains exactly as the unsplit one; a
genuinely segmented one gets exact per-trajectory norms on the fast path."""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor

from configs.schema import AlgoConfig, OptimConfig
from learner.backends.torch_learner import StepInput, TorchLearner
from learner.forward.logprobs import packed_target_logprobs
from learner.forward.packing import TrajectoryTokens, build_microbatch, pack_trajectories, share_prefixes
from learner.traj_grads.opob_grad import accumulate_opob_grad_packed, accumulate_opob_grad_per_trajectory
from learner.traj_grads.reference import reference_opob_gradient
from rollout.trajectory import Trajectory, TrajectoryVersions
from tests.learner.conftest import VOCAB, tiny_model


def test_positions_restart_at_every_segment_and_no_target_crosses_one() -> None:
    #            seg 0: p p a a | seg 1: p a' b     (a' context in seg 1)
    tokens = TrajectoryTokens([1, 2, 5, 6, 1, 5, 7], [False, False, True, True, False, False, True], 0,
                              segment_starts=(0, 4))
    other = TrajectoryTokens([3, 4, 8], [False, False, True], 1)
    batch = build_microbatch([tokens, other], [0, 1])
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    assert batch.token_trajectory.tolist() == [0] * 7 + [1] * 3  # both segments belong to trajectory 0
    assert batch.target_positions.tolist() == [1, 2, 5, 8]  # nothing predicts seg 1's first token
    assert batch.target_counts == (3, 1) and batch.seq_lengths == (7, 3)
    with pytest.raises(ValueError, match="starts with a loss token"):
        TrajectoryTokens([1, 2, 3], [False, False, True], 0, segment_starts=(0, 2))


def test_a_segmented_trajectorys_log_probs_are_its_segments_as_separate_sequences() -> None:
    model = tiny_model("llama_tied", "sdpa")
    mask = [False, False, True, True] + [False] * 4 + [True]
    segmented = TrajectoryTokens([1, 2, 5, 6, 1, 2, 5, 9, 7], mask, 0, segment_starts=(0, 4))
    first = TrajectoryTokens([1, 2, 5, 6], [False, False, True, True], 0)
    second = TrajectoryTokens([1, 2, 5, 9, 7], [False] * 4 + [True], 0)
    with torch.no_grad():
        together = packed_target_logprobs(model, build_microbatch([segmented], [0]))
        apart = torch.cat([packed_target_logprobs(model, build_microbatch([t], [0]))
                           for t in (first, second)])
    torch.testing.assert_close(together, apart, rtol=1e-5, atol=1e-6)


def _episode(rng: random.Random, group: int, segmented: bool) -> TrajectoryTokens:
    """A two-turn episode: prompt, turn a, tool output, turn b. Split, its second segment is the whole
    context again (prompt, a, tool output — a now context) then b: where the prefix still holds."""
    prompt = [rng.randrange(1, VOCAB) for _ in range(5)]
    a, tool, b = ([rng.randrange(1, VOCAB) for _ in range(n)] for n in (4, 3, 5))
    if not segmented:
        ids = prompt + a + tool + b
        mask = [False] * 5 + [True] * 4 + [False] * 3 + [True] * 5
        return TrajectoryTokens(ids, mask, group)
    ids = prompt + a + prompt + a + tool + b
    mask = [False] * 5 + [True] * 4 + [False] * 12 + [True] * 5
    return TrajectoryTokens(ids, mask, group, segment_starts=(0, 9))


def _trajectories(tokens: list[TrajectoryTokens], seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(tokens):
        sampled = [rng.uniform(-4.0, -0.5) for m in t.loss_mask if m]
        it = iter(sampled)
        logprobs = tuple(next(it) if m else 0.0 for m in t.loss_mask)
        out.append(Trajectory(trajectory_id=f"t{i}", group_id=str(t.group_id), token_ids=tuple(t.token_ids),
                              loss_mask=tuple(t.loss_mask), behavior_logprobs=logprobs,
                              versions=TrajectoryVersions(start=0, end=0), reward=float(i % 3 == 0),
                              segment_starts=tuple(t.segment_starts)))
    return out


def _step(objective: dict, tokens: list[TrajectoryTokens], micro_batch_tokens: int) -> tuple[dict, dict]:
    algo = AlgoConfig.model_validate({"objective": objective, "group_size": 3})
    learner = TorchLearner(tiny_model("llama_tied", "sdpa").train(), algo, OptimConfig(lr=1e-3),
                           micro_batch_tokens=micro_batch_tokens)
    trajectories = _trajectories(tokens, seed=1)
    groups = [t.group_id for t in tokens]
    metrics = learner.step(StepInput(trajectories, groups, [0] * len(groups), [True] * len(groups)))
    return {name: p.detach().clone() for name, p in learner.model.named_parameters()}, metrics


@pytest.mark.parametrize("objective", [{"type": "vcpo", "opob": {"grad_norm_path": "fast"}},
                                       {"type": "vcpo", "opob": {"grad_norm_path": "per_trajectory"}},
                                       {"type": "grpo"}], ids=["vcpo_fast", "vcpo_per_trajectory", "grpo"])
def test_an_episode_split_where_its_prefix_holds_trains_as_the_unsplit_one(objective: dict) -> None:
    rng = random.Random(0)
    states = [rng.getstate()]
    unsplit = [_episode(rng, g, segmented=False) for g in (0, 0, 0, 1, 1, 1)]
    rng.setstate(states[0])
    split = [_episode(rng, g, segmented=True) for g in (0, 0, 0, 1, 1, 1)]
    assert [sum(t.loss_mask) for t in split] == [sum(t.loss_mask) for t in unsplit]
    want, want_metrics = _step(objective, unsplit, micro_batch_tokens=60)
    got, got_metrics = _step(objective, split, micro_batch_tokens=60)
    for key in ("is/ess_ratio", "is/log_w_mean", "reward/mean", "tokens/trained"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-6), key
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def _coefs(count: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(2)
    weights = torch.rand(count, generator=generator) * 2.0
    rewards = torch.randint(0, 2, (count,), generator=generator).float()
    return weights * rewards / count, weights / count


def test_the_fast_paths_norm_of_a_segmented_episode_is_over_all_its_segments() -> None:
    """Segments that do not extend each other (a stripped or compacted context): ‖g_i‖² is the norm of the
    gradient of the whole episode's log-likelihood, summed over its segments — the brute-force oracle runs
    each segment as a sequence of its own."""
    rng = random.Random(4)
    tokens = []
    for i in range(6):
        first = [rng.randrange(1, VOCAB) for _ in range(6)]
        second = [rng.randrange(1, VOCAB) for _ in range(7)]
        ids = first + second + ([rng.randrange(1, VOCAB) for _ in range(5)] if i % 2 else [])
        mask = [False] * 3 + [True] * 3 + [False] * 4 + [True] * 3 + ([False, True, True, False, True]
                                                                     if i % 2 else [])
        starts = (0, 6, 13) if i % 2 else (0, 6)
        tokens.append(TrajectoryTokens(ids, mask, i // 3, segment_starts=starts))
    model = tiny_model("llama_tied", "sdpa")
    a, s = _coefs(len(tokens))

    def baseline(group: int, members: Tensor, sq_norms: Tensor) -> float:
        importance = s[members] ** 2 * sq_norms
        return float((importance * (a / s)[members]).sum() / importance.sum())

    reference = reference_opob_gradient(model, tokens, a, s, baseline)
    for path in (accumulate_opob_grad_packed, accumulate_opob_grad_per_trajectory):
        model.zero_grad(set_to_none=True)
        result = path(model, pack_trajectories(tokens, max_tokens=40), a, s, baseline)
        torch.testing.assert_close(result.sq_norms, reference.sq_norms, rtol=1e-4, atol=0.0)
        for name, param in model.named_parameters():
            expected = reference.param_grads[name]
            scale = float(expected.abs().max())
            torch.testing.assert_close(param.grad, expected, rtol=1e-4, atol=1e-4 * scale, msg=name)


def test_a_group_with_a_segmented_member_does_not_share_its_prompt() -> None:
    prompt = list(range(1, 21))
    plain = [TrajectoryTokens([*prompt, 30, 31], [False] * 20 + [True] * 2, 0) for _ in range(2)]
    assert share_prefixes(build_microbatch(plain, [0, 1])) is not None
    segmented = TrajectoryTokens([*prompt, 30, 31, *prompt[:3], 32],
                                 [False] * 20 + [True] * 2 + [False] * 3 + [True], 0, segment_starts=(0, 22))
    layout = share_prefixes(build_microbatch([segmented, plain[0]], [0, 1]))
    assert layout is None  # nothing shared: every member keeps its whole prompt
