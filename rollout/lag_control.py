"""The adaptive lag bound (`rollout.max_lag: auto`): the admission bound k follows the measured ESS.

Every fixed bound is a guess: too small and the learner waits for data, too large and the importance
weights of stale batches degenerate (the ESS ratio ρ = ESS/B falls, and with it VCPO's step size). The
learner measures ρ of every batch exactly; this controller acts on it where the lag is decided.

Control law (docs/algorithm.md, "The adaptive lag bound"), at the end of learner step b, with ρ_b the
ESS ratio of batch b, u_b the share of the step the learner spent waiting for the batch
(idle / (idle + train)) and k the bound in force:

0. **Judge staleness, not the engine.** ρ_b mixes two sources: lag, which k controls, and the engine's
   numerics against the learner's (a bf16 engine's rounding: ρ < 1 even at lag 0), which no k changes. The
   batches' lag-0 trajectories measure the latter (`is/mismatch/ess_ratio`); the controller keeps the mean of
   the last `mismatch_window` such measurements as the mismatch floor ρ_m and judges ρ_b / ρ_m (at most 1;
   ρ_b itself until a lag-0 trajectory has been seen, or with `judge: total`). An fp32 engine's ρ_m is ~1
   and nothing changes; a bf16 engine's would otherwise pull k down to k_min for nothing.
1. **Judge only what k produced.** Batch b is judged only when every one of its groups was admitted under
   k (the groups carry the bound they were admitted under) and ρ_b is finite. A batch admitted under an
   older bound says nothing about k, so the controller holds — this is the pipeline's delay: after a move,
   the k batches already admitted are not judged.
2. **Lower at once:** ρ_b < τ (`target_ess_ratio`) → k ← max(k_min, k − 1), and the streak restarts.
3. **Raise slowly:** ρ_b ≥ τ and u_b ≥ u_min (`min_idle_fraction`: the learner waited for data) extends a
   streak; `patience` judged batches in a row → k ← min(k_max, k + 1), and the streak restarts.
4. **Hold** when ρ_b ≥ τ but the learner did not wait: a larger bound would add staleness and no
   throughput (the streak restarts).

Fast decrease and slow increase (as additive-increase/decrease congestion control with a probe delay): the
bound settles on the largest k whose batches keep ρ ≥ τ while the learner is starved, and steps back
as soon as a batch admitted under it falls below τ. The lag guarantee is per group: a group admitted under
bound k lags at most k, and k ≤ k_max always (rollout/manager.py).

Pure: no clock, no asyncio, no config objects; the trainer feeds it and applies its bound to the manager,
and its `state` goes into every checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

ROLLOUT_MAX_LAG = "rollout/max_lag"
"""The lag bound in force after the step (a fixed bound: k every step)."""
ROLLOUT_LAG_MOVE = "rollout/lag_move"
"""auto: this step's move of the bound, −1, 0 or +1."""
ROLLOUT_LAG_RAISES = "rollout/lag_raises"
"""auto: moves up so far (a running total, kept across a resume)."""
ROLLOUT_LAG_LOWERS = "rollout/lag_lowers"
"""auto: moves down so far (a running total, kept across a resume)."""
ROLLOUT_LAG_JUDGED = "rollout/lag_judged"
"""auto: 1 when this step's batch was judged (all its groups admitted under the bound in force), else 0."""
ROLLOUT_IDLE_FRACTION = "rollout/learner_idle_fraction"
"""auto: the share of the step the learner waited for its batch, u = idle / (idle + train)."""
ROLLOUT_LAG_JUDGED_ESS = "rollout/lag_judged_ess_ratio"
"""auto: the ESS ratio the controller compared with τ (ρ_b / ρ_m, or ρ_b; rule 0)."""
ROLLOUT_LAG_MISMATCH_ESS = "rollout/lag_mismatch_ess_ratio"
"""auto: the mismatch floor ρ_m in force (NaN before any lag-0 trajectory)."""


@dataclass(frozen=True)
class LagControlSettings:
    """min_lag, max_lag: the range [k_min, k_max] of the bound. initial_lag: k at the start (None = k_min).
    target_ess_ratio: τ. patience: judged batches in a row that must support a raise. min_idle_fraction:
    u_min, the least waiting that counts as 'the learner waits for data'."""

    min_lag: int = 0
    max_lag: int = 8
    target_ess_ratio: float = 0.5
    patience: int = 3
    min_idle_fraction: float = 0.05
    initial_lag: int | None = None
    judge: str = "staleness"
    """'staleness': ρ_b over the mismatch floor (rule 0); 'total': ρ_b as measured."""
    mismatch_window: int = 8
    """Lag-0 measurements the mismatch floor averages."""

    def __post_init__(self) -> None:
        problems = []
        if not 0 <= self.min_lag <= self.max_lag:
            problems.append(f"min_lag={self.min_lag} and max_lag={self.max_lag} need 0 ≤ min_lag ≤ max_lag")
        if self.initial_lag is not None and not self.min_lag <= self.initial_lag <= self.max_lag:
            problems.append(f"initial_lag={self.initial_lag} must lie in [min_lag, max_lag] = "
                            f"[{self.min_lag}, {self.max_lag}]")
        if not 0.0 < self.target_ess_ratio <= 1.0:
            problems.append(f"target_ess_ratio={self.target_ess_ratio} must be in (0, 1]")
        if self.patience < 1:
            problems.append(f"patience={self.patience} must be ≥ 1")
        if not 0.0 <= self.min_idle_fraction < 1.0:
            problems.append(f"min_idle_fraction={self.min_idle_fraction} must be in [0, 1)")
        if self.judge not in ("staleness", "total"):
            problems.append(f"judge={self.judge!r} must be 'staleness' or 'total'")
        if self.mismatch_window < 1:
            problems.append(f"mismatch_window={self.mismatch_window} must be ≥ 1")
        if problems:
            raise ValueError("invalid lag control: " + "; ".join(problems))


class LagMove(NamedTuple):
    """What one update did. bound: k in force after it. move: −1, 0 or +1. judged: whether the batch was
    judged (rule 1)."""

    bound: int
    move: int
    judged: bool


class LagController:
    """The control law of the module docstring, step by step."""

    def __init__(self, settings: LagControlSettings) -> None:
        self.settings = settings
        self.bound = settings.min_lag if settings.initial_lag is None else settings.initial_lag
        """k, the bound in force."""
        self.streak = 0
        """Judged batches in a row that supported a raise (rule 3)."""
        self.raises = 0
        self.lowers = 0
        self.mismatch: list[float] = []
        """The latest lag-0 ESS ratios (rule 0), oldest first."""
        self.judged_ess = math.nan
        """The ratio the last judged batch was compared with τ by."""

    @property
    def mismatch_floor(self) -> float:
        """ρ_m: the mean of the kept lag-0 measurements (NaN before any)."""
        return sum(self.mismatch) / len(self.mismatch) if self.mismatch else math.nan

    def update(self, ess_ratio: float, idle_fraction: float, admitted_under: Iterable[int | None],
               mismatch_ess: float | None = None) -> LagMove:
        """One step: `ess_ratio` ρ_b and `idle_fraction` u_b of batch b, `admitted_under` the bound each of
        its groups was admitted under (None: unknown, e.g. a group from a checkpoint that predates it),
        `mismatch_ess` the ESS ratio of its lag-0 trajectories (None or NaN: it had none)."""
        settings = self.settings
        if mismatch_ess is not None and math.isfinite(mismatch_ess) and mismatch_ess > 0:
            self.mismatch = [*self.mismatch, float(mismatch_ess)][-settings.mismatch_window:]
        if any(bound != self.bound for bound in admitted_under):
            return LagMove(self.bound, 0, False)  # rule 1: a measurement of another bound
        if not math.isfinite(ess_ratio):  # no valid trajectory measured: no evidence either way
            return LagMove(self.bound, 0, False)
        floor = self.mismatch_floor
        if settings.judge == "staleness" and math.isfinite(floor):  # rule 0
            ess_ratio = min(1.0, ess_ratio / floor)
        self.judged_ess = ess_ratio
        move = 0
        if ess_ratio < settings.target_ess_ratio:  # rule 2
            self.streak = 0
            if self.bound > settings.min_lag:
                move = -1
        elif idle_fraction >= settings.min_idle_fraction:  # rule 3
            self.streak += 1
            if self.streak >= settings.patience and self.bound < settings.max_lag:
                move, self.streak = 1, 0
        else:  # rule 4
            self.streak = 0
        self.bound += move
        self.raises += move > 0
        self.lowers += move < 0
        return LagMove(self.bound, move, True)

    def metrics(self, move: LagMove, idle_fraction: float) -> dict[str, float]:
        """The step's `rollout/*` lag-control metrics."""
        return {ROLLOUT_MAX_LAG: float(move.bound), ROLLOUT_LAG_MOVE: float(move.move),
                ROLLOUT_LAG_RAISES: float(self.raises), ROLLOUT_LAG_LOWERS: float(self.lowers),
                ROLLOUT_LAG_JUDGED: float(move.judged), ROLLOUT_IDLE_FRACTION: idle_fraction,
                ROLLOUT_LAG_JUDGED_ESS: self.judged_ess if move.judged else math.nan,
                ROLLOUT_LAG_MISMATCH_ESS: self.mismatch_floor}

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the bound in force, the streak, the move counts, the mismatch floor's
        measurements."""
        return {"bound": self.bound, "streak": self.streak, "raises": self.raises, "lowers": self.lowers,
                "mismatch": list(self.mismatch)}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()`; a bound outside this run's [min_lag, max_lag] (the range was changed
        for the resume) is clamped into it."""
        settings = self.settings
        self.bound = min(settings.max_lag, max(settings.min_lag, int(state["bound"])))
        self.streak = int(state.get("streak", 0))
        self.raises = int(state.get("raises", 0))
        self.lowers = int(state.get("lowers", 0))
        self.mismatch = [float(v) for v in state.get("mismatch", [])][-settings.mismatch_window:]


def idle_fraction(idle_s: float, train_s: float) -> float:
    """u = idle / (idle + train), the share of a learner step spent waiting for the batch; 0 for 0/0."""
    total = idle_s + train_s
    return idle_s / total if total > 0 else 0.0
