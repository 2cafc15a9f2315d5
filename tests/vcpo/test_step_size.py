"""ESS and staleness learning-rate scale rules."""

import math

import pytest
import torch

from tests.vcpo.helpers import tensor
from vcpo.step_size import (
    ConstantLr,
    EssLr,
    StalenessLr,
    StepSizeInputs,
    ess_lr_scale_linear,
    ess_lr_scale_sqrt,
    staleness_lr_scale,
)


@pytest.mark.parametrize(
    ("rho", "rho0", "expected"),
    [
        (0.25, 1.0, 0.5),  # sqrt(0.25 / 1) = 0.5
        (0.25, 0.55, math.sqrt(0.25 / 0.55)),  # sqrt(0.454545) = 0.674200
        (0.04, 1.0, 0.2),  # sqrt(0.04) = 0.2
        (0.6, 0.55, 1.0),  # ρ ≥ ρ0 → min(1, 1.09) = 1
        (1.0, 1.0, 1.0),  # on-policy → 1
    ],
)
def test_sqrt_rule_is_exact(rho, rho0, expected):
    torch.testing.assert_close(ess_lr_scale_sqrt(rho, rho0), tensor(expected))


@pytest.mark.parametrize(
    ("rho", "rho0", "expected"),
    [
        (0.25, 1.0, 0.25),  # min(1, 0.25)
        (0.275, 0.55, 0.5),  # 0.275 / 0.55 = 0.5
        (0.7, 0.55, 1.0),  # ρ ≥ ρ0 → 1
    ],
)
def test_linear_rule_is_exact(rho, rho0, expected):
    torch.testing.assert_close(ess_lr_scale_linear(rho, rho0), tensor(expected))


def test_staleness_rule_halves_the_lr_at_s0():
    # 1 / (1 + S/S0): S = 0 → 1; S = S0 = 4 → 0.5; S = 12 → 1/4
    assert staleness_lr_scale(0.0, 4.0).item() == 1.0
    assert staleness_lr_scale(4.0, 4.0).item() == 0.5
    assert staleness_lr_scale(12.0, 4.0).item() == 0.25


def test_ess_rule_object_uses_the_global_log_weights():
    # w = [1, 1, 1, e^-200≈0] → ESS = 9/3 = 3, ρ = 3/4; sqrt(0.75 / 1) = 0.866025
    inputs = StepSizeInputs(tensor([0.0, 0.0, 0.0, -200.0]), torch.ones(4, dtype=torch.bool))
    result = EssLr(rule="sqrt", base_ess_ratio=1.0)(inputs)
    torch.testing.assert_close(result.scale, tensor(math.sqrt(0.75)))
    torch.testing.assert_close(result.metrics["lr/ess_ratio"], tensor(0.75))
    # linear with ρ0 = 0.5: min(1, 0.75 / 0.5) = 1
    assert EssLr(rule="linear", base_ess_ratio=0.5)(inputs).scale.item() == 1.0


def test_ess_rule_with_clipped_weights_uses_w_bar():
    # w = [16, 1]: ρ = 17²/(256+1)/2 = 0.562257; w̄ = [8, 1]: ρ = 81/65/2 = 0.623077 → linear scales
    inputs = StepSizeInputs(torch.log(tensor([16.0, 1.0])), torch.ones(2, dtype=torch.bool))
    torch.testing.assert_close(EssLr(rule="linear")(inputs).scale, tensor(0.562257))
    torch.testing.assert_close(EssLr(rule="linear", use_clipped_weights=True)(inputs).scale, tensor(0.623077))


def test_staleness_rule_uses_mean_lag_of_valid_trajectories():
    inputs = StepSizeInputs(torch.zeros(3), torch.tensor([True, True, False]), lags=torch.tensor([2, 6, 100]))
    # S = (2 + 6) / 2 = 4, S0 = 4 → 0.5
    assert StalenessLr(s0=4.0)(inputs).scale.item() == 0.5
    with pytest.raises(ValueError, match="lags"):
        StalenessLr()(StepSizeInputs(torch.zeros(2), torch.ones(2, dtype=torch.bool)))


def test_constant_rule_is_one_and_bad_options_are_rejected():
    assert ConstantLr()(StepSizeInputs(torch.zeros(2), torch.ones(2, dtype=torch.bool))).scale.item() == 1.0
    with pytest.raises(ValueError, match="unknown ESS lr rule"):
        EssLr(rule="cubic")
    with pytest.raises(ValueError, match="base_ess_ratio"):
        EssLr(base_ess_ratio=1.5)
