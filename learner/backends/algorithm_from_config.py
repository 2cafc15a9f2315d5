"""Config → algorithm objects: the objective, the correction stages and the step-size rule of `AlgoConfig`.

The registry in `vcpo/` takes plain keyword parameters; this is the one place that maps the typed
config onto them, so the schema and the registry cannot drift apart unnoticed (a test builds every
objective type from its config defaults). `type: custom` objectives and stages are imported from their
`import_path` (docs/extending.md) and checked here: `check_algorithm` names the field and the fix before
any model is loaded.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from configs.schema import AlgoConfig
from vcpo.corrections import (
    SEQUENCE,
    TOKEN,
    TRUNCATION,
    GeometricRejection,
    K3Rejection,
    OffPolicySequenceMasking,
    SequenceRejection,
    SequenceTruncation,
    Stage,
    TokenRejection,
    TokenTruncation,
    check_stages,
)
from vcpo.objectives import Objective
from vcpo.objectives.base import ObjectiveBase
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


class PluginError(ValueError):
    """A `type: custom` objective or correction stage that cannot be built; the message names the field."""


def build_objective(algo: AlgoConfig) -> Objective:
    """The policy objective configured in `algo`."""
    if algo.objective.type == "custom":
        return _custom_objective(algo)
    return make_objective(algo.objective.type, **objective_params(algo))


def _plugin_class(import_path: str, field: str) -> type:
    module_name, _, attribute = import_path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"{field}={import_path!r}: cannot import module {module_name!r} ({exc}); check the "
                          "spelling and that its package is installed or on PYTHONPATH") from None
    found = getattr(module, attribute, None)
    if not isinstance(found, type) or not dataclasses.is_dataclass(found):
        raise PluginError(f"{field}={import_path!r}: module {module_name!r} has no dataclass {attribute!r}; "
                          "define it as a @dataclass(frozen=True) class (docs/extending.md)")
    return found


def _construct(cls: type, params: dict[str, Any], field: str) -> Any:
    accepted = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise PluginError(f"{field}: {cls.__name__} has no parameter(s) {unknown}; it takes: {accepted}")
    try:
        return cls(**params)
    except (TypeError, ValueError) as exc:
        raise PluginError(f"{field}: {cls.__name__}({params}) refused: {exc}") from None


def _custom_objective(algo: AlgoConfig) -> Objective:
    spec = algo.objective
    cls = _plugin_class(spec.import_path, "algo.objective.import_path")  # type: ignore[union-attr]
    if not issubclass(cls, ObjectiveBase) or not cls.name:
        raise PluginError(f"algo.objective.import_path={spec.import_path!r}: {cls.__name__} is no objective; "  # type: ignore[union-attr]
                          "subclass vcpo.objectives.base.ObjectiveBase (or a shipped objective) and give it "
                          "a `name`")
    shared = {"kl_coef": algo.kl_coef, "kl_estimator": algo.kl_estimator, "entropy_coef": algo.entropy_coef,
              **({"loss_aggregation": algo.loss_aggregation} if algo.loss_aggregation is not None else {})}
    return _construct(cls, {**spec.params, **shared}, "algo.objective.params")  # type: ignore[union-attr]


_STAGES: dict[str, type] = {
    "token_tis": TokenTruncation, "seq_tis": SequenceTruncation, "token_reject": TokenRejection,
    "seq_reject": SequenceRejection, "geo_reject": GeometricRejection, "k3_reject": K3Rejection,
    "opsm": OffPolicySequenceMasking,
}
"""`algo.corrections[i].type` → its stage in vcpo/corrections.py (the other fields are its parameters)."""


def build_corrections(algo: AlgoConfig) -> tuple[Stage, ...]:
    """The behaviour-correction stages of `algo.corrections`, in the listed order."""
    stages = tuple(_custom_stage(stage.import_path, stage.params, f"algo.corrections[{index}]")
                   if stage.type == "custom" else _STAGES[stage.type](**stage.model_dump(exclude={"type"}))
                   for index, stage in enumerate(algo.corrections))
    try:
        check_stages(stages)
    except ValueError as exc:
        raise PluginError(f"algo.corrections: {exc}") from None
    return stages


def _custom_stage(import_path: str, params: dict[str, Any], field: str) -> Stage:
    cls = _plugin_class(import_path, f"{field}.import_path")
    level = getattr(cls, "level", None)
    needs = {TOKEN: ("keep",), SEQUENCE: ("keep",), TRUNCATION: ("uncapped",)}.get(level)  # type: ignore[arg-type]
    if needs is None or not isinstance(getattr(cls, "label", None), str | property):
        raise PluginError(f"{field}.import_path={import_path!r}: a stage needs a `label` (its metrics' name) "
                          f"and a `level` in {[TOKEN, SEQUENCE, TRUNCATION]} (has {level!r})")
    missing = [name for name in needs if not callable(getattr(cls, name, None))]
    if level == TRUNCATION and "cap" not in {f.name for f in dataclasses.fields(cls)}:
        missing.append("cap (a field)")
    if missing:
        raise PluginError(f"{field}.import_path={import_path!r}: a {level} stage needs {missing} "
                          "(vcpo/corrections.py's stages are the models)")
    return _construct(cls, params, f"{field}.params")


def check_algorithm(algo: AlgoConfig) -> None:
    """Build `algo`'s objective and corrections once (PluginError naming the field): a custom objective or
    stage that cannot be imported or built, or a truncation stage under an objective that weighs the loss
    by a behaviour ratio of its own, fails here, before any model is loaded."""
    objective = build_objective(algo)
    stages = build_corrections(algo)
    truncation = [stage.label for stage in stages if stage.level == TRUNCATION]
    if truncation and not getattr(objective, "accepts_token_weights", False):
        raise PluginError(f"algo.corrections: {truncation[0]} weights the loss by an IS ratio, but the "
                          f"objective {objective.name!r} does not take token weights (it corrects for the "
                          "behaviour policy itself, or sets takes_token_weights = False): drop the stage")


def build_lr_scale_rule(algo: AlgoConfig) -> EssLr | StalenessLr | ConstantLr:
    """The per-step lr multiplier: ESS (VCPO part 1), staleness-aware, or constant 1."""
    if algo.ess_lr.enabled:
        ess = algo.ess_lr
        return make_lr_scale_rule("ess", rule=ess.rule, base_ess_ratio=ess.base_ess_ratio,
                                  use_clipped_weights=ess.use_clipped_weights, is_cap=ess.is_cap)
    if algo.staleness_lr.enabled:
        return make_lr_scale_rule("staleness", s0=algo.staleness_lr.s0)
    return make_lr_scale_rule("constant")
