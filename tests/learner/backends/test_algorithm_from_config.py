"""Config → objective mapping: every configurable objective builds and runs; ablations are exact."""

from __future__ import annotations

import typing

import pytest
import torch

from configs.schema import AlgoConfig, Objective
from learner.backends.algorithm_from_config import build_lr_scale_rule, build_objective, objective_params
from vcpo.objectives import PolicyLossInputs
from vcpo.step_size import ConstantLr, EssLr, StalenessLr

# the shipped ones ('custom' imports the user's: tests/examples/test_custom_algorithm.py)
OBJECTIVE_TYPES = sorted(
    kind for member in typing.get_args(typing.get_args(Objective)[0])
    if (kind := member.model_fields["type"].default) != "custom"
)


def _inputs(batch: int = 6, length: int = 5) -> PolicyLossInputs:
    generator = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(batch, length, generator=generator)).requires_grad_(True)
    behavior = logprobs.detach() - 0.1 * torch.rand(batch, length, generator=generator)
    return PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=logprobs.detach(),
        behavior_logprobs=behavior,
        loss_mask=torch.ones(batch, length, dtype=torch.bool),
        rewards=torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0]),
        group_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
        lags=torch.tensor([0, 1, 2, 0, 1, 2]),
        ref_logprobs=logprobs.detach() - 0.05,
        seq_sq_grad_norms=torch.rand(batch, generator=generator) + 0.5,
        sum_probs_squared=torch.full((batch, length), 0.3),
    )


def test_the_schema_offers_every_registry_objective() -> None:
    from vcpo.registry import OBJECTIVES

    assert set(OBJECTIVE_TYPES) == set(OBJECTIVES)


@pytest.mark.parametrize("kind", OBJECTIVE_TYPES)
def test_every_objective_builds_from_config_defaults_and_gives_a_finite_gradient(kind: str) -> None:
    algo = AlgoConfig.model_validate({"objective": {"type": kind}, "ess_lr": {"enabled": False}})
    objective = build_objective(algo)
    inputs = _inputs()
    output = objective(inputs)
    output.loss.backward()
    assert torch.isfinite(output.loss)
    assert torch.isfinite(inputs.logprobs.grad).all() and inputs.logprobs.grad.abs().sum() > 0


def test_dr_grpo_keeps_its_own_aggregation_unless_configured() -> None:
    default = AlgoConfig.model_validate({"objective": {"type": "dr_grpo"}})
    assert build_objective(default).loss_aggregation == "seq-mean-token-sum-norm"
    chosen = AlgoConfig.model_validate({"objective": {"type": "dr_grpo"}, "loss_aggregation": "token-mean"})
    assert build_objective(chosen).loss_aggregation == "token-mean"


def test_vcpo_baseline_options_map_to_flat_parameters_without_learner_only_fields() -> None:
    algo = AlgoConfig.model_validate(
        {"objective": {"type": "vcpo", "opob": {"scope": "minibatch", "aggregation": "weighted_median"}}}
    )
    params = objective_params(algo)
    assert (params["scope"], params["aggregation"]) == ("minibatch", "weighted_median")
    assert "grad_norm_path" not in params and "opob" not in params


def test_step_size_rules_and_vcpo_ablations() -> None:
    vcpo = AlgoConfig()  # VCPO = vcpo objective + ESS lr
    assert vcpo.objective.type == "vcpo" and isinstance(build_lr_scale_rule(vcpo), EssLr)
    ess_only = AlgoConfig.model_validate({"objective": {"type": "seq_tis"}})
    assert isinstance(build_lr_scale_rule(ess_only), EssLr)
    opob_only = AlgoConfig.model_validate({"ess_lr": {"enabled": False}})
    assert isinstance(build_lr_scale_rule(opob_only), ConstantLr)
    stale = AlgoConfig.model_validate(
        {"ess_lr": {"enabled": False}, "staleness_lr": {"enabled": True, "s0": 2}}
    )
    rule = build_lr_scale_rule(stale)
    assert isinstance(rule, StalenessLr) and rule.s0 == 2


def test_every_correction_builds_from_its_config_defaults_into_the_stages_own_defaults() -> None:
    from configs.schema import Correction
    from learner.backends.algorithm_from_config import build_corrections

    members = typing.get_args(typing.get_args(Correction)[0])
    kinds = [kind for member in members if (kind := member.model_fields["type"].default) != "custom"]
    stages = []
    for listed in ([kind for kind in kinds if kind != "seq_tis"], ["seq_tis"]):  # one truncation at a time
        algo = AlgoConfig.model_validate({"objective": {"type": "grpo"},
                                          "corrections": [{"type": kind} for kind in listed]})
        stages += build_corrections(algo)
    assert [type(stage)() for stage in stages] == stages
    assert [stage.label for stage in stages] == [kind for kind in kinds if kind != "seq_tis"] + ["seq_tis"]


@pytest.mark.parametrize("objective", [
    *({"type": kind} for kind in OBJECTIVE_TYPES),
    {"type": "gspo", "ratio_to": "proximal"}, {"type": "cispo", "ratio_to": "proximal"},
    {"type": "otb", "use_is_weights": False},
], ids=lambda o: "-".join(str(v) for v in o.values()))
def test_the_schema_allows_a_truncation_exactly_where_the_objective_takes_token_weights(
    objective: dict,
) -> None:
    from configs.schema import takes_truncation

    algo = AlgoConfig.model_validate({"objective": objective, "ess_lr": {"enabled": False}})
    assert takes_truncation(algo.objective) is build_objective(algo).accepts_token_weights
