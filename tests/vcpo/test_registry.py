"""One interface for every objective and step-size rule, built by name."""

import math

import pytest
import torch

from tests.vcpo.helpers import random_inputs
from vcpo.objectives import Objective, PolicyLossOutput
from vcpo.registry import LR_SCALE_RULES, OBJECTIVES, make_lr_scale_rule, make_objective
from vcpo.step_size import StepSizeInputs

EXPECTED_OBJECTIVES = {
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce",
    "token_tis",
    "seq_tis",
    "mis",
    "m2po",
    "bapo",
    "gspo",
    "cispo",
    "tba",
    "otb",
    "vcpo",
}


def test_the_registry_lists_every_objective_of_the_spec():
    assert set(OBJECTIVES) == EXPECTED_OBJECTIVES
    assert set(LR_SCALE_RULES) == {"ess", "staleness", "constant"}


@pytest.mark.parametrize("name", sorted(EXPECTED_OBJECTIVES))
def test_every_objective_builds_and_runs_with_a_finite_loss_and_gradient(name):
    inputs, params = random_inputs(seed=1)
    objective = make_objective(name)
    assert isinstance(objective, Objective) and objective.name == name
    out = objective(inputs)
    assert isinstance(out, PolicyLossOutput) and out.loss.dim() == 0
    (grad,) = torch.autograd.grad(out.loss, params)
    assert math.isfinite(out.loss.item()) and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert out.advantages.shape == inputs.loss_mask.shape
    for key in (
        "is/ess_ratio",
        "is/ess_ratio_clipped",
        "is/w_max",
        "is/w_p99",
        "is/log_w_mean",
        "is/kl_k3",
        "pg/clip_frac",
        "pg/masked_frac",
        "staleness/mean",
        "staleness/max",
        "staleness/hist",
    ):
        assert key in out.metrics


def test_objectives_declare_what_they_need():
    assert make_objective("vcpo").needs_grad_norms
    assert make_objective("tba").needs_ref_logprobs
    assert make_objective("otb").needs_sum_probs_squared
    grpo = make_objective("grpo")
    assert not (grpo.needs_grad_norms or grpo.needs_ref_logprobs or grpo.needs_entropy)
    assert make_objective("grpo", kl_coef=0.1).needs_ref_logprobs
    assert make_objective("grpo", entropy_coef=0.1).needs_entropy


def test_missing_required_inputs_are_named():
    inputs, _ = random_inputs()
    import dataclasses

    with pytest.raises(ValueError, match="seq_sq_grad_norms"):
        make_objective("vcpo")(dataclasses.replace(inputs, seq_sq_grad_norms=None))
    with pytest.raises(ValueError, match="ref_logprobs"):
        make_objective("tba")(dataclasses.replace(inputs, ref_logprobs=None))


def test_unknown_names_and_parameters_list_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown objective 'ppo'.*'grpo'"):
        make_objective("ppo")
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['clip_lo'\].*clip_low"):
        make_objective("grpo", clip_lo=0.2)
    with pytest.raises(ValueError, match="unknown lr scale rule"):
        make_lr_scale_rule("cosine")
    with pytest.raises(ValueError, match=r"clip_low=1\.5"):
        make_objective("grpo", clip_low=1.5)
    with pytest.raises(ValueError, match=r"loss_aggregation='mean'.*token-mean"):
        make_objective("vcpo", loss_aggregation="mean")
    with pytest.raises(ValueError, match="aggregation='median'"):
        make_objective("vcpo", aggregation="median")


def test_plain_keyword_construction_of_the_documented_example():
    objective = make_objective("grpo", clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert (objective.clip_low, objective.clip_high, objective.dual_clip) == (0.2, 0.28, 3.0)


def test_vcpo_and_its_ablations_are_compositions():
    inputs, _ = random_inputs(seed=2)
    rules = {"vcpo": ("vcpo", "ess"), "ess_lr_only": ("seq_tis", "ess"), "opob_only": ("vcpo", "constant")}
    for objective_name, rule_name in rules.values():
        out = make_objective(objective_name)(inputs)
        scale = make_lr_scale_rule(rule_name)(
            StepSizeInputs(out.log_is_weights, out.valid, inputs.lags)
        ).scale
        assert 0.0 < scale.item() <= 1.0 and math.isfinite(out.loss.item())
    ess_scale = make_lr_scale_rule("ess", rule="linear", base_ess_ratio=0.55)
    assert ess_scale.rule == "linear"
