"""`vcpo trend RUN_DIR`: is a run learning? Block statistics and a trend with an honest interval.

Reads `run_dir/trajectories.jsonl` (one line per trained episode, with its `step` and `reward`) and
reports, per block of `block` steps, the mean reward and the share of *successful* episodes (reward ≥
`success`, e.g. 1.0 for Countdown, where a boxed but wrong equation scores the 0.1 format reward); then
what the steps run support, each with a percentile bootstrap interval that resamples whole steps (the
episodes of one step share a policy and prompts: not independent draws):

* the change of the success rate from the first third of the steps to the last third — a difference of
  two rates, so it stays within ±100 points whatever the run's length;
* from `TREND_MIN_STEPS` steps on, the least-squares slope of the per-episode success indicator against
  the step, shown per 100 steps only where the run spans 100 steps (0.09 = +9 points): a slope over ten
  steps extrapolated to a hundred reads as a rise of hundreds of points, which no success rate can make.

With several run directories (seeds of one configuration), `pooled_trend` adds the mean of the runs'
slopes, each run weighing the same, with a stratified bootstrap: every resample draws each run's steps
from that run only and averages the runs' slopes. It answers "did these runs rise on average more than
their step-to-step noise explains", not "would a new seed rise": with a handful of seeds the spread
between seeds cannot be estimated, so the per-run slopes are reported beside the pooled one.

What it does not do: read metrics.jsonl, plot (`vcpo plot` does), or decide anything: an interval that
excludes 0 says the success rate rose over the run more than step-to-step noise explains, nothing more.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from run.observability import metric_names as names

TRAJECTORIES_FILE = "trajectories.jsonl"

TREND_MIN_STEPS = 20
"""Steps before the live line shows a trend at all: a slope over fewer steps, extrapolated to 100, reads as
a rise of hundreds of points (`vcpo trend` reports a shorter run's thirds instead)."""


class TrendError(ValueError):
    """The run directory has no usable trajectory log."""


def read_step_rewards(run_dir: Path) -> dict[int, list[float]]:
    """step → rewards of the episodes trained at that step. A torn last line (a run killed mid-write,
    or one still writing) is dropped; a bad line elsewhere raises naming it."""
    path = Path(run_dir) / TRAJECTORIES_FILE
    if not path.is_file():
        raise TrendError(f"{path} does not exist: `vcpo trend` needs a run trained with "
                         "trainer.save_trajectories=true (the default)")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
    steps: dict[int, list[float]] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line) if line.endswith("\n") else None
            step, reward = int(record["step"]), float(record["reward"])
        except (json.JSONDecodeError, TypeError, KeyError, ValueError):
            if number == len(lines):
                continue
            raise TrendError(f"{path}:{number} is not a trajectory record with 'step' and 'reward' "
                             f"({line[:80]!r}); the file was damaged or edited — remove that line") from None
        steps.setdefault(step, []).append(reward)
    if not steps:
        raise TrendError(f"{path} holds no complete trajectory record yet")
    return steps


def _slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of y on x; 0 when every x is the same."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx


def _hits(steps: dict[int, list[float]], success: float) -> dict[int, list[float]]:
    return {step: [1.0 if r >= success else 0.0 for r in rewards] for step, rewards in steps.items()}


def _change_per_100_steps(hits: dict[int, list[float]], sample: list[int]) -> float:
    return 100.0 * _slope([(step, h) for step in sample for h in hits[step]])


def _interval(boots: list[float]) -> list[float]:
    boots = sorted(boots)
    count = len(boots)
    return [round(boots[int(0.025 * (count - 1))], 4), round(boots[int(0.975 * (count - 1))], 4)]


def _check(block: int, resamples: int) -> None:
    if block < 1 or resamples < 1:
        raise ValueError(f"block and resamples must be ≥ 1 (got block={block}, resamples={resamples})")


def success_trend(steps: dict[int, list[float]], *, success: float = 1.0, resamples: int = 400,
                  seed: int = 0) -> tuple[float, float, float]:
    """(change, low, high): the change of the success rate over 100 steps (0.09 = +9 points) by the
    least-squares trend of the success indicator of
    `steps` (step → episode rewards) and its 95% step-bootstrap interval — what the live line shows
    while a run trains. The same estimate as `reward_trend`'s, from per-step sums with numpy, so that
    it costs milliseconds at every size (its resamples are numpy's, not `reward_trend`'s)."""
    order = sorted(steps)
    x = np.array(order, dtype=np.float64)
    counts = np.array([len(steps[s]) for s in order], dtype=np.float64)
    wins = np.array([sum(1.0 for r in steps[s] if r >= success) for s in order], dtype=np.float64)
    columns = np.stack([counts, counts * x, wins, counts * x * x, x * wins])  # (5, S) sufficient sums

    def slopes(sums: np.ndarray) -> np.ndarray:
        """Least-squares slopes from rows of (n, Σx, Σy, Σx², Σxy)."""
        n, sx, sy, sxx, sxy = sums.T
        denominator = n * sxx - sx * sx
        safe = np.where(denominator > 0, denominator, 1.0)
        return np.where(denominator > 0, (n * sxy - sx * sy) / safe, 0.0)

    point = float(slopes(columns.sum(axis=1)[None, :])[0])
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(order), size=(resamples, len(order)))
    multiplicity = np.zeros((resamples, len(order)))
    np.add.at(multiplicity, (np.arange(resamples)[:, None], draws), 1.0)
    boots = slopes(multiplicity @ columns.T)  # each resample: its steps' sums, with repeats
    low, high = _interval([100.0 * float(b) for b in boots])
    return 100.0 * point, low, high


def _thirds(order: list[int]) -> tuple[list[int], list[int]]:
    """The first and the last third of the steps run (each at least one step)."""
    size = max(1, len(order) // 3)
    return order[:size], order[-size:]


def _rate(hits: dict[int, list[float]], sample: list[int]) -> float:
    values = [h for step in sample for h in hits[step]]
    return sum(values) / len(values)


def reward_trend(run_dir: Path, *, block: int = 10, success: float = 1.0, resamples: int = 2000,
                 seed: int = 0) -> dict[str, Any]:
    """The block table and the success-rate trend of `run_dir` (see the module docstring), JSON-able."""
    _check(block, resamples)
    steps = read_step_rewards(run_dir)
    order = sorted(steps)
    hits = _hits(steps, success)
    blocks = []
    for first in range(0, len(order), block):
        members = order[first: first + block]
        rewards = [r for step in members for r in steps[step]]
        wins = sum(h for step in members for h in hits[step])
        blocks.append({"steps": [members[0], members[-1]], "episodes": len(rewards),
                       "reward_mean": round(sum(rewards) / len(rewards), 4), "successes": int(wins),
                       "success_rate": round(wins / len(rewards), 4)})
    rng = random.Random(seed)
    boots = [_change_per_100_steps(hits, [rng.choice(order) for _ in order]) for _ in range(resamples)]
    first, last = _thirds(order)
    third_boots = [_rate(hits, [rng.choice(last) for _ in last])
                   - _rate(hits, [rng.choice(first) for _ in first]) for _ in range(resamples)]
    return {
        "run_dir": str(run_dir), "steps": len(order), "episodes": sum(len(v) for v in steps.values()),
        "success_threshold": success, "block": block, "blocks": blocks,
        "first_block": blocks[0], "last_block": blocks[-1],
        "first_third_steps": [first[0], first[-1]], "last_third_steps": [last[0], last[-1]],
        "success_change_first_to_last_third": round(_rate(hits, last) - _rate(hits, first), 4),
        "ci95_change_first_to_last_third": _interval(third_boots),
        "span_steps": order[-1] - order[0],
        "too_short_for_trend": len(order) < TREND_MIN_STEPS,
        "success_rate_change_per_100_steps": round(_change_per_100_steps(hits, order), 4),
        "ci95_change_per_100_steps": _interval(boots), "bootstrap_resamples": resamples,
    }


def pooled_trend(run_dirs: Sequence[Path], *, block: int = 10, success: float = 1.0, resamples: int = 2000,
                 seed: int = 0) -> dict[str, Any]:
    """Each run's `reward_trend` and the seed-pooled trend of all of them (module docstring), JSON-able."""
    if len(run_dirs) < 2:
        raise ValueError(f"pooling needs at least two run directories (got {len(run_dirs)})")
    _check(block, resamples)
    runs = [reward_trend(run_dir, block=block, success=success, resamples=resamples, seed=seed)
            for run_dir in run_dirs]
    hits = [_hits(read_step_rewards(run_dir), success) for run_dir in run_dirs]
    orders = [sorted(run_hits) for run_hits in hits]
    rng = random.Random(seed)
    boots = [
        sum(_change_per_100_steps(run_hits, [rng.choice(order) for _ in order])
            for run_hits, order in zip(hits, orders, strict=True)) / len(hits)
        for _ in range(resamples)
    ]
    changes = [run["success_rate_change_per_100_steps"] for run in runs]
    return {
        "runs": runs,
        "pooled": {
            "run_dirs": [str(run_dir) for run_dir in run_dirs], "success_threshold": success,
            "per_run_change_per_100_steps": changes,
            "success_rate_change_per_100_steps": round(sum(changes) / len(changes), 4),
            "ci95_change_per_100_steps": _interval(boots), "bootstrap_resamples": resamples,
            "resampling": "steps within each run; the runs (seeds) are fixed, each weighing the same",
        },
    }


def _points(rate: float) -> str:
    return f"{100 * rate:+.1f}"


def _one_run(result: dict[str, Any]) -> list[str]:
    lines = [f"{result['run_dir']}: {result['steps']} steps, {result['episodes']} episodes "
             f"(success = reward ≥ {result['success_threshold']:g})",
             f"  {'steps':>9}  {'episodes':>8}  {'reward':>6}  {'success':>13}"]
    for block in result["blocks"]:
        first, last = block["steps"]
        lines.append(f"  {first:>4}–{last:<4}  {block['episodes']:>8}  {block['reward_mean']:>6.3f}  "
                     f"{block['successes']:>4} ({100 * block['success_rate']:>5.1f}%)")
    (a, b), (c, d) = result["first_third_steps"], result["last_third_steps"]
    low, high = result["ci95_change_first_to_last_third"]
    change = _points(result["success_change_first_to_last_third"])
    lines.append(f"  success, steps {a}–{b} → {c}–{d}: {change} points "
                 f"(95% interval {_points(low)} to {_points(high)})")
    low, high = result["ci95_change_per_100_steps"]
    if result["too_short_for_trend"]:
        lines.append(f"  trend: {result['steps']} steps are too few for one (it needs {TREND_MIN_STEPS}); "
                     "the thirds above are what the run shows")
    elif result["span_steps"] < 100:
        per_step = result["success_rate_change_per_100_steps"] / 100
        lines.append(f"  trend: {_points(per_step)} points of success per step over the "
                     f"{result['span_steps']} steps run (95% interval {_points(low / 100)} to "
                     f"{_points(high / 100)}); not extrapolated to 100 steps the run did not take")
    else:
        lines.append(f"  trend: {_points(result['success_rate_change_per_100_steps'])} points of success per "
                     f"100 steps (95% interval {_points(low)} to {_points(high)})")
    return lines


def format_trend(result: dict[str, Any]) -> str:
    """`reward_trend`'s or `pooled_trend`'s result as a table for a person (`vcpo trend` without --json)."""
    if "pooled" not in result:
        return "\n".join(_one_run(result))
    lines = [line for run in result["runs"] for line in (*_one_run(run), "")]
    pooled = result["pooled"]
    low, high = pooled["ci95_change_per_100_steps"]
    lines.append(f"pooled over {len(pooled['run_dirs'])} runs: "
                 f"{_points(pooled['success_rate_change_per_100_steps'])} points per 100 steps "
                 f"(95% interval {_points(low)} to {_points(high)}; {pooled['resampling']})")
    return "\n".join(lines)


TREND_EVERY = 5
"""Steps between two updates of the live line's success trend (a bootstrap: a few tenths of a second)."""
WARN_EVERY = 20
"""Fewest steps between two "success is falling" warnings."""


class LearningSignal:
    """The training episodes' success trend so far (`success_trend`: `vcpo trend`'s estimate and
    interval) for the live line and metrics.jsonl, and a warning when success falls by more than noise
    explains. A resumed run starts from its trajectory log up to the checkpoint's step."""

    def __init__(self, run_dir: Path, resume_from_step: int) -> None:
        self.steps: dict[int, list[float]] = {}
        if resume_from_step > 0:
            try:
                self.steps = {s: r for s, r in read_step_rewards(run_dir).items() if s <= resume_from_step}
            except TrendError:
                self.steps = {}
        self._warned_at: int | None = None

    def update(self, step: int, rewards: list[float]) -> dict[str, float]:
        """Record step `step`'s episode rewards; every `TREND_EVERY` steps the trend metrics, else {}."""
        self.steps[step] = list(rewards)
        if len(self.steps) < TREND_MIN_STEPS or step % TREND_EVERY:
            return {}
        change, low, high = success_trend(self.steps, seed=step)
        return {names.TREND_SUCCESS: change, names.TREND_SUCCESS_LOW: low, names.TREND_SUCCESS_HIGH: high}

    def warning(self, step: int, trend: dict[str, float]) -> str | None:
        """A warning line when the trend's whole interval is below 0 (at most every `WARN_EVERY` steps)."""
        if not trend or trend[names.TREND_SUCCESS_HIGH] >= 0:
            return None
        if self._warned_at is not None and step - self._warned_at < WARN_EVERY:
            return None
        self._warned_at = step
        change, low, high = (100 * trend[key] for key in (names.TREND_SUCCESS, names.TREND_SUCCESS_LOW,
                                                           names.TREND_SUCCESS_HIGH))
        return (f"warning: training success is falling at step {step}: {change:+.1f} points per 100 steps "
                f"(95% interval {low:+.1f} to {high:+.1f}); look at is/ess_ratio, grad/norm and lr/scale "
                "in the dashboard (vcpo plot)")
