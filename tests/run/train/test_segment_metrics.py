"""The step's segment metrics: an episode that compacted its history over several policy versions has later
segments fresher than its first (whose lag is the episode's)."""

from __future__ import annotations

import pytest

from learner.backends.torch_learner import StepInput
from rollout.trajectory import NOT_SAMPLED_VERSION, TaskInfo, Trajectory, TrajectoryVersions
from run.observability import metric_names as names
from run.train.trainer import rollout_metrics, segment_lags

N = NOT_SAMPLED_VERSION


def _trajectory(mask: list[int], versions: list[int], segment_starts: tuple[int, ...], compactions: int
                ) -> Trajectory:
    sampled = [v for v, m in zip(versions, mask, strict=True) if m]
    return Trajectory(trajectory_id="t", group_id="g", token_ids=tuple(range(len(mask))),
                      loss_mask=tuple(bool(m) for m in mask),
                      behavior_logprobs=tuple(-1.0 if m else 0.0 for m in mask),
                      versions=TrajectoryVersions(start=min(sampled), end=max(sampled),
                                                  per_token=tuple(versions)),
                      reward=1.0, segment_starts=segment_starts, task=TaskInfo(compactions=compactions))


def test_each_segment_lags_from_its_first_sampled_token() -> None:
    # three segments: sampled at versions 2-3, then 5, then 6 (a segment's context carries no version)
    episode = _trajectory([0, 1, 1, 0, 1, 0, 0, 1, 1], [N, 2, 3, N, 5, N, N, 6, 6], (0, 3, 6), 2)
    assert segment_lags(episode, 8) == [6, 3, 2]
    plain = _trajectory([0, 1, 1], [N, 7, 7], (0,), 0)
    assert segment_lags(plain, 8) == [1]
    metrics = rollout_metrics(StepInput([episode, plain], [0, 0], [6, 1], [True, True]), 8)
    assert metrics[names.STALENESS_SEGMENT_MEAN] == pytest.approx((6 + 3 + 2 + 1) / 4)
    assert metrics[names.STALENESS_SEGMENT_MAX] == 6
    assert metrics[names.ROLLOUT_SEGMENTS_MEAN] == 2 and metrics[names.ROLLOUT_COMPACTIONS_MEAN] == 1
