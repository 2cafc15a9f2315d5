"""The adaptive lag bound (`rollout.max_lag: auto`): the admission bound k follows the measured ESS.

Every fixed bound is a guess: too small and the learner waits for data, too large and the importance
weights of stale batches degenerate (the ESS ratio ρ = ESS/B falls, and with it VCPO's step size). The
learner measures ρ of every batch exactly; this controller acts on it where the lag is decided.

Control law (docs/algorithm.md, "The adaptive lag bound"), at the end of learner step b, with ρ_b the
ESS ratio of batch b, u_b the share of the step the learner spent waiting for the batch
(idle / (idle + train)) and k the bound in force:

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

    def update(self, ess_ratio: float, idle_fraction: float, admitted_under: Iterable[int | None]) -> LagMove:
        """One step: `ess_ratio` ρ_b and `idle_fraction` u_b of batch b, `admitted_under` the bound each of
        its groups was admitted under (None: unknown, e.g. a group from a checkpoint that predates it)."""
        settings = self.settings
        if any(bound != self.bound for bound in admitted_under):
            return LagMove(self.bound, 0, False)  # rule 1: a measurement of another bound
        if not math.isfinite(ess_ratio):  # no valid trajectory measured: no evidence either way
            return LagMove(self.bound, 0, False)
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
                ROLLOUT_LAG_JUDGED: float(move.judged), ROLLOUT_IDLE_FRACTION: idle_fraction}

    def state(self) -> dict[str, int]:
        """What a checkpoint keeps: the bound in force, the streak and the move counts."""
        return {"bound": self.bound, "streak": self.streak, "raises": self.raises, "lowers": self.lowers}

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from `state()`; a bound outside this run's [min_lag, max_lag] (the range was changed
        for the resume) is clamped into it."""
        settings = self.settings
        self.bound = min(settings.max_lag, max(settings.min_lag, int(state["bound"])))
        self.streak = int(state.get("streak", 0))
        self.raises = int(state.get("raises", 0))
        self.lowers = int(state.get("lowers", 0))


def idle_fraction(idle_s: float, train_s: float) -> float:
    """u = idle / (idle + train), the share of a learner step spent waiting for the batch; 0 for 0/0."""
    total = idle_s + train_s
    return idle_s / total if total > 0 else 0.0
