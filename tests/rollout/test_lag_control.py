"""The adaptive lag bound's control law (rollout/lag_control.py), step by step by hand."""

from __future__ import annotations

import math

import pytest

from rollout.lag_control import (
    ROLLOUT_LAG_LOWERS,
    ROLLOUT_LAG_MOVE,
    ROLLOUT_LAG_RAISES,
    ROLLOUT_MAX_LAG,
    LagController,
    LagControlSettings,
    LagMove,
    idle_fraction,
)

SETTINGS = LagControlSettings(min_lag=0, max_lag=3, target_ess_ratio=0.6, patience=2, min_idle_fraction=0.1)


def _under(controller: LagController, groups: int = 2) -> list[int]:
    """The batch's groups, all admitted under the bound in force."""
    return [controller.bound] * groups


def test_the_bound_rises_after_patience_judged_batches_above_target_while_the_learner_waits() -> None:
    control = LagController(SETTINGS)
    assert control.bound == 0  # initial_lag None: k_min
    assert control.update(0.9, 0.5, _under(control)) == LagMove(0, 0, True)  # streak 1
    assert control.update(0.8, 0.5, _under(control)) == LagMove(1, 1, True)  # streak 2 = patience: raise
    assert control.streak == 0 and control.raises == 1


def test_batches_admitted_under_another_bound_are_not_judged_and_keep_the_streak() -> None:
    control = LagController(SETTINGS)
    control.update(0.9, 0.5, [0, 0])
    control.update(0.9, 0.5, [0, 0])  # → k = 1
    # the next batches were admitted under k = 0 (before the raise), or partly: held, whatever their ρ
    assert control.update(0.1, 0.9, [0, 0]) == LagMove(1, 0, False)
    assert control.update(0.1, 0.9, [0, 1]) == LagMove(1, 0, False)
    assert control.update(0.1, 0.9, [None, 1]) == LagMove(1, 0, False)  # a group of unknown bound
    assert control.update(0.1, 0.9, [1, 1]) == LagMove(0, -1, True)  # judged: ρ < τ lowers at once


def test_a_batch_without_a_finite_ess_ratio_is_not_judged() -> None:
    control = LagController(SETTINGS)
    control.update(0.9, 0.5, _under(control))  # streak 1
    assert control.update(float("nan"), 0.5, _under(control)) == LagMove(0, 0, False)
    assert control.streak == 1


def test_the_bound_is_lowered_at_once_and_the_streak_restarts() -> None:
    control = LagController(LagControlSettings(min_lag=1, max_lag=5, target_ess_ratio=0.6, patience=2,
                                               initial_lag=3))
    control.update(0.9, 0.5, _under(control))  # streak 1
    assert control.update(0.59, 0.5, _under(control)) == LagMove(2, -1, True)
    assert control.streak == 0 and control.lowers == 1
    control.update(0.2, 0.5, _under(control))  # → 1 = k_min
    assert control.update(0.2, 0.5, _under(control)) == LagMove(1, 0, True)  # at k_min: no move counted
    assert control.lowers == 2


def test_a_learner_that_does_not_wait_holds_the_bound_and_restarts_the_streak() -> None:
    control = LagController(SETTINGS)
    control.update(0.9, 0.5, _under(control))  # streak 1
    assert control.update(0.9, 0.05, _under(control)) == LagMove(0, 0, True)  # u < u_min: hold, streak 0
    assert control.streak == 0
    control.update(0.9, 0.5, _under(control))
    assert control.update(0.9, 0.5, _under(control)).bound == 1  # two more in a row to raise


def test_the_bound_never_leaves_its_range() -> None:
    control = LagController(LagControlSettings(min_lag=0, max_lag=1, target_ess_ratio=0.5, patience=1))
    bounds = [control.update(1.0, 1.0, _under(control)).bound for _ in range(4)]
    assert bounds == [1, 1, 1, 1] and control.raises == 1


def test_a_sequence_by_hand_sawtooths_around_the_largest_bound_that_keeps_the_target() -> None:
    """ρ as a function of the bound that admitted the batch: 0.95, 0.8, 0.65 at k = 0, 1, 2; 0.4 at 3. Each
    batch is admitted under the bound in force, so every batch is judged: k climbs 0 → 3 every 2 batches,
    drops to 2 on the first batch at 3, and probes 3 again after 2 more."""
    rho = {0: 0.95, 1: 0.8, 2: 0.65, 3: 0.4}
    control = LagController(SETTINGS)
    trace = []
    for _ in range(12):
        trace.append(control.update(rho[control.bound], 0.5, _under(control)).bound)
    assert trace == [0, 1, 1, 2, 2, 3, 2, 2, 3, 2, 2, 3]
    assert (control.raises, control.lowers) == (5, 2)


def test_state_round_trips_and_a_restored_bound_is_clamped_into_a_changed_range() -> None:
    control = LagController(SETTINGS)
    for _ in range(3):
        control.update(0.9, 0.5, _under(control))
    resumed = LagController(SETTINGS)
    resumed.restore(control.state())
    assert resumed.state() == control.state() == {"bound": 1, "streak": 1, "raises": 1, "lowers": 0,
                                                      "mismatch": []}
    narrower = LagController(LagControlSettings(min_lag=2, max_lag=4))
    narrower.restore(control.state())
    assert narrower.bound == 2 and narrower.raises == 1


def test_the_metrics_say_the_bound_its_move_and_the_running_counts() -> None:
    control = LagController(LagControlSettings(patience=1, target_ess_ratio=0.5))
    move = control.update(0.9, 0.3, [0])
    metrics = control.metrics(move, 0.3)
    assert metrics[ROLLOUT_MAX_LAG] == 1.0 and metrics[ROLLOUT_LAG_MOVE] == 1.0
    assert metrics[ROLLOUT_LAG_RAISES] == 1.0 and metrics[ROLLOUT_LAG_LOWERS] == 0.0


def test_idle_fraction() -> None:
    assert idle_fraction(1.0, 3.0) == 0.25 and idle_fraction(0.0, 0.0) == 0.0


@pytest.mark.parametrize(("settings", "message"), [
    ({"min_lag": 3, "max_lag": 2}, "min_lag ≤ max_lag"),
    ({"initial_lag": 9}, "initial_lag=9"),
    ({"target_ess_ratio": 0.0}, "target_ess_ratio"),
    ({"patience": 0}, "patience"),
    ({"min_idle_fraction": 1.0}, "min_idle_fraction"),
])
def test_bad_settings_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LagControlSettings(**settings)


def test_the_bound_answers_to_staleness_not_to_the_engines_mismatch() -> None:
    """A bf16 engine: its lag-0 trajectories alone give ESS 0.6. Batches at ρ = 0.45 are 0.75 of that
    floor: judged on staleness they keep k (τ = 0.5); judged in total they pull k down though no k changes the
    0.6."""
    def run(judge: str) -> list[int]:
        settings = LagControlSettings(min_lag=0, max_lag=8, initial_lag=4, target_ess_ratio=0.5, patience=3,
                                      judge=judge)
        controller = LagController(settings)
        bounds = []
        for _ in range(4):
            move = controller.update(0.45, 0.5, [controller.bound], mismatch_ess=0.6)
            bounds.append(move.bound)
        return bounds

    assert run("staleness") == [4, 4, 5, 5]  # judged 0.75 ≥ τ while the learner waits: raised at patience 3
    assert run("total") == [3, 2, 1, 0]  # ρ 0.45 < τ: lowered every judged step


def test_the_mismatch_floor_is_the_mean_of_its_window_and_survives_a_resume() -> None:
    settings = LagControlSettings(min_lag=0, max_lag=4, initial_lag=2, mismatch_window=2)
    controller = LagController(settings)
    assert math.isnan(controller.mismatch_floor)
    controller.update(0.9, 0.0, [2], mismatch_ess=0.5)
    assert controller.judged_ess == pytest.approx(1.0)  # 0.9 / 0.5 capped at 1
    for value in (0.7, 0.9, math.nan, None):  # NaN or None: the batch had no lag-0 trajectory
        controller.update(0.9, 0.0, [controller.bound], mismatch_ess=value)
    assert controller.mismatch_floor == pytest.approx(0.8)  # the last two: 0.7 and 0.9
    metrics = controller.metrics(LagMove(controller.bound, 0, True), 0.0)
    assert metrics["rollout/lag_mismatch_ess_ratio"] == pytest.approx(0.8)
    resumed = LagController(settings)
    resumed.restore(controller.state())
    assert resumed.mismatch_floor == pytest.approx(0.8)
    fresh = LagController(settings)  # no lag-0 trajectory yet: ρ as measured
    fresh.update(0.3, 0.0, [2])
    assert fresh.judged_ess == pytest.approx(0.3)
