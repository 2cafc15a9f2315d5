"""`vcpo trend`: block statistics, the least-squares success trend and its step bootstrap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli import main
from run.observability import metric_names as names
from run.observability.trend import (
    LearningSignal,
    TrendError,
    format_trend,
    pooled_trend,
    read_step_rewards,
    reward_trend,
    success_trend,
)


def _write_run(run_dir: Path, successes_per_step: list[int], per_step: int = 8, torn: bool = False) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step, wins in enumerate(successes_per_step, start=1):
        for i in range(per_step):
            lines.append(json.dumps({"step": step, "reward": 1.0 if i < wins else 0.1, "text": "…"}) + "\n")
    if torn:
        lines.append('{"step": 99, "rew')
    (run_dir / "trajectories.jsonl").write_text("".join(lines), encoding="utf-8")
    return run_dir


def test_blocks_and_the_exact_slope_of_a_linear_success_rate(tmp_path: Path) -> None:
    # success rate (step − 1)/8 over steps 1..8: +1/8 per step = +12.5 (a rate change) per 100 steps
    run = _write_run(tmp_path / "run", list(range(8)), torn=True)  # a torn last line is dropped
    result = reward_trend(run, block=4, resamples=200)
    assert result["steps"] == 8 and result["episodes"] == 64
    assert result["blocks"][0] == {"steps": [1, 4], "episodes": 32, "reward_mean": pytest.approx(
        (6 * 1.0 + 26 * 0.1) / 32, abs=1e-4), "successes": 6, "success_rate": pytest.approx(6 / 32, abs=1e-4)}
    assert result["last_block"]["successes"] == 4 + 5 + 6 + 7
    assert result["success_rate_change_per_100_steps"] == pytest.approx(12.5)
    low, high = result["ci95_change_per_100_steps"]
    assert 0 < low <= high


def test_a_flat_run_has_an_interval_around_zero(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", [1, 3, 0, 2, 3, 1, 0, 2, 1, 3, 2, 0, 3, 1, 2, 0] * 3)
    low, high = reward_trend(run, resamples=500)["ci95_change_per_100_steps"]
    assert low < 0 < high


def test_missing_or_damaged_logs_are_named(tmp_path: Path) -> None:
    with pytest.raises(TrendError, match=r"trajectories\.jsonl does not exist"):
        reward_trend(tmp_path)
    run = _write_run(tmp_path / "run", [1, 2])
    with (run / "trajectories.jsonl").open("a") as handle:
        handle.write("not json\n" + json.dumps({"step": 3, "reward": 1.0}) + "\n")
    with pytest.raises(TrendError, match=r"trajectories.jsonl:17 is not a trajectory record"):
        reward_trend(run)


def test_cli_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _write_run(tmp_path / "run", [0, 1, 2, 3])
    assert main(["trend", str(run), "--block", "2", "--resamples", "50", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [b["successes"] for b in result["blocks"]] == [1, 5]
    assert main(["trend", str(run), "--block", "2", "--resamples", "50"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2].split() == ["1–2", "16", f"{result['blocks'][0]['reward_mean']:.3f}", "1", "(", "6.2%)"]
    assert table[-2].startswith("  success, steps 1–1 → 4–4: ") and table[-1].startswith("  trend: ")
    assert "too few for one" in table[-1]  # 4 steps: no slope, let alone one per 100 steps
    assert main(["trend", str(tmp_path / "nowhere")]) == 2


def test_pooled_trend_averages_the_runs_and_narrows_the_interval(tmp_path: Path) -> None:
    # Two seeds with the same weak rise under different noise: each interval spans 0, the pooled one is
    # narrower (twice the steps) and its centre is the mean of the two slopes.
    noise_a = [1, 3, 0, 2, 3, 1, 0, 2, 1, 3, 2, 0, 3, 1, 2, 0] * 2
    noise_b = [2, 0, 3, 1, 0, 2, 3, 1, 2, 1, 0, 3, 1, 2, 0, 3] * 2
    rise = [step // 11 for step in range(32)]  # +0, +1, +2 successes of 8 over three thirds of the run
    runs = [_write_run(tmp_path / name, [n + r for n, r in zip(noise, rise, strict=True)])
            for name, noise in (("a", noise_a), ("b", noise_b))]
    result = pooled_trend(runs, resamples=600)
    singles = [reward_trend(run, resamples=600) for run in runs]
    assert [r["success_rate_change_per_100_steps"] for r in result["runs"]] == [
        s["success_rate_change_per_100_steps"] for s in singles]
    pooled = result["pooled"]
    changes = pooled["per_run_change_per_100_steps"]
    assert pooled["success_rate_change_per_100_steps"] == pytest.approx(sum(changes) / 2, abs=1e-4)
    widths = [s["ci95_change_per_100_steps"][1] - s["ci95_change_per_100_steps"][0] for s in singles]
    low, high = pooled["ci95_change_per_100_steps"]
    assert low < pooled["success_rate_change_per_100_steps"] < high
    assert high - low < min(widths)


def test_pooling_needs_two_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least two run directories"):
        pooled_trend([_write_run(tmp_path / "run", [0, 1])])


def test_cli_pools_several_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = _write_run(tmp_path / "a", [0, 1, 2, 3]), _write_run(tmp_path / "b", [3, 2, 1, 0])
    assert main(["trend", str(first), str(second), "--resamples", "50", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["pooled"]["per_run_change_per_100_steps"] == [pytest.approx(12.5), pytest.approx(-12.5)]
    assert result["pooled"]["success_rate_change_per_100_steps"] == pytest.approx(0.0)
    assert main(["trend", str(first), str(second), "--resamples", "50"]) == 0
    pooled_line = capsys.readouterr().out.splitlines()[-1]
    assert pooled_line.startswith("pooled over 2 runs: +0.0 points per 100 steps")
    assert main(["trend", str(first), str(tmp_path / "nowhere")]) == 2


def test_the_live_signal_updates_every_few_steps_and_warns_when_success_falls(tmp_path: Path) -> None:
    signal = LearningSignal(tmp_path, resume_from_step=0)
    shown = {}
    for step in range(1, 41):  # success falls from 8 of 8 to 0 of 8 over the run
        successes = max(0, 8 - step // 5)
        shown[step] = signal.update(step, [1.0] * successes + [0.1] * (8 - successes))
    assert not any(shown[step] for step in range(1, 10)) and not shown[11]  # too early / not a 5th step
    trend = shown[40]
    assert trend[names.TREND_SUCCESS_HIGH] < 0 < 0.0 - trend[names.TREND_SUCCESS]
    change, low, high = success_trend(signal.steps, seed=40)
    assert [trend[k] for k in (names.TREND_SUCCESS, names.TREND_SUCCESS_LOW, names.TREND_SUCCESS_HIGH)] == (
        pytest.approx([change, low, high]))
    warning = signal.warning(40, trend)
    assert warning is not None and warning.startswith("warning: training success is falling at step 40")
    assert signal.warning(45, trend) is None  # not again within 20 steps
    assert signal.warning(60, {names.TREND_SUCCESS: 0.1, names.TREND_SUCCESS_LOW: -0.01,
                               names.TREND_SUCCESS_HIGH: 0.2}) is None  # not significant: no warning


def test_a_resumed_signal_starts_from_the_trajectory_log(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", [1, 2, 3, 4])
    signal = LearningSignal(run, resume_from_step=2)
    assert sorted(signal.steps) == [1, 2]
    assert LearningSignal(tmp_path / "nowhere", resume_from_step=3).steps == {}


def test_success_trend_is_reward_trends_estimate(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", [0, 1, 1, 3, 2, 4, 3, 5, 6, 5])
    from_file = reward_trend(run, resamples=200)
    change, low, high = success_trend(read_step_rewards(run))
    assert change == pytest.approx(from_file["success_rate_change_per_100_steps"], abs=1e-4)
    assert low < change < high
    # the same resampling scheme: the intervals agree to within bootstrap noise
    assert [low, high] == pytest.approx(from_file["ci95_change_per_100_steps"], rel=0.15)


def test_a_ten_step_run_reports_a_bounded_change_and_says_it_is_too_short_for_a_trend(tmp_path: Path) -> None:
    """A 10-step run rising from 0 to 9 of 8…: the slope per 100 steps would read +1,125 points; the report
    gives the change between the first and last thirds (a difference of rates, within ±100 points) and says
    the run is too short for a trend."""
    run = _write_run(tmp_path / "run", [0, 0, 1, 2, 3, 4, 5, 6, 8, 8])
    result = reward_trend(run, resamples=300)
    assert result["too_short_for_trend"] and result["span_steps"] == 9
    assert result["first_third_steps"] == [1, 3] and result["last_third_steps"] == [8, 10]
    assert result["success_change_first_to_last_third"] == pytest.approx((22 - 1) / 24, abs=1e-4)
    low, high = result["ci95_change_first_to_last_third"]
    assert -1.0 <= low <= result["success_change_first_to_last_third"] <= high <= 1.0
    text = format_trend(result)
    assert "too few for one" in text and "per 100 steps" not in text
    assert "+87.5 points" in text  # (22 − 1)/24 of the episodes


def test_a_run_shorter_than_100_steps_gives_its_trend_per_step_not_per_100(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "run", [i // 8 for i in range(40)])  # 0 → 4 of 8 over 40 steps
    text = format_trend(reward_trend(run, resamples=200))
    assert "per step over the 39 steps run" in text and "not extrapolated" in text
    long_run = _write_run(tmp_path / "long", [i // 30 for i in range(120)])
    assert "per 100 steps (95% interval" in format_trend(reward_trend(long_run, resamples=200))
