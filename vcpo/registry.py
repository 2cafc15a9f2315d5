"""Build objectives and step-size rules by name with plain keyword parameters.

    objective = make_objective("grpo", clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    lr_rule = make_lr_scale_rule("ess", rule="sqrt", base_ess_ratio=0.55)

An unknown name or parameter raises ValueError listing the valid ones. The tables are built when
called (no module-level registry is filled at import). Ablations of docs/algorithm.md:

    VCPO            = make_objective("vcpo")    + make_lr_scale_rule("ess")
    "ESS lr only"   = make_objective("seq_tis") + make_lr_scale_rule("ess")
    "OPOB only"     = make_objective("vcpo")    + make_lr_scale_rule("constant")
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vcpo.objectives import (
    BAPO,
    CISPO,
    GRPO,
    GSPO,
    M2PO,
    MIS,
    OTB,
    RLOO,
    TBA,
    VCPO,
    DrGRPO,
    Objective,
    Reinforce,
    SeqTIS,
    TokenTIS,
)
from vcpo.step_size import ConstantLr, EssLr, StalenessLr

OBJECTIVES: dict[str, type] = {
    cls.name: cls
    for cls in (GRPO, DrGRPO, RLOO, Reinforce, TokenTIS, SeqTIS, MIS, M2PO, BAPO, GSPO, CISPO, TBA, OTB, VCPO)
}
"""Objective classes by name (an immutable-by-convention table of classes, not of instances)."""

LR_SCALE_RULES: dict[str, type] = {"ess": EssLr, "staleness": StalenessLr, "constant": ConstantLr}
"""Step-size rules by name: "ess" (VCPO part 1), "staleness" (η0/(1+S/S0)), "constant" (s = 1)."""


def _build(kind: str, table: dict[str, type], name: str, params: dict[str, Any]) -> Any:
    if name not in table:
        raise ValueError(f"unknown {kind} {name!r}; valid: {sorted(table)}")
    cls = table[name]
    accepted = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"{kind} {name!r} got unknown parameter(s) {unknown}; valid: {accepted}")
    return cls(**params)


def make_objective(name: str, **params: Any) -> Objective:
    """The objective `name` (one of `OBJECTIVES`) with the given hyperparameters.

    Common parameters of every objective: loss_aggregation, token_sum_normalizer, kl_coef,
    kl_estimator, entropy_coef, max_log_ratio; the rest are documented on each class.
    """
    return _build("objective", OBJECTIVES, name, params)


def make_lr_scale_rule(name: str, **params: Any) -> EssLr | StalenessLr | ConstantLr:
    """The step-size rule `name` (one of `LR_SCALE_RULES`), e.g. ("ess", rule="linear")."""
    return _build("lr scale rule", LR_SCALE_RULES, name, params)
