"""metrics.jsonl is the run's record: one line per step, NaN as null, torn writes and resumed runs
handled; TensorBoard mirrors it; the key module names every metric docs/algorithm.md requires."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

from run.observability import metric_names as names
from run.observability.metrics_log import (
    METRICS_FILE,
    TENSORBOARD_DIR,
    MetricsFileError,
    MetricsLogger,
    dashboard_scalars,
    read_metrics,
)


def _log_steps(run_dir: Path, steps: range, **kwargs: object) -> None:
    with MetricsLogger(run_dir, use_tensorboard=False, **kwargs) as logger:  # type: ignore[arg-type]
        for step in steps:
            logger.log(step, policy_version=step, metrics={names.REWARD_MEAN: step / 10})


def test_each_step_is_one_json_line_with_its_axes(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, use_tensorboard=False) as logger:
        logger.log(1, policy_version=1, metrics={names.REWARD_MEAN: 0.5, names.STALENESS_HIST: [3, 1, 0]})
        logger.log(2, policy_version=2, metrics={names.REWARD_MEAN: 0.75, names.TOKENS_GENERATED: 120})

    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 2
    records = read_metrics(tmp_path)
    assert [r[names.TRAINER_STEP] for r in records] == [1, 2]
    assert [r[names.POLICY_VERSION] for r in records] == [1, 2]
    assert records[0][names.REWARD_MEAN] == 0.5
    assert records[0][names.STALENESS_HIST] == [3, 1, 0]
    assert records[1][names.TOKENS_GENERATED] == 120
    assert 0 <= records[0][names.WALL_S] <= records[1][names.WALL_S]


def test_tensors_are_logged_as_numbers_and_lists(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, use_tensorboard=False) as logger:
        logger.log(0, 0, {names.IS_ESS_RATIO: torch.tensor(0.25),
                          names.STALENESS_HIST: torch.tensor([2, 0, 1])})
    (record,) = read_metrics(tmp_path)
    assert record[names.IS_ESS_RATIO] == 0.25
    assert record[names.STALENESS_HIST] == [2, 0, 1]


def test_non_finite_values_are_written_as_null(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, use_tensorboard=False) as logger:
        logger.log(0, 0, {names.GRAD_NORM: math.nan, names.IS_W_MAX: math.inf,
                          names.STALENESS_HIST: [1.0, -math.inf]})
    text = (tmp_path / METRICS_FILE).read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    (record,) = read_metrics(tmp_path)
    assert record[names.GRAD_NORM] is None
    assert record[names.IS_W_MAX] is None
    assert record[names.STALENESS_HIST] == [1.0, None]


def test_steps_must_increase(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, use_tensorboard=False) as logger:
        logger.log(3, 3, {})
        with pytest.raises(ValueError, match="already logged"):
            logger.log(3, 3, {})


def test_axis_keys_are_not_metrics(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, use_tensorboard=False) as logger, pytest.raises(ValueError, match="axis"):
        logger.log(0, 0, {names.WALL_S: 1.0})


def test_torn_last_line_is_dropped_on_read(tmp_path: Path) -> None:
    _log_steps(tmp_path, range(1, 4))
    with (tmp_path / METRICS_FILE).open("a") as file:
        file.write('{"trainer_step": 4, "reward/me')  # killed mid-write
    assert [r[names.TRAINER_STEP] for r in read_metrics(tmp_path)] == [1, 2, 3]


def test_damaged_middle_line_is_an_error(tmp_path: Path) -> None:
    _log_steps(tmp_path, range(1, 3))
    path = tmp_path / METRICS_FILE
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + "garbage\n" + lines[1])
    with pytest.raises(MetricsFileError, match=":2 is not a JSON metrics record"):
        read_metrics(tmp_path)


def test_missing_metrics_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(MetricsFileError, match="has `vcpo train` logged a step"):
        read_metrics(tmp_path)


def test_new_run_refuses_to_overwrite_logged_steps(tmp_path: Path) -> None:
    _log_steps(tmp_path, range(1, 3))
    with pytest.raises(MetricsFileError, match="resume_from_step"):
        MetricsLogger(tmp_path, use_tensorboard=False)


def test_resume_drops_steps_after_the_checkpoint_and_a_torn_line(tmp_path: Path) -> None:
    _log_steps(tmp_path, range(1, 6))  # steps 1..5 logged, checkpoint at 3
    with (tmp_path / METRICS_FILE).open("a") as file:
        file.write('{"trainer_step": 6, "rew')
    wall_at_3 = read_metrics(tmp_path)[2][names.WALL_S]

    _log_steps(tmp_path, range(4, 6), resume_from_step=3)

    records = read_metrics(tmp_path)
    assert [r[names.TRAINER_STEP] for r in records] == [1, 2, 3, 4, 5]  # no duplicate 4, 5
    assert records[3][names.WALL_S] >= wall_at_3  # wall_s continues across the restart
    assert (tmp_path / METRICS_FILE).read_text().endswith("\n")


def test_resume_refuses_a_step_at_or_before_the_checkpoint(tmp_path: Path) -> None:
    _log_steps(tmp_path, range(1, 4))
    with MetricsLogger(tmp_path, resume_from_step=2, use_tensorboard=False) as logger:
        with pytest.raises(ValueError, match="already logged"):
            logger.log(2, 2, {})
        logger.log(3, 3, {})


def _tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)] for tag in tags}


def test_tensorboard_gets_each_scalar_and_one_per_staleness_bin(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as logger:
        logger.log(1, 1, {names.REWARD_MEAN: 0.5, names.STALENESS_HIST: [4, 2, 1, 0, 0, 0, 0, 0, 3]})
        logger.log(2, 2, {names.REWARD_MEAN: 0.25})

    scalars = _tensorboard_scalars(tmp_path / TENSORBOARD_DIR)
    assert scalars[names.REWARD_MEAN] == [(1, 0.5), (2, 0.25)]
    assert scalars[names.POLICY_VERSION] == [(1, 1.0), (2, 2.0)]
    # 9 log2 bins: [0], [1], [2,3], ... [128, ∞), zero-padded so the tags sort in bin order
    assert scalars["staleness/hist/000"] == [(1, 4.0)]
    assert scalars["staleness/hist/002-003"] == [(1, 1.0)]
    assert scalars["staleness/hist/128+"] == [(1, 3.0)]


def test_tensorboard_purges_the_steps_a_resume_replaces(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path) as logger:
        for step in (1, 2, 3):
            logger.log(step, step, {names.REWARD_MEAN: 0.0})
    with MetricsLogger(tmp_path, resume_from_step=1) as logger:
        for step in (2, 3):
            logger.log(step, step, {names.REWARD_MEAN: 1.0})

    rewards = _tensorboard_scalars(tmp_path / TENSORBOARD_DIR)[names.REWARD_MEAN]
    assert rewards == [(1, 0.0), (2, 1.0), (3, 1.0)]  # the first run's steps 2 and 3 are purged


def test_without_tensorboard_it_warns_and_still_writes_jsonl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    with (caplog.at_level(logging.WARNING, logger="run.observability.metrics_log"),
          MetricsLogger(tmp_path) as logger):
        logger.log(0, 0, {names.REWARD_MEAN: 1.0})
        logger.log(1, 1, {names.REWARD_MEAN: 1.0})
    assert sum("TensorBoard logging is off" in r.getMessage() for r in caplog.records) == 1
    assert len(read_metrics(tmp_path)) == 2
    assert not (tmp_path / TENSORBOARD_DIR).exists()


def test_wandb_without_the_package_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ImportError, match="pip install wandb"):
        MetricsLogger(tmp_path, use_tensorboard=False, use_wandb=True)


def test_dashboard_scalars_flatten_lists_and_map_null_to_nan() -> None:
    record = {names.TRAINER_STEP: 5, names.WALL_S: 1.0, names.POLICY_VERSION: 4,
              names.GRAD_NORM: None, "custom/list": [1, 2]}
    flat = dashboard_scalars(record)
    assert set(flat) == {names.POLICY_VERSION, names.GRAD_NORM, "custom/list/0", "custom/list/1"}
    assert math.isnan(flat[names.GRAD_NORM])
    assert flat["custom/list/1"] == 2.0


def test_per_lag_metrics_are_labelled_by_staleness_bin_and_an_empty_bin_is_nan() -> None:
    record = {names.TRAINER_STEP: 1, names.CORRECTION_REJECTED_BY_LAG: [0.5, None, 0.25] + [None] * 6,
              names.stage_metric("opsm", "rejected_tokens_by_lag"): [0.0] * 9}
    flat = dashboard_scalars(record)
    assert flat["correction/rejected_tokens_by_lag/000"] == 0.5
    assert math.isnan(flat["correction/rejected_tokens_by_lag/001"])
    assert flat["correction/rejected_tokens_by_lag/002-003"] == 0.25
    assert "correction/opsm/rejected_tokens_by_lag/128+" in flat


def test_metric_names_cover_vcpo_md_and_have_no_duplicates() -> None:
    assert len(set(names.ALL_METRICS)) == len(names.ALL_METRICS)
    for key in ("lr/base", "lr/scale", "grad/norm", "tokens/generated", "tokens/trained", "time/generate",
                "time/train", "time/weight_sync", "time/idle_learner", "time/idle_rollout", "staleness/hist",
                "is/kl_k3", "opob/gap_to_group_mean", "pg/masked_frac", "reward/std"):
        assert key in names.REQUIRED_EVERY_STEP, key
    assert names.AXES == ("trainer_step", "policy_version", "wall_s")


def test_staleness_bin_labels_follow_the_log2_bins() -> None:
    labels = [names.staleness_bin_label(index, 9) for index in range(9)]
    assert labels == ["0", "1", "2-3", "4-7", "8-15", "16-31", "32-63", "64-127", "128+"]
    assert names.staleness_bin_label(2, 9, width=3) == "002-003"


def test_jsonl_lines_are_plain_json(tmp_path: Path) -> None:
    _log_steps(tmp_path, range(2))
    first = json.loads((tmp_path / METRICS_FILE).read_text().splitlines()[0])
    assert first == {"trainer_step": 0, "policy_version": 0, "wall_s": first["wall_s"], "reward/mean": 0.0}


def test_staleness_bin_bounds_agree_with_vcpo_binning() -> None:
    from vcpo.metrics import staleness_bin

    for index in range(names.STALENESS_HIST_BINS):
        low, high = names.staleness_bin_bounds(index)
        edge_lags = torch.tensor([low, 1000 if high is None else high])
        assert staleness_bin(edge_lags).tolist() == [index, index]
