"""What a user sees of a run: the dashboard PNG (`vcpo plot`) and the live progress line."""

from __future__ import annotations

import io
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest

from cli import main
from run.observability import metric_names as names
from run.observability.metrics_log import METRICS_FILE, MetricsFileError, MetricsLogger
from run.observability.plot import _moving_average, plot_run
from run.observability.progress import ProgressLine, format_activity, format_progress

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_synthetic_run(run_dir: Path, num_steps: int = 60, seed: int = 0) -> None:
    """A plausible async run: rising reward, ESS dipping with lag, a few NaN gradient norms."""
    rng = random.Random(seed)
    with MetricsLogger(run_dir, use_tensorboard=False) as logger:
        for step in range(1, num_steps + 1):
            lag = rng.uniform(0.5, 3.0)
            train_s, idle_s = 3 + rng.random(), rng.random()
            ess = max(0.05, 1.0 - 0.15 * lag + rng.gauss(0, 0.05))
            logger.log(step, policy_version=step, metrics={
                names.REWARD_MEAN: min(1.0, 0.1 + step / num_steps * 0.6 + rng.gauss(0, 0.05)),
                names.REWARD_STD: 0.3,
                names.IS_ESS_RATIO: ess,
                names.IS_ESS_RATIO_CLIPPED: min(1.0, ess + 0.1),
                names.LR_SCALE: ess,
                names.STALENESS_MEAN: lag,
                names.STALENESS_MAX: math.ceil(lag * 2),
                names.STALENESS_HIST: [rng.randint(0, 4), rng.randint(2, 8), rng.randint(1, 6),
                                       rng.randint(0, 2), 0, 0, 0, 0, 0],
                names.GRAD_NORM: math.nan if step == 7 else 10 ** rng.uniform(-1, 1),
                names.IS_KL_K3: 10 ** rng.uniform(-4, -2),
                names.ROLLOUT_TURNS_MEAN: 2 + rng.random(),
                names.ROLLOUT_TOOL_CALLS_MEAN: 1.5 + rng.random(),
                names.ROLLOUT_TOOL_ERRORS_MEAN: 0.2 * rng.random(),
                names.TIME_GENERATE: 4 + rng.random(),
                names.TIME_TRAIN: train_s,
                names.TIME_WEIGHT_SYNC: 0.4,
                names.TIME_IDLE_LEARNER: idle_s,
                names.TIME_STEP: train_s + 0.4 + idle_s + 0.01,
                names.PERF_TOKENS_PER_S: 1500 + 100 * rng.random(),
                names.ROLLOUT_MAX_LAG: 3,
            })


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 10_000


# --- Dashboard --------------------------------------------------------------------------------


def test_dashboard_is_written_into_the_run_dir(tmp_path: Path) -> None:
    write_synthetic_run(tmp_path)
    out = plot_run(tmp_path)
    assert out == tmp_path / "dashboard.png"
    assert _is_png(out)


def test_dashboard_with_only_a_reward_shows_the_other_panels_as_not_logged(tmp_path: Path) -> None:
    with MetricsLogger(tmp_path, use_tensorboard=False) as logger:
        for step in range(3):
            logger.log(step, step, {names.REWARD_MEAN: step / 2})
    out = plot_run(tmp_path, tmp_path / "sub" / "reward_only.png")
    assert _is_png(out)


def test_dashboard_reads_a_run_whose_last_line_is_torn(tmp_path: Path) -> None:
    write_synthetic_run(tmp_path, num_steps=5)
    with (tmp_path / METRICS_FILE).open("a") as file:
        file.write('{"trainer_step": 6, "rew')
    assert _is_png(plot_run(tmp_path))


def test_dashboard_of_a_single_step_run(tmp_path: Path) -> None:
    write_synthetic_run(tmp_path, num_steps=1)
    assert _is_png(plot_run(tmp_path))


def test_the_lag_panel_draws_the_bound_in_force_and_marks_each_move_of_an_auto_bound() -> None:
    from matplotlib.figure import Figure

    from run.observability.plot import _Run, _staleness_lag

    bounds, moves = [0, 1, 1, 2, 1, 1], [0, 1, 0, 1, -1, 0]
    records = [{names.TRAINER_STEP: step + 1, names.STALENESS_MEAN: 0.5, names.STALENESS_MAX: 1,
                names.ROLLOUT_MAX_LAG: bound, names.ROLLOUT_LAG_MOVE: move,
                names.ROLLOUT_LAG_RAISES: sum(m > 0 for m in moves[: step + 1]),
                names.ROLLOUT_LAG_LOWERS: sum(m < 0 for m in moves[: step + 1])}
               for step, (bound, move) in enumerate(zip(bounds, moves, strict=True))]
    axes = Figure().subplots()
    _staleness_lag(axes, _Run(records))
    lines = {line.get_label(): line for line in axes.get_lines()}
    assert list(lines["rollout/max_lag (bound)"].get_ydata()) == bounds
    assert list(lines["bound raised"].get_xdata()) == [2.0, 4.0]
    assert list(lines["bound lowered"].get_xdata()) == [5.0]
    assert axes.get_title().endswith("2 raised, 1 lowered")


def test_moving_average_is_trailing_and_skips_nan() -> None:
    # window 2 over [1, 2, nan, 4]: [1/1, (1+2)/2, 2/1 (nan skipped), 4/1 (nan skipped)]
    averaged = _moving_average(np.array([1.0, 2.0, np.nan, 4.0]), window=2)
    assert averaged.tolist() == [1.0, 1.5, 2.0, 4.0]
    assert np.isnan(_moving_average(np.array([np.nan, np.nan]), window=2)).all()


@pytest.mark.parametrize("content", [None, ""])
def test_dashboard_without_metrics_says_what_to_check(tmp_path: Path, content: str | None) -> None:
    if content is not None:
        (tmp_path / METRICS_FILE).write_text(content)
    expected = rf"no metrics in {re.escape(str(tmp_path))}/metrics\.jsonl — has `vcpo train` logged a step\?"
    with pytest.raises(MetricsFileError, match=expected):
        plot_run(tmp_path)


def test_cli_plot_prints_the_written_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_synthetic_run(tmp_path, num_steps=4)
    out = tmp_path / "elsewhere.png"
    assert main(["plot", str(tmp_path), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert _is_png(out)


def test_cli_plot_of_an_empty_run_dir_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics in" in capsys.readouterr().err


def test_cli_plot_of_several_runs_writes_one_comparison(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    for seed in (0, 1):
        write_synthetic_run(tmp_path / f"run{seed}", num_steps=12, seed=seed)
    out = tmp_path / "both.png"
    assert main(["plot", str(tmp_path / "run0"), str(tmp_path / "run1"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert _is_png(out)
    (tmp_path / "empty").mkdir()
    assert main(["plot", str(tmp_path / "run0"), str(tmp_path / "empty"), "--out", str(out)]) == 2
    assert "no metrics in" in capsys.readouterr().err


# --- Progress line ----------------------------------------------------------------------------

FULL_METRICS = {
    names.REWARD_MEAN: 0.4251,
    names.IS_ESS_RATIO: 0.8666,
    names.LR_SCALE: 0.5,
    names.STALENESS_MEAN: 1.3,
    names.STALENESS_MAX: 4,
    names.PERF_TOKENS_PER_S: 1234.0,
}


def test_progress_line_formats_each_field() -> None:
    # 12/500 = 2.4% → "2%"; 1234 tok/s → "1.2k"; 312.7 s = 5 min 12 s → "0:05:12"
    assert format_progress(12, 500, FULL_METRICS, elapsed_s=312.7) == (
        "step 12/500 (2%) | reward 0.425 | ess 0.87 | lr scale 0.50 | lag 1.3 (max 4) | 1.2k tok/s | 0:05:12")


def test_progress_line_marks_missing_and_nan_metrics() -> None:
    assert format_progress(0, 10, {names.REWARD_MEAN: math.nan}) == (
        "step 0/10 (0%) | reward nan | ess - | lr scale - | lag - (max -) | - tok/s")


def test_progress_line_takes_elapsed_from_wall_s_and_scales_rates() -> None:
    # 3725 s = 1 h 2 min 5 s; 2.5e6 tok/s → "2.5M"; 850 stays "850"
    line = format_progress(5, 5, {names.WALL_S: 3725.0, names.PERF_TOKENS_PER_S: 2.5e6})
    assert line.startswith("step 5/5 (100%) |")
    assert line.endswith("| 2.5M tok/s | 1:02:05")
    assert "| 850 tok/s" in format_progress(1, 5, {names.PERF_TOKENS_PER_S: 850.0})


def test_progress_to_a_file_writes_a_line_per_interval_and_the_last_step() -> None:
    times = iter([0.0, 1.0, 10.0, 31.0, 35.0])  # construction, then one per update
    stream = io.StringIO()
    progress = ProgressLine(4, stream, interval_s=30.0, clock=lambda: next(times))
    for step in (1, 2, 3, 4):  # at t = 1 (first), 10 (skipped: 9 s < 30 s), 31 (30 s later), 35 (last)
        progress.update(step, {})
    lines = stream.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1/4 (25%)", "step 3/4 (75%)", "step 4/4 (100%)"]
    assert lines[1].endswith("0:00:31")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _segments(stream: io.StringIO) -> list[str]:
    """What each redraw left on the terminal line (tqdm's carriage returns, without its ANSI clears)."""
    text = stream.getvalue().replace("\x1b[A", "").replace("\x1b[2K", "")
    return [part.rstrip("\n") for part in text.split("\r") if part.strip()]


def test_progress_on_a_terminal_rewrites_one_line_in_place_within_its_width() -> None:
    stream = _Terminal()
    with ProgressLine(10, stream, clock=lambda: 0.0, columns=60) as progress:
        progress.update(1, FULL_METRICS)
        progress.update(2, {})
        progress.message("held-out success at step 2: 12.5% (95% interval 7.8–19.4%)")
        progress.activity("step 3: rollouts 10 episodes done (16 per step), 6 running, 12.3k tokens sampled")
    segments = _segments(stream)
    assert segments[0].startswith("step 1/10") and any(s.startswith("step 2/10") for s in segments)
    assert all(len(segment) <= 60 for segment in segments), segments  # never wider than the terminal
    assert "held-out success at step 2: 12.5% (95% interval 7.8–19.4%)\n" in stream.getvalue()
    assert stream.getvalue().endswith("\n")


def test_activity_says_what_a_step_is_doing() -> None:
    assert format_activity(4, phase="rollouts", since_s=133.0, episodes_done=10, episodes_total=16,
                           episodes_running=6, tokens=12345) == (
        "step 4: rollouts 10 episodes done (16 per step), 6 running, 12.3k tokens sampled (93 tok/s), "
        "0:02:13")
    assert format_activity(4, phase="learner step", since_s=20.0) == "step 4: learner step, 0:00:20"
    # counts a Ray driver does not have are left out, not shown as zeros
    assert format_activity(2, phase="rollouts", since_s=5.0) == "step 2: rollouts, 0:00:05"


def test_activity_lines_never_delay_a_step_line_in_a_log_file() -> None:
    times = iter([0.0, 10.0, 11.0, 41.0, 50.0, 55.0])  # construction, then one per call
    stream = io.StringIO()
    progress = ProgressLine(3, stream, interval_s=30.0, clock=lambda: next(times))
    progress.activity("step 1: rollouts, 0:00:10")  # t = 10: skipped — only 10 s without a line
    progress.update(1, {})                           # t = 11: written (the first step line)
    progress.activity("step 2: rollouts, 0:00:30")  # t = 41: written — 30 s without a line
    progress.update(2, {})  # t = 50: written — 39 s after step 1's line, though only 9 s after the activity
    progress.update(3, {})  # t = 55: the last step is always written
    lines = stream.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == [
        "step 1/3 (33%)", "  ... step 2: rollouts, 0:00:30", "step 2/3 (67%)", "step 3/3 (100%)"]


def test_activity_on_a_terminal_leads_the_last_step_line_in_place() -> None:
    stream = _Terminal()
    with ProgressLine(10, stream, clock=lambda: 0.0, columns=200) as progress:
        progress.update(1, {})
        progress.activity("step 2: learner step, 0:00:03")
    segments = _segments(stream)
    assert segments[-1].rstrip() == "step 2: learner step, 0:00:03 | " + segments[0].rstrip()


def test_the_step_line_carries_the_success_trend_once_there_is_one() -> None:
    line = format_progress(20, 100, {names.TREND_SUCCESS: 0.042, names.TREND_SUCCESS_LOW: -0.01,
                                     names.TREND_SUCCESS_HIGH: 0.094})
    assert "| success +4.2/100 steps (-1.0 to +9.4)" in line
    assert "success" not in format_progress(3, 100, {})


def test_the_reward_band_is_the_interval_of_each_steps_mean_inside_its_reward_range() -> None:
    """A 0/1 reward with mean 0.5 and std 0.5 over 16 trajectories: ± one std would span −0 to 1 and beyond
    at other means; the band is mean ± 1.96 · 0.5/√15 and never leaves [reward/min, reward/max]."""
    from run.observability.plot import _mean_interval, _Run

    records = [{"trainer_step": step, "policy_version": step, "wall_s": float(step),
                names.REWARD_MEAN: mean, names.REWARD_STD: std, names.REWARD_MIN: 0.0, names.REWARD_MAX: 1.0,
                names.TRAIN_TRAJECTORIES: 16}
               for step, (mean, std) in enumerate([(0.5, 0.5), (0.0625, 0.242), (1.0, 0.0)], start=1)]
    run = _Run(records)
    low, high = _mean_interval(run, run.column(names.REWARD_MEAN))
    half = 1.96 * 0.5 / math.sqrt(15)
    assert low[0] == pytest.approx(0.5 - half) and high[0] == pytest.approx(0.5 + half)
    assert low[1] == 0.0 and 0.0625 < high[1] < 0.2  # held inside [0, 1] where mean − 1.96 s.e. < 0
    assert low[2] == high[2] == 1.0  # every episode solved: no spread
    assert (low >= 0).all() and (high <= 1).all()
