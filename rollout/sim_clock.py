"""A simulated clock for the rollout pipeline (`rollout.simulated_clock`): when things happen, not what.

Asynchrony buys time: the learner stops waiting for the slowest episodes of each batch. Two CPU cores
running engine and learner side by side cannot show that (they share the cores, so overlap buys
nothing), so a benchmark can run the real learning on a simulated timeline instead: every episode
takes a generation time drawn from a long-tailed distribution (lognormal, fitted to real multi-turn
episode lengths), every learner step a fixed time, and an engine of `concurrent_groups` slots generates
groups side by side. This module is that timeline — a discrete-event simulation of the rollout
manager's own rules — and the manager follows it (rollout/manager.py): group g is generated with the
policy version the simulation admitted it under, so the lags the learner sees are the ones that timing
would produce, and each step's simulated start, end and waiting are known.

The rules simulated, in the manager's terms (b = batch slot, v = policy version, k = the bound in force):

* groups are admitted in index order, group g into batch slot b = g // groups_per_batch, when an engine
  slot is free and b − k ≤ v (the lag bound), not past `total_batches`;
* a group takes the longest of its episodes' times (its episodes generate side by side), drawn once per
  group from the seeded generator, so a rerun with the same bounds is the same timeline;
* learner step b starts when batch b is complete and step b − 1 has ended, lasts `learner_s`, and
  publishes version b + 1 when it ends; admissions from then on use version b + 1 and the bound the
  trainer set after step b (with `max_lag: auto`, the controller's move);
* the learner's waiting before step b, idle_b = start_b − end_{b−1}, and u_b = idle_b / (idle_b +
  learner_s), the share the lag controller acts on.

Version v's interval [end_{v−1}, end_v) is simulated when v is opened (`open_version`), with the bound in
force for it. The timeline is replayable from the bounds alone (`state` / `restore`), which is how a
resumed run gets it back.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

SIM_TIME = "sim/time"
"""Simulated seconds at the end of the step (its version published)."""
SIM_STEP_S = "sim/step_s"
"""Simulated seconds from the previous step's end to this one's."""
SIM_IDLE_LEARNER_S = "sim/idle_learner_s"
"""Simulated seconds the learner waited for this step's batch."""
SIM_IDLE_FRACTION = "sim/learner_idle_fraction"
"""The share of the step the learner waited, idle / (idle + learner_s): what `max_lag: auto` acts on."""


@dataclass(frozen=True)
class ClockSettings:
    """episode_median_s, episode_sigma: the lognormal of one episode's generation time (its median and
    the standard deviation of its log). max_episode_s: where a draw is cut (the episode's token budget);
    None = never. learner_s: one learner step, weight sync included. concurrent_groups: the simulated
    engine's capacity, in groups generating at once. seed: the draws' generator."""

    episode_median_s: float
    episode_sigma: float
    learner_s: float
    concurrent_groups: int
    max_episode_s: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        problems = []
        if not self.episode_median_s > 0:
            problems.append(f"episode_median_s={self.episode_median_s} must be > 0")
        if not self.episode_sigma >= 0:
            problems.append(f"episode_sigma={self.episode_sigma} must be ≥ 0")
        if not self.learner_s >= 0:
            problems.append(f"learner_s={self.learner_s} must be ≥ 0")
        if self.concurrent_groups < 1:
            problems.append(f"concurrent_groups={self.concurrent_groups} must be ≥ 1")
        if self.max_episode_s is not None and not self.max_episode_s >= self.episode_median_s:
            problems.append(f"max_episode_s={self.max_episode_s} must be ≥ episode_median_s")
        if problems:
            raise ValueError("invalid simulated clock: " + "; ".join(problems))


class StepTiming(NamedTuple):
    """Learner step b on the simulated timeline: start, end (= version b + 1 published), the learner's
    waiting before it (idle) and its share of the step (idle_fraction, as rollout/lag_control.py's u)."""

    start: float
    end: float
    idle: float
    idle_fraction: float


class SimulatedClock:
    """The timeline of one run; `open_version(v, bound)` for v = 0, 1, 2, … in order."""

    def __init__(self, settings: ClockSettings, *, groups_per_batch: int, group_size: int,
                 total_batches: int | None) -> None:
        if groups_per_batch < 1 or group_size < 1:
            raise ValueError(f"groups_per_batch={groups_per_batch} and group_size={group_size} must be ≥ 1")
        self.settings = settings
        self.groups_per_batch = groups_per_batch
        self.group_size = group_size
        self.total_batches = total_batches
        self._reset()

    def _reset(self) -> None:
        self._rng = random.Random(self.settings.seed)
        self._bounds: list[int] = []
        self._admitted: list[int] = []
        """_admitted[g]: the version group g was admitted under."""
        self._admitted_at: list[float] = []
        self._finish: list[float] = []
        self._done: list[bool] = []
        self._running: list[tuple[float, int]] = []  # (finish time, group), a heap
        self._steps: list[StepTiming] = []
        self._version_start = 0.0  # end of the last step: the open version's interval begins here

    # --- driving it ------------------------------------------------------------------------------

    @property
    def opened(self) -> int:
        """Versions opened so far (the next `open_version` must be this one)."""
        return len(self._bounds)

    def open_version(self, version: int, bound: int) -> None:
        """Simulate version `version`'s interval under lag bound `bound`: the admissions it makes and, unless
        the run ends first, the end of learner step `version` (which publishes version + 1)."""
        if version != self.opened:
            raise ValueError(f"version {version} opened out of order (expected {self.opened})")
        if bound < 0:
            raise ValueError(f"bound={bound} must be ≥ 0")
        self._bounds.append(bound)
        now = self._version_start
        batch = version
        if self.total_batches is not None and batch >= self.total_batches:
            return  # no step consumes more: nothing to admit or time
        # admit at `now`, then let finishes happen one at a time until batch `version` is complete
        self._admit(now, version, bound)
        while not self._batch_done(batch):
            if not self._running:  # cannot happen with k ≥ 0 and a slot free: a broken invariant, not data
                raise RuntimeError(f"simulated clock: batch {batch} cannot complete (nothing generating)")
            now = self._finish_next()
            self._admit(now, version, bound)
        ready = max(self._finish[g] for g in self._batch_groups(batch))
        start = max(self._version_start, ready)
        end = start + self.settings.learner_s
        idle = start - self._version_start
        total = idle + self.settings.learner_s
        self._steps.append(StepTiming(start, end, idle, idle / total if total > 0 else 0.0))
        # the rest of the interval: slots freed before the step ends admit groups under this version
        while self._running and self._running[0][0] < end:
            now = self._finish_next()
            self._admit(now, version, bound)
        self._version_start = end

    def admission_version(self, group: int) -> int | None:
        """The version group `group` is admitted under, or None when no opened version admits it (yet)."""
        return self._admitted[group] if group < len(self._admitted) else None

    def step(self, batch: int) -> StepTiming:
        """Learner step `batch`'s timing (known once version `batch` is opened)."""
        return self._steps[batch]

    def metrics(self, batch: int) -> dict[str, float]:
        """Learner step `batch`'s `sim/*` metrics."""
        timing = self._steps[batch]
        previous = self._steps[batch - 1].end if batch > 0 else 0.0
        return {SIM_TIME: timing.end, SIM_STEP_S: timing.end - previous, SIM_IDLE_LEARNER_S: timing.idle,
                SIM_IDLE_FRACTION: timing.idle_fraction}

    @property
    def steps(self) -> Sequence[StepTiming]:
        return tuple(self._steps)

    def group_times(self, group: int) -> tuple[float, float]:
        """(admitted, finished) of an admitted group, in simulated seconds."""
        return self._admitted_at[group], self._finish[group]

    # --- resume ----------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the bound of every opened version (the draws replay from the seed)."""
        return {"bounds": list(self._bounds)}

    def restore(self, state: dict[str, Any]) -> None:
        """Replay the timeline of `state()`'s bounds: the same admissions, finishes and step times."""
        self._reset()
        for version, bound in enumerate(state.get("bounds", [])):
            self.open_version(version, int(bound))

    # --- the simulation --------------------------------------------------------------------------

    def _batch_groups(self, batch: int) -> range:
        return range(batch * self.groups_per_batch, (batch + 1) * self.groups_per_batch)

    def _batch_done(self, batch: int) -> bool:
        groups = self._batch_groups(batch)
        return groups[-1] < len(self._done) and all(self._done[g] for g in groups)

    def _finish_next(self) -> float:
        """Pop the earliest finish; its time is the simulation's new now."""
        finish, group = heapq.heappop(self._running)
        self._done[group] = True
        return finish

    def _admit(self, now: float, version: int, bound: int) -> None:
        while len(self._running) < self.settings.concurrent_groups:
            group = len(self._admitted)
            batch = group // self.groups_per_batch
            if self.total_batches is not None and batch >= self.total_batches:
                return
            if batch - bound > version:  # the lag bound: b − v ≤ k
                return
            finish = now + self._group_duration()
            self._admitted.append(version)
            self._admitted_at.append(now)
            self._finish.append(finish)
            self._done.append(False)
            heapq.heappush(self._running, (finish, group))

    def _group_duration(self) -> float:
        settings = self.settings
        mu = math.log(settings.episode_median_s)
        draws = [math.exp(self._rng.gauss(mu, settings.episode_sigma)) for _ in range(self.group_size)]
        longest = max(draws)
        return min(longest, settings.max_episode_s) if settings.max_episode_s is not None else longest


def fit_lognormal(values: Sequence[float]) -> tuple[float, float]:
    """(median, sigma) of the lognormal fitted to positive `values` by maximum likelihood (the mean and
    standard deviation of their logs)."""
    logs = [math.log(v) for v in values if v > 0]
    if len(logs) < 2:
        raise ValueError(f"fitting a lognormal needs ≥ 2 positive values, got {len(logs)}")
    mean = sum(logs) / len(logs)
    variance = sum((x - mean) ** 2 for x in logs) / len(logs)
    return math.exp(mean), math.sqrt(variance)
