"""Config → algorithm objects: the objective, the correction stages and the step-size rule of `AlgoConfig`.

The registry in `vcpo/` takes plain keyword parameters; this is the one place that maps the typed
config onto them, so the schema and the registry cannot drift apart unnoticed (a test builds every
objective type from its config defaults).
"""

from __future__ import annotations

from typing import Any

from configs.schema import AlgoConfig
from vcpo.corrections import (
    GeometricRejection,
    K3Rejection,
    OffPolicySequenceMasking,
    SequenceRejection,
    SequenceTruncation,
    Stage,
    TokenRejection,
    TokenTruncation,
)
from vcpo.objectives import Objective
from vcpo.registry import make_lr_scale_rule, make_objective
from vcpo.step_size import ConstantLr, EssLr, StalenessLr

_LEARNER_ONLY_FIELDS = {"grad_norm_path"}
"""OPOB options that choose how the learner computes norms, not what the objective computes."""


def objective_params(algo: AlgoConfig) -> dict[str, Any]:
    """The keyword parameters of `make_objective` for `algo.objective` plus the shared loss terms."""
    params = algo.objective.model_dump(exclude={"type"})
    opob = params.pop("opob", None)
    if opob is not None:  # VCPO's nested baseline options are flat parameters of the objective
        params.update({key: value for key, value in opob.items() if key not in _LEARNER_ONLY_FIELDS})
    if algo.loss_aggregation is not None:
        params["loss_aggregation"] = algo.loss_aggregation
    params.update(
        kl_coef=algo.kl_coef,
        kl_estimator=algo.kl_estimator,
        entropy_coef=algo.entropy_coef,
    )
    return params


def build_objective(algo: AlgoConfig) -> Objective:
    """The policy objective configured in `algo`."""
    return make_objective(algo.objective.type, **objective_params(algo))


_STAGES: dict[str, type] = {
    "token_tis": TokenTruncation, "seq_tis": SequenceTruncation, "token_reject": TokenRejection,
    "seq_reject": SequenceRejection, "geo_reject": GeometricRejection, "k3_reject": K3Rejection,
    "opsm": OffPolicySequenceMasking,
}
"""`algo.corrections[i].type` → its stage in vcpo/corrections.py (the other fields are its parameters)."""


def build_corrections(algo: AlgoConfig) -> tuple[Stage, ...]:
    """The behaviour-correction stages of `algo.corrections`, in the listed order."""
    return tuple(_STAGES[stage.type](**stage.model_dump(exclude={"type"})) for stage in algo.corrections)


def build_lr_scale_rule(algo: AlgoConfig) -> EssLr | StalenessLr | ConstantLr:
    """The per-step lr multiplier: ESS (VCPO part 1), staleness-aware, or constant 1."""
    if algo.ess_lr.enabled:
        ess = algo.ess_lr
        return make_lr_scale_rule("ess", rule=ess.rule, base_ess_ratio=ess.base_ess_ratio,
                                  use_clipped_weights=ess.use_clipped_weights, is_cap=ess.is_cap)
    if algo.staleness_lr.enabled:
        return make_lr_scale_rule("staleness", s0=algo.staleness_lr.s0)
    return make_lr_scale_rule("constant")
