"""A step's time depends on its data: a VCPO step whose groups are all degenerate (every episode scored the
same) skips the gradient pass and takes a fraction of one with informative groups. Two runs
(two commits, two lag bounds) draw different mixes of such steps, so their mean steps are compared on a
common mix: each run's mean per kind of step (its count of degenerate groups), averaged over one mix."""

from __future__ import annotations

import statistics


def mean_by_kind(step_s: list[float], degenerate: list[float]) -> dict[int, float]:
    """Mean step time per number of degenerate groups in the step."""
    kinds: dict[int, list[float]] = {}
    for seconds, count in zip(step_s, degenerate, strict=True):
        kinds.setdefault(int(count), []).append(seconds)
    return {count: statistics.fmean(values) for count, values in sorted(kinds.items())}


def mix_adjusted_mean(by_kind: dict[int, float], mix: list[float]) -> float | None:
    """The mean step `by_kind`'s times give over the steps of `mix` (their degenerate-group counts): what
    one side's steps would average on the other side's data. None if a kind of `mix` was never timed."""
    if any(int(count) not in by_kind for count in mix):
        return None
    return statistics.fmean(by_kind[int(count)] for count in mix)
