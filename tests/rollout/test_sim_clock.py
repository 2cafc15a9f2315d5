"""The simulated timeline (rollout/sim_clock.py): hand-computed schedules with constant episode times,
the lag bound and the engine's capacity on random long-tailed ones, replay from the bounds, the fit."""

from __future__ import annotations

import math
import random

import pytest

from rollout.sim_clock import ClockSettings, SimulatedClock, StepTiming, fit_lognormal


def _clock(k: int | list[int], *, median: float = 1.0, sigma: float = 0.0, learner: float = 1.0,
           slots: int = 4, groups: int = 2, size: int = 2, batches: int | None = 6, seed: int = 0
           ) -> SimulatedClock:
    clock = SimulatedClock(ClockSettings(episode_median_s=median, episode_sigma=sigma, learner_s=learner,
                                         concurrent_groups=slots, seed=seed),
                           groups_per_batch=groups, group_size=size, total_batches=batches)
    bounds = k if isinstance(k, list) else [k] * ((batches or 6) + 1)
    for version, bound in enumerate(bounds):
        clock.open_version(version, bound)
    return clock


def _lags(clock: SimulatedClock, batches: int, groups: int = 2) -> list[int]:
    return [g // groups - clock.admission_version(g) for g in range(batches * groups)]  # type: ignore[operator]


def test_synchronous_k0_generates_then_learns_every_step() -> None:
    # every group takes 1 s, the learner 1 s: batch b is generated in [2b, 2b + 1), trained in
    # [2b + 1, 2b + 2)
    clock = _clock(0, median=1.0, learner=1.0)
    assert list(clock.steps) == [StepTiming(2 * b + 1.0, 2 * b + 2.0, 1.0, 0.5) for b in range(6)]
    assert _lags(clock, 6) == [0] * 12


def test_k1_overlaps_generation_with_the_step_before() -> None:
    # 4 slots hold two batches: batches 0 and 1 both start at 0 (version 0); from then on batch b + 1 starts
    # when step b − 1 ends and is ready before step b ends, so the learner never waits after step 0
    clock = _clock(1, median=1.0, learner=1.0)
    assert [round(t.end, 6) for t in clock.steps] == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    assert [t.idle for t in clock.steps] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert _lags(clock, 6) == [0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]


def test_the_engine_capacity_bounds_how_far_ahead_generation_runs() -> None:
    # one slot: groups one after another (1 s each); the learner (0.5 s) is never the bottleneck, so even a
    # bound of 8 gives lags of at most 1 — capacity, not the bound, limits the run
    clock = _clock(8, median=1.0, learner=0.5, slots=1)
    assert [t.end for t in clock.steps] == [2.5, 4.5, 6.5, 8.5, 10.5, 12.5]
    assert max(_lags(clock, 6)) <= 1


def test_total_batches_stops_admission_and_timing() -> None:
    clock = _clock(3, batches=2)
    assert len(clock.steps) == 2
    assert clock.admission_version(4) is None  # group 4 would be batch 2, past the last


@pytest.mark.parametrize("k", [0, 1, 4, 32])
def test_random_long_tailed_times_keep_the_bound_and_the_capacity(k: int) -> None:
    clock = _clock(k, sigma=1.0, slots=5, groups=3, size=4, batches=40, seed=k)
    lags = _lags(clock, 40, groups=3)
    assert min(lags) >= 0 and max(lags) <= k
    # at no moment more than 5 groups generating
    events = sorted([(clock.group_times(g)[0], 1) for g in range(120)]
                    + [(clock.group_times(g)[1], -1) for g in range(120)], key=lambda e: (e[0], e[1]))
    running = 0
    for _, change in events:
        running += change
        assert running <= 5
    # every step starts after its batch is complete and after the step before it
    for b, timing in enumerate(clock.steps):
        assert timing.start >= max(clock.group_times(g)[1] for g in range(3 * b, 3 * b + 3)) - 1e-12
        assert timing.start >= (clock.steps[b - 1].end if b else 0.0) - 1e-12
        assert math.isclose(timing.end - timing.start, 1.0)


def test_a_larger_bound_is_never_slower_on_the_same_draws() -> None:
    ends = [_clock(k, sigma=0.8, slots=6, groups=2, size=4, batches=30, seed=7).steps[-1].end
            for k in (0, 1, 2, 4)]
    assert ends == sorted(ends, reverse=True)
    assert ends[0] > 1.5 * ends[-1]  # the tail of synchronous steps: asynchrony buys time


def test_bounds_can_change_per_version_and_the_timeline_replays_from_them() -> None:
    rng = random.Random(3)
    bounds = [rng.randint(0, 3) for _ in range(21)]
    clock = _clock(bounds, sigma=0.7, slots=4, batches=20, seed=11)
    for g in range(40):  # each group within the bound of the version that admitted it
        version = clock.admission_version(g)
        assert version is not None and g // 2 - version <= bounds[version]
    again = SimulatedClock(clock.settings, groups_per_batch=2, group_size=2, total_batches=20)
    again.restore(clock.state())
    assert again.steps == clock.steps
    assert [again.admission_version(g) for g in range(40)] == [clock.admission_version(g) for g in range(40)]


def test_versions_open_in_order_and_settings_are_checked() -> None:
    clock = _clock([0])
    with pytest.raises(ValueError, match="out of order"):
        clock.open_version(2, 0)
    with pytest.raises(ValueError, match="concurrent_groups=0"):
        ClockSettings(episode_median_s=1.0, episode_sigma=0.5, learner_s=1.0, concurrent_groups=0)
    with pytest.raises(ValueError, match="max_episode_s"):
        ClockSettings(episode_median_s=2.0, episode_sigma=0.5, learner_s=1.0, concurrent_groups=1,
                      max_episode_s=1.0)


def test_the_cut_bounds_every_group_time() -> None:
    clock = SimulatedClock(ClockSettings(episode_median_s=1.0, episode_sigma=2.0, learner_s=0.1,
                                         concurrent_groups=100, max_episode_s=3.0),
                           groups_per_batch=4, group_size=8, total_batches=5)
    for version in range(6):
        clock.open_version(version, 4)
    durations = [end - start for start, end in (clock.group_times(g) for g in range(20))]
    assert max(durations) == 3.0  # σ = 2 over 8 episodes: some group hits the cut


def test_fit_lognormal_recovers_median_and_sigma() -> None:
    rng = random.Random(0)
    values = [math.exp(rng.gauss(math.log(200.0), 0.6)) for _ in range(20000)]
    median, sigma = fit_lognormal(values)
    assert median == pytest.approx(200.0, rel=0.02)
    assert sigma == pytest.approx(0.6, rel=0.02)
    with pytest.raises(ValueError, match="2 positive"):
        fit_lognormal([5.0, 0.0])
