"""`vcpo plot`: one PNG dashboard of a run from its metrics.jsonl.

A 3×3 grid against trainer_step: reward (each step's mean with its 95% interval, moving average); ESS
ratio with the lr scale it drives; the staleness histogram summed over all steps and the lag over steps
(with the bound in force and, under `rollout.max_lag: auto`, its moves); pre-clip gradient norm;
KL(μ‖π_old) (is/kl_k3); tool use per trajectory; where each learner step's time went; and throughput. A
panel whose metrics the run did not log says "not logged" instead of failing, so the same dashboard serves
every algorithm and partial runs (it reads safely while a run writes).

Uses matplotlib's Agg canvas through `Figure` (no pyplot, no display, no global backend switch).
It does not compare runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from run.observability.metric_names import (
    EVAL_SUCCESS,
    EVAL_SUCCESS_HIGH,
    EVAL_SUCCESS_LOW,
    GRAD_NORM,
    IS_ESS_RATIO,
    IS_ESS_RATIO_CLIPPED,
    IS_KL_K3,
    LR_SCALE,
    PERF_TOKENS_PER_S,
    POLICY_VERSION,
    REWARD_MAX,
    REWARD_MEAN,
    REWARD_MIN,
    REWARD_STD,
    ROLLOUT_LAG_LOWERS,
    ROLLOUT_LAG_MOVE,
    ROLLOUT_LAG_RAISES,
    ROLLOUT_MAX_LAG,
    ROLLOUT_TOOL_CALLS_MEAN,
    ROLLOUT_TOOL_ERRORS_MEAN,
    ROLLOUT_TURNS_MEAN,
    STALENESS_HIST,
    STALENESS_MAX,
    STALENESS_MEAN,
    TIME_GENERATE,
    TIME_IDLE_LEARNER,
    TIME_STEP,
    TIME_TRAIN,
    TIME_WEIGHT_SYNC,
    TRAIN_TRAJECTORIES,
    TRAINER_STEP,
    WALL_S,
    eval_set_metric,
    staleness_bin_label,
)
from run.observability.metrics_log import MetricsFileError, no_metrics_message, read_metrics

DASHBOARD_FILE = "dashboard.png"


class _Run:
    """The records as columns: `steps` (n,) and `column(key)` (n,) floats, NaN where not logged."""

    def __init__(self, records: Sequence[dict[str, Any]]) -> None:
        self.records = records
        self.steps = np.array([record[TRAINER_STEP] for record in records], dtype=float)

    def column(self, key: str) -> np.ndarray:
        values = [record.get(key) for record in self.records]
        return np.array([v if isinstance(v, (int, float)) else np.nan for v in values], dtype=float)

    @property
    def marker(self) -> str | None:
        """Dots on short runs, where a line of one or two points is invisible."""
        return "o" if len(self.steps) <= 20 else None

    def null_steps(self, key: str) -> np.ndarray:
        """Steps where `key` was logged as null (a non-finite value: NaN loss, inf gradient norm)."""
        return np.array([r[TRAINER_STEP] for r in self.records if key in r and r[key] is None], dtype=float)

    def has(self, *keys: str) -> bool:
        """Whether any of `keys` has a finite value in some step."""
        return any(np.isfinite(self.column(key)).any() for key in keys)


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Write the dashboard PNG of `run_dir` (default `run_dir/dashboard.png`); returns its path.

    Raises MetricsFileError when run_dir/metrics.jsonl is missing, empty or corrupt.
    """
    run_dir = Path(run_dir)
    records = [r for r in read_metrics(run_dir) if isinstance(r.get(TRAINER_STEP), (int, float))]
    if not records:
        raise MetricsFileError(no_metrics_message(run_dir))
    records.sort(key=lambda record: record[TRAINER_STEP])
    run = _Run(records)

    figure = Figure(figsize=(18, 12), dpi=100, layout="constrained")
    grid = figure.subplots(3, 3)
    panels = (_reward, _ess, _staleness_hist, _staleness_lag, _grad_norm, _kl, _tool_use, _time_split,
              _throughput)
    for axes, panel in zip(grid.flat, panels, strict=True):
        panel(axes, run)
        axes.grid(True, alpha=0.3)
    figure.suptitle(_title(run_dir, records), fontsize=14)

    out = Path(out) if out is not None else run_dir / DASHBOARD_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png")
    return out


def _title(run_dir: Path, records: Sequence[dict[str, Any]]) -> str:
    first, last = records[0], records[-1]
    parts = [f"{run_dir.resolve().name}: {len(records)} steps logged "
             f"(trainer_step {first[TRAINER_STEP]}–{last[TRAINER_STEP]})"]
    if last.get(POLICY_VERSION) is not None:
        parts.append(f"policy_version {last[POLICY_VERSION]}")
    if isinstance(last.get(WALL_S), (int, float)):
        wall_s = int(last[WALL_S])
        parts.append(f"wall {wall_s // 3600}:{wall_s % 3600 // 60:02d}:{wall_s % 60:02d}")
    return " · ".join(parts)


def _step_axis(axes: Axes) -> None:
    axes.set_xlabel(TRAINER_STEP)
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))


def _not_logged(axes: Axes, title: str, keys: Sequence[str]) -> None:
    axes.set_title(title)
    axes.text(0.5, 0.5, "not logged\n" + "\n".join(keys), ha="center", va="center",
              transform=axes.transAxes, color="grey", fontsize=11)
    axes.set_xticks([])
    axes.set_yticks([])


def _moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last `window` entries, ignoring NaN (NaN where all are NaN)."""
    finite = np.isfinite(values)
    sums = np.cumsum(np.where(finite, values, 0.0))
    counts = np.cumsum(finite)
    sums[window:] = sums[window:] - sums[:-window]
    counts[window:] = counts[window:] - counts[:-window]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _mark_non_finite(axes: Axes, run: _Run, keys: Sequence[str]) -> None:
    """Red × on the x-axis at steps where any of `keys` was non-finite (a line would just have a gap)."""
    steps = np.unique(np.concatenate([run.null_steps(key) for key in keys]))
    if steps.size:
        axes.plot(steps, np.zeros_like(steps), transform=axes.get_xaxis_transform(), linestyle="none",
                  marker="x", markersize=8, color="red", clip_on=False, label="non-finite (null)")


def _use_log_scale_if_positive(axes: Axes, values: np.ndarray) -> None:
    finite = values[np.isfinite(values)]
    if finite.size and (finite > 0).all():
        axes.set_yscale("log")


def _lines(axes: Axes, run: _Run, keys: Sequence[str], title: str, **style: Any) -> bool:
    """Plot each logged key as a line; 'not logged' when none is. Returns whether anything was drawn."""
    if not run.has(*keys):
        _not_logged(axes, title, keys)
        return False
    for key in keys:
        if run.has(key):
            axes.plot(run.steps, run.column(key), label=key, marker=run.marker, **style)
    _mark_non_finite(axes, run, keys)
    axes.set_title(title)
    _step_axis(axes)
    if len(axes.get_lines()) > 1:
        axes.legend(loc="best", fontsize=9)
    return True


# ---------------------------------------------------------------------------------------------
# Panels: each takes its axes and the run, and copes with its metrics being absent.


def _mean_interval(run: _Run, mean: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Each step's 95% interval of its mean reward (mean ± 1.96 · std/√(n − 1), n its trajectories),
    inside the step's own reward range: ± one std runs below 0 and above 1 for a 0/1 reward."""
    if not run.has(REWARD_STD, TRAIN_TRAJECTORIES):
        return None
    count = np.maximum(run.column(TRAIN_TRAJECTORIES) - 1.0, 1.0)
    half = 1.96 * run.column(REWARD_STD) / np.sqrt(count)
    low, high = mean - half, mean + half
    if run.has(REWARD_MIN, REWARD_MAX):
        low, high = np.maximum(low, run.column(REWARD_MIN)), np.minimum(high, run.column(REWARD_MAX))
    return low, high


def _eval_sets(run: _Run) -> list[str]:
    """The names of the eval sets (trainer.eval_sets) the run logged, in order of appearance."""
    found: dict[str, None] = {}
    for record in run.records:
        for key in record:
            parts = key.split("/")
            if len(parts) == 3 and parts[0] == "eval" and parts[2] == "success":
                found[parts[1]] = None
    return list(found)


def _reward(axes: Axes, run: _Run) -> None:
    title = "reward"
    if not run.has(REWARD_MEAN):
        _not_logged(axes, title, [REWARD_MEAN])
        return
    mean = run.column(REWARD_MEAN)
    window = max(1, min(50, len(mean) // 10))  # no moving average under 20 steps: draw the raw line bold
    axes.plot(run.steps, mean, color="tab:blue", alpha=0.45 if window > 1 else 1.0,
              linewidth=1 if window > 1 else 2, marker=run.marker, label=REWARD_MEAN)
    band = _mean_interval(run, mean)
    if band is not None:
        axes.fill_between(run.steps, *band, color="tab:blue", alpha=0.12, label="95% interval of the mean")
    if window > 1:
        axes.plot(run.steps, _moving_average(mean, window), color="tab:blue", linewidth=2.2,
                  label=f"moving average ({window} steps)")
    _mark_non_finite(axes, run, [REWARD_MEAN])
    if run.has(EVAL_SUCCESS):  # held-out success at the evaluated versions, with its 95% interval
        success, low, high = (run.column(key) for key in (EVAL_SUCCESS, EVAL_SUCCESS_LOW, EVAL_SUCCESS_HIGH))
        at = np.isfinite(success)
        axes.errorbar(run.steps[at], success[at], yerr=[success[at] - low[at], high[at] - success[at]],
                      color="tab:green", marker="s", capsize=4, linewidth=1.5, label="held-out success (95%)")
        title = "reward and held-out success"
    colors = ("tab:purple", "tab:brown", "tab:olive", "tab:cyan")
    for color, name in zip(colors, _eval_sets(run), strict=False):
        keys = [eval_set_metric(name, key) for key in (EVAL_SUCCESS, EVAL_SUCCESS_LOW, EVAL_SUCCESS_HIGH)]
        success, low, high = (run.column(key) for key in keys)
        at = np.isfinite(success)
        axes.errorbar(run.steps[at], success[at], yerr=[success[at] - low[at], high[at] - success[at]],
                      color=color, marker="D", capsize=4, linewidth=1.5, label=f"{name} success (95%)")
        title = "reward and evaluated success"
    axes.set_title(title)
    _step_axis(axes)
    axes.legend(loc="best", fontsize=9)


def _ess(axes: Axes, run: _Run) -> None:
    title = "ESS ratio and lr scale"
    keys = [IS_ESS_RATIO, IS_ESS_RATIO_CLIPPED]
    if not run.has(*keys, LR_SCALE):
        _not_logged(axes, title, [*keys, LR_SCALE])
        return
    handles = []
    for key, color in zip(keys, ("tab:green", "tab:olive"), strict=True):
        if run.has(key):
            handles += axes.plot(run.steps, run.column(key), color=color, marker=run.marker, label=key)
    axes.set_ylim(0, 1.05)
    axes.set_ylabel("ESS / B")
    if run.has(LR_SCALE):
        twin = axes.twinx()
        handles += twin.plot(run.steps, run.column(LR_SCALE), color="tab:red", linestyle="--",
                             marker=run.marker, label=LR_SCALE)
        twin.set_ylabel(LR_SCALE, color="tab:red")
        twin.tick_params(axis="y", colors="tab:red")
        twin.set_ylim(bottom=0)
    axes.set_title(title)
    _step_axis(axes)
    axes.legend(handles=handles, loc="lower left", fontsize=9)


def _staleness_hist(axes: Axes, run: _Run) -> None:
    title = "staleness histogram (all steps)"
    hists = [r.get(STALENESS_HIST) for r in run.records if isinstance(r.get(STALENESS_HIST), list)]
    if not hists:
        _not_logged(axes, title, [STALENESS_HIST])
        return
    num_bins = max(len(hist) for hist in hists)
    totals = np.zeros(num_bins)
    for hist in hists:
        totals[: len(hist)] += [count or 0 for count in hist]
    labels = [staleness_bin_label(index, num_bins) for index in range(num_bins)]
    bars = axes.bar(labels, totals, color="tab:purple")
    total = totals.sum()
    if total > 0:
        axes.bar_label(bars, labels=[f"{100 * t / total:.0f}%" if t else "" for t in totals], fontsize=9)
    axes.set_title(f"{title}: {int(total)} trajectories")
    axes.set_xlabel("policy lag (versions)")
    axes.set_ylabel("trajectories")
    axes.margins(y=0.12)


def _staleness_lag(axes: Axes, run: _Run) -> None:
    """The realised lag, and the bound in force (rollout/max_lag) as a staircase with the moves of
    `rollout.max_lag: auto` marked: ▲ raised, ▼ lowered."""
    title = "policy lag per step (versions)"
    if not _lines(axes, run, [STALENESS_MEAN, STALENESS_MAX], title):
        return
    if not run.has(ROLLOUT_MAX_LAG):
        return
    bound = run.column(ROLLOUT_MAX_LAG)
    axes.step(run.steps, bound, where="post", color="black", linewidth=1.4,
              label=f"{ROLLOUT_MAX_LAG} (bound)")
    if run.has(ROLLOUT_LAG_MOVE):
        moves = run.column(ROLLOUT_LAG_MOVE)
        marks = ((1, "^", "tab:green", "bound raised"), (-1, "v", "tab:red", "bound lowered"))
        for sign, marker, color, label in marks:
            at = moves == sign
            if at.any():
                axes.plot(run.steps[at], bound[at], linestyle="none", marker=marker, markersize=8,
                          color=color, label=label)
        raises = int(np.nanmax(run.column(ROLLOUT_LAG_RAISES))) if run.has(ROLLOUT_LAG_RAISES) else 0
        lowers = int(np.nanmax(run.column(ROLLOUT_LAG_LOWERS))) if run.has(ROLLOUT_LAG_LOWERS) else 0
        axes.set_title(f"{title}; bound auto: {raises} raised, {lowers} lowered")
    axes.set_ylim(bottom=0)
    axes.legend(loc="best", fontsize=9)


def _grad_norm(axes: Axes, run: _Run) -> None:
    if _lines(axes, run, [GRAD_NORM], "gradient norm (pre-clip)", color="tab:brown"):
        _use_log_scale_if_positive(axes, run.column(GRAD_NORM))


def _kl(axes: Axes, run: _Run) -> None:
    if _lines(axes, run, [IS_KL_K3], "KL(μ‖π_old), K3 estimate (is/kl_k3)", color="tab:cyan"):
        _use_log_scale_if_positive(axes, run.column(IS_KL_K3))


def _tool_use(axes: Axes, run: _Run) -> None:
    _lines(axes, run, [ROLLOUT_TURNS_MEAN, ROLLOUT_TOOL_CALLS_MEAN, ROLLOUT_TOOL_ERRORS_MEAN],
           "per trajectory: turns, tool calls, tool errors")


def _time_split(axes: Axes, run: _Run) -> None:
    """Learner wall time per step stacked (train + weight sync + idle); generation drawn as a line,
    because it runs beside the learner (async) or is the learner's idle time (sync): stacking it
    would count that time twice. time/step, when logged, is drawn over the stack's top."""
    title = "time per step (s)"
    stacked = [TIME_TRAIN, TIME_WEIGHT_SYNC, TIME_IDLE_LEARNER]
    if not run.has(*stacked, TIME_GENERATE):
        _not_logged(axes, title, [*stacked, TIME_GENERATE])
        return
    present = [key for key in stacked if run.has(key)]
    top = 0.0
    if present:
        values = [np.nan_to_num(run.column(key), nan=0.0) for key in present]
        axes.stackplot(run.steps, values, labels=present, alpha=0.75,
                       colors=["tab:blue", "tab:orange", "lightgrey"][: len(present)])
        top = float(np.sum(values, axis=0).max())
    if run.has(TIME_GENERATE):
        generate = run.column(TIME_GENERATE)
        axes.plot(run.steps, generate, color="black", linestyle="--", linewidth=1.2, marker=run.marker,
                  label=f"{TIME_GENERATE} (rollout side)")
        top = max(top, float(np.nanmax(generate)))
    if run.has(TIME_STEP):
        step_s = run.column(TIME_STEP)
        axes.plot(run.steps, step_s, color="tab:red", linewidth=1.2, marker=run.marker,
                  label=f"{TIME_STEP} (wall)")
        top = max(top, float(np.nanmax(step_s)))
    axes.set_title(title + ": learner stacked, generation and step as lines")
    _step_axis(axes)
    axes.set_ylim(0, top * 1.45 if top > 0 else 1.0)  # headroom for the legend above the data
    axes.legend(loc="upper left", fontsize=9, ncol=2)


def _throughput(axes: Axes, run: _Run) -> None:
    if _lines(axes, run, [PERF_TOKENS_PER_S], "throughput (perf/tokens_per_s)", color="tab:gray"):
        axes.set_ylim(bottom=0)


COMPARE_PANELS = ((REWARD_MEAN, "training reward (batch mean, 3-step mean)"), (IS_ESS_RATIO, "ESS ratio"),
                  (LR_SCALE, "lr scale"), (GRAD_NORM, "grad norm (before clipping)"))


def plot_compare(run_dirs: Sequence[Path], out: Path) -> Path:
    """Overlay several runs (e.g. one method at two lags): reward, ESS ratio, lr scale, grad norm vs
    step, one line per run labelled by its directory name. Raises MetricsFileError for a run
    without metrics."""
    figure = Figure(figsize=(14, 9), dpi=100, layout="constrained")
    grid = figure.subplots(2, 2)
    for run_dir in map(Path, run_dirs):
        records = [r for r in read_metrics(run_dir) if isinstance(r.get(TRAINER_STEP), (int, float))]
        if not records:
            raise MetricsFileError(no_metrics_message(run_dir))
        run = _Run(sorted(records, key=lambda record: record[TRAINER_STEP]))
        for axes, (key, title) in zip(grid.flat, COMPARE_PANELS, strict=True):
            values = run.column(key)
            if key == REWARD_MEAN:
                values = _moving_average(values, 3)
            axes.plot(run.steps, values, marker=run.marker, label=run_dir.name)
            axes.set_title(title)
    for axes, (key, _) in zip(grid.flat, COMPARE_PANELS, strict=True):
        _step_axis(axes)
        axes.grid(True, alpha=0.3)
        axes.legend(loc="best", fontsize=8)
        if key in (IS_ESS_RATIO, LR_SCALE):  # ratios in [0, 1]: no offset axis for 1 − 1e-7 noise
            axes.set_ylim(0, 1.05)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png")
    return out
