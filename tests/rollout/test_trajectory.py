"""The Trajectory contract: token alignment, validation with the fix, and exact round trips."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollout.trajectory import (
    NOT_SAMPLED_VERSION,
    TaskInfo,
    Trajectory,
    TrajectoryBuilder,
    TrajectoryVersions,
)
from rollout.types import GenerationResult


def _turn(
    token_ids: tuple[int, ...], versions: tuple[int, ...], finish_reason: str = "stop"
) -> GenerationResult:
    return GenerationResult(
        request_id="r",
        token_ids=token_ids,
        logprobs=tuple(-0.25 * (i + 1) for i in range(len(token_ids))),
        versions=versions,
        finish_reason=finish_reason,
        version_start=versions[0],
        version_end=versions[-1],
    )


def _two_turn_trajectory() -> Trajectory:
    builder = TrajectoryBuilder([1, 2, 3])  # prompt
    builder.add_generation(_turn((10, 11), (4, 4)))  # model turn sampled at version 4
    builder.add_context([20, 21, 22])  # tool observation
    builder.add_generation(_turn((12,), (5,)))  # second turn, after a weight update
    return builder.build("t0", "g0", reward=1.0)


def test_builder_aligns_mask_logprobs_and_versions_to_tokens() -> None:
    trajectory = _two_turn_trajectory()
    assert trajectory.token_ids == (1, 2, 3, 10, 11, 20, 21, 22, 12)
    assert trajectory.loss_mask == (False,) * 3 + (True,) * 2 + (False,) * 3 + (True,)
    assert trajectory.behavior_logprobs == (0.0,) * 3 + (-0.25, -0.5) + (0.0,) * 3 + (-0.25,)
    assert trajectory.versions.per_token == (-1, -1, -1, 4, 4, -1, -1, -1, 5)
    assert (trajectory.versions.start, trajectory.versions.end) == (4, 5)
    assert (trajectory.task.turns, trajectory.num_sampled_tokens) == (2, 3)


@pytest.mark.parametrize("codec", ["msgpack", "json"])
def test_round_trip_is_exact(codec: str) -> None:
    trajectory = _two_turn_trajectory().model_copy(update={"reward": 0.1 + 0.2})  # a float that prints long
    if codec == "msgpack":
        again = Trajectory.from_msgpack(trajectory.to_msgpack())
    else:
        line = trajectory.to_json_line()
        assert "\n" not in line
        again = Trajectory.from_json_line(line)
    assert again == trajectory


def _raw(**overrides: object) -> dict[str, object]:
    fields: dict[str, object] = dict(
        trajectory_id="t",
        group_id="g",
        token_ids=(1, 2, 3),
        loss_mask=(False, True, True),
        behavior_logprobs=(0.0, -1.0, -2.0),
        versions=TrajectoryVersions(start=0, end=1, per_token=(-1, 0, 1)),
    )
    return fields | overrides


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_mask": (False, True)}, "loss_mask has 2 entries for 3 token_ids"),
        ({"loss_mask": (True, True, True)}, r"loss_mask\[0\] is true"),
        ({"behavior_logprobs": (0.5, -1.0, -2.0)}, r"behavior_logprobs\[0\]=0.5 where loss_mask is false"),
        ({"behavior_logprobs": (0.0, float("nan"), -2.0)}, "not a finite log-probability"),
        ({"versions": TrajectoryVersions(start=0, end=1, per_token=(-1, 0, 2))}, r"outside \[start, end\]"),
        ({"versions": TrajectoryVersions(start=0, end=1, per_token=(0, 0, 1))}, "it must be -1"),
        ({"versions": TrajectoryVersions(start=2, end=1)}, "versions.end=1 < versions.start=2"),
        ({"segment_starts": (1,)}, "must begin with 0"),
        ({"segment_starts": (0, 3)}, "must increase and stay below the 3 tokens"),
        ({"segment_starts": (0, 2)}, r"segments starting at \[2\] start with a sampled token"),
    ],
)
def test_invalid_trajectories_are_rejected_with_the_reason(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        Trajectory(**_raw(**overrides))


def test_per_token_versions_are_optional_and_task_metadata_travels() -> None:
    trajectory = Trajectory(
        **_raw(
            versions=TrajectoryVersions(start=0, end=0),
            task=TaskInfo(tool_calls=2, tool_errors=1, is_truncated=True, name="countdown"),
        )
    )
    again = Trajectory.from_msgpack(trajectory.to_msgpack())
    assert again.versions.per_token is None
    assert (again.task.tool_calls, again.task.is_truncated, again.task.name) == (2, True, "countdown")
    assert NOT_SAMPLED_VERSION == -1


def test_a_new_context_that_does_not_extend_the_last_starts_a_segment_and_one_that_does_is_appended() -> None:
    """Earlier reasoning stripped (the context no longer extends the tokens so far): a new segment holding
    the whole new context; a context that extends the current segment's is appended, no token twice."""
    builder = TrajectoryBuilder([1, 2, 3])
    builder.add_generation(_turn((10, 11), (4, 4)))  # thinking 10, answer 11
    builder.add_context([20])  # tool output
    builder.start_segment([1, 2, 3, 11, 20, 30])  # re-rendered without the thinking token 10
    assert builder.segment_count == 2 and builder.context_ids() == [1, 2, 3, 11, 20, 30]
    builder.add_generation(_turn((12,), (5,)))
    builder.start_segment([1, 2, 3, 11, 20, 30, 12, 40])  # extends the current segment: appended
    assert builder.segment_count == 2
    builder.add_generation(_turn((13,), (5,)))
    trajectory = builder.build("t", "g", reward=1.0)
    assert trajectory.segment_starts == (0, 6)
    assert trajectory.token_ids == (1, 2, 3, 10, 11, 20, 1, 2, 3, 11, 20, 30, 12, 40, 13)
    assert trajectory.segments == [(0, 6), (6, 15)]
    sampled = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m]
    assert sampled == [10, 11, 12, 13]  # each sampled token once, where it was sampled
    again = Trajectory.from_msgpack(trajectory.to_msgpack())
    assert again == trajectory and Trajectory.from_json_line(trajectory.to_json_line()) == trajectory
    old = Trajectory.model_validate({k: v for k, v in _raw().items()})  # stored before segments existed
    assert old.segment_starts == (0,) and old.segments == [(0, 3)]
