"""The config system: every shipped YAML validates, every field is documented, errors guide."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from benchmarks import BENCH_CONFIG_ROOT
from cli.config_catalog import CONFIG_ROOT, shipped_config_files, validate_shipped_file
from configs import schema as schema_module
from configs.loader import ConfigError, load_config, write_resolved_config
from configs.schema import AlgoConfig, RunConfig
from vcpo.registry import OBJECTIVES


@pytest.mark.parametrize("path", shipped_config_files(), ids=lambda p: p.name)
def test_every_shipped_yaml_validates(path: Path) -> None:
    validated = validate_shipped_file(path)
    assert isinstance(validated, BaseModel | dict), f"{path}: validated to {type(validated).__name__}"
    # the file's own keys are what its schema read: a typo'd key would have been refused, and no key is lost
    raw = yaml.safe_load(path.read_text()) or {}
    dumped = validated.model_dump() if isinstance(validated, BaseModel) else validated
    missing = {key for key in raw if key not in ("extends", "task_overrides") and key not in dumped}
    assert not missing, f"{path}: keys the validated config does not hold: {sorted(missing)}"


def test_a_broken_shipped_yaml_is_refused_naming_the_field(tmp_path: Path) -> None:
    broken = tmp_path / "default.yaml"
    text = (CONFIG_ROOT / "default.yaml").read_text()
    broken.write_text(text.replace("trainer:", "trainer:\n  total_stepz: 3", 1))
    with pytest.raises(ConfigError, match="total_stepz"):
        load_config(broken, RunConfig)


def test_there_are_shipped_configs() -> None:
    folders = {path.parent for path in shipped_config_files()}
    assert {CONFIG_ROOT, BENCH_CONFIG_ROOT, CONFIG_ROOT / "tools", CONFIG_ROOT / "sandbox"} <= folders


def _all_models() -> list[type[BaseModel]]:
    found = [obj for obj in vars(schema_module).values()
             if isinstance(obj, type) and issubclass(obj, BaseModel)]
    return [model for model in found if model.__module__ == schema_module.__name__]


@pytest.mark.parametrize("model", _all_models(), ids=lambda m: m.__name__)
def test_every_field_has_a_docstring(model: type[BaseModel]) -> None:
    undocumented = [name for name, field in model.model_fields.items() if not field.description]
    assert not undocumented, f"{model.__name__} fields without a docstring: {undocumented}"


def _write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_unknown_key_names_file_field_and_suggests_the_fix(tmp_path: Path) -> None:
    path = _write(tmp_path, "optim: {lrr: 1.0e-6}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, RunConfig)
    message = str(info.value)
    assert str(path) in message
    assert "optim.lrr: unknown key; did you mean 'lr'?" in message


def test_unknown_key_inside_a_tagged_union_member(tmp_path: Path) -> None:
    path = _write(tmp_path, "algo: {objective: {type: grpo, clip_lo: 0.1}}\n")
    with pytest.raises(ConfigError, match=r"clip_lo: unknown key; did you mean 'clip_low'\?"):
        load_config(path, RunConfig)


def test_all_problems_are_reported_at_once(tmp_path: Path) -> None:
    path = _write(tmp_path, "model: {dtyp: float32}\noptim: {lr: -1}\nseed: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, RunConfig)
    assert len(info.value.problems) == 3


def test_bad_value_shows_value_and_field_meaning(tmp_path: Path) -> None:
    path = _write(tmp_path, "optim: {lr: -1}\n")
    with pytest.raises(ConfigError, match=r"optim\.lr: bad value -1: .*greater than 0.*Peak learning rate"):
        load_config(path, RunConfig)


def test_overrides_apply_with_yaml_typing(tmp_path: Path) -> None:
    path = _write(tmp_path, "seed: 1\n")
    config = load_config(path, RunConfig, ["optim.lr=3e-6", "algo.objective.type=grpo",
                                           "algo.ess_lr.enabled=false", "algo.group_size=4"])
    assert config.optim.lr == 3e-6
    assert config.algo.objective.type == "grpo"
    assert config.algo.group_size == 4


def test_bad_override_is_attributed_to_the_command_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "seed: 1\n")
    with pytest.raises(ConfigError, match=r"optim\.lr \(from a command-line override\): bad value 'fast'"):
        load_config(path, RunConfig, ["optim.lr=fast"])


def test_malformed_override_says_the_expected_form(tmp_path: Path) -> None:
    path = _write(tmp_path, "seed: 1\n")
    with pytest.raises(ConfigError, match=r"expected the form a\.b\.c=value"):
        load_config(path, RunConfig, ["optim.lr"])


def test_cross_field_rule_names_both_fields_and_fix() -> None:
    with pytest.raises(ValueError, match=r"group_size=1 .* set algo\.group_size ≥ 2 or use objective\.type="):
        AlgoConfig(group_size=1)
    with pytest.raises(ValueError, match=r"ess_lr\.enabled and staleness_lr\.enabled"):
        AlgoConfig.model_validate({"staleness_lr": {"enabled": True}})


@pytest.mark.parametrize("kind", sorted(OBJECTIVES))
def test_every_objective_config_default_is_the_registry_default(kind: str) -> None:
    """A run config that names only the objective type gets the objective class's own defaults."""
    from learner.backends.algorithm_from_config import build_objective

    algo = AlgoConfig.model_validate({"objective": {"type": kind}, "ess_lr": {"enabled": False}})
    assert build_objective(algo) == OBJECTIVES[kind]()


def test_the_task_loop_default_temperature_is_the_one_every_signature_defaults_to() -> None:
    """configs imports nothing, so the task schema spells the default out: it must be the engine's and the
    learner's default (rollout.types), or a run would sample at one temperature and score at another."""
    from configs.task_schema import LoopConfig
    from rollout.types import DEFAULT_TEMPERATURE

    assert LoopConfig().temperature == DEFAULT_TEMPERATURE


@pytest.mark.parametrize(
    ("objective", "field"),
    [
        ({"type": "gspo", "clip_low": 1.0}, "clip_low"),
        ({"type": "gspo", "clip_high": -0.1}, "clip_high"),
        ({"type": "gspo", "ratio_to": "engine"}, "ratio_to"),
        ({"type": "cispo", "clip_low": 1.2}, "clip_low"),
        ({"type": "cispo", "clip_high": -0.1}, "clip_high"),
        ({"type": "cispo", "ratio_to": "old"}, "ratio_to"),
    ],
)
def test_gspo_and_cispo_options_are_range_checked(objective: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        AlgoConfig.model_validate({"objective": objective})


def test_cispo_accepts_no_lower_bound() -> None:
    algo = AlgoConfig.model_validate({"objective": {"type": "cispo", "clip_low": 1.0}})
    assert algo.objective.clip_low == 1.0


def test_yaml_syntax_error_names_line(tmp_path: Path) -> None:
    path = _write(tmp_path, "optim:\n  lr: [1\n")
    with pytest.raises(ConfigError, match=r"line \d+, column \d+: not valid YAML"):
        load_config(path, RunConfig)


def test_extends_merges_and_detects_cycles(tmp_path: Path) -> None:
    _write(tmp_path, "seed: 3\noptim: {lr: 2.0e-6, grad_clip: 0.5}\n", "base.yaml")
    child = _write(tmp_path, "extends: base.yaml\noptim: {lr: 5.0e-6}\n", "child.yaml")
    config = load_config(child, RunConfig)
    assert (config.seed, config.optim.lr, config.optim.grad_clip) == (3, 5e-6, 0.5)
    _write(tmp_path, "extends: b.yaml\n", "a.yaml")
    _write(tmp_path, "extends: a.yaml\n", "b.yaml")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml", RunConfig)


def test_resolved_config_is_written_and_reloads_identically(tmp_path: Path) -> None:
    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "default.yaml", RunConfig)
    written = write_resolved_config(config, tmp_path / "run")
    assert RunConfig.model_validate(yaml.safe_load(written.read_text())) == config


def test_extends_replaces_a_tagged_section_whose_type_changes(tmp_path: Path) -> None:
    _write(tmp_path, "algo: {objective: {type: vcpo, is_cap: 4.0}}\n", "base.yaml")
    child = _write(tmp_path, "extends: base.yaml\nalgo: {objective: {type: seq_tis}}\n", "child.yaml")
    assert load_config(child, RunConfig).algo.objective.type == "seq_tis"


def test_an_override_that_changes_a_tagged_sections_type_replaces_it(tmp_path: Path) -> None:
    """What the README tells a user to type: switching the default run's objective from the command
    line, with an option of the new objective before or after the type."""
    base = _write(tmp_path, "algo: {objective: {type: vcpo, is_cap: 4.0, opob: {scope: group}}}\n",
                  "run.yaml")
    for overrides in (["algo.objective.type=grpo", "algo.objective.clip_low=0.1"],
                      ["algo.objective.clip_low=0.1", "algo.objective.type=grpo"]):
        objective = load_config(base, RunConfig, overrides).algo.objective
        assert (objective.type, objective.clip_low) == ("grpo", 0.1)
    same = load_config(base, RunConfig, ["algo.objective.type=vcpo"]).algo.objective
    assert same.is_cap == 4.0  # the same variant: nothing dropped


def test_a_broken_shipped_tool_spec_is_reported_with_its_file(tmp_path: Path) -> None:
    from cli import config_catalog

    folder = tmp_path / "tools"
    folder.mkdir()
    bad = folder / "python.yaml"
    bad.write_text("type: python\ntimeout_s: -1\n")
    original = config_catalog.CONFIG_ROOT
    config_catalog.CONFIG_ROOT = tmp_path
    try:
        with pytest.raises(ConfigError, match=r"timeout_s"):
            validate_shipped_file(bad)
    finally:
        config_catalog.CONFIG_ROOT = original


def _differences(shipped: object, schema: object, path: str = "") -> list[str]:
    """Dotted paths of the leaves where `shipped` differs from `schema` (both plain JSON)."""
    if isinstance(shipped, dict) and isinstance(schema, dict):
        return [found for key in shipped
                for found in _differences(shipped[key], schema.get(key), f"{path}{key}.")]
    return [path.rstrip(".")] if shipped != schema else []


def _says_why(lines: list[str], dotted: str) -> bool:
    """Whether the line of `dotted` in a YAML file's text (each key looked up after its parent's line, block
    or flow style), or a comment-only line right under it, carries "(schema: ...)"."""
    start = 0
    for key in dotted.split("."):
        for index in range(start, len(lines)):
            code = lines[index].split("#", 1)[0]
            if re.search(rf"(^\s*|[{{,]\s*){re.escape(key)}:", code):
                start = index
                break
        else:
            return False
    following = [start] + [i for i in range(start + 1, min(start + 4, len(lines)))
                           if lines[i].lstrip().startswith("#") or not lines[i].split("#", 1)[0].strip()]
    return any("(schema:" in lines[i] for i in following[:3])


def test_every_value_of_the_default_run_that_differs_from_the_schema_says_why() -> None:
    """configs/default.yaml is the tuned run, the schema's defaults the general ones: one meaning each, and
    every place where they part names the schema's value and the reason, so neither drifts unnoticed."""
    path = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
    shipped = load_config(path, RunConfig, []).model_dump(mode="json")
    schema = RunConfig.model_validate({"task": shipped["task"]}).model_dump(mode="json")
    differing = _differences(shipped, schema)
    assert "optim.lr" in differing  # the check sees the differences at all
    lines = path.read_text().splitlines()
    silent = [dotted for dotted in differing if not _says_why(lines, dotted)]
    assert not silent, f"{path}: these differ from configs/schema.py's defaults without a '(schema: …)' " \
                       f"comment saying why: {silent}"


@pytest.mark.parametrize(("corrections", "objective", "message"), [
    ([{"type": "opsm"}, {"type": "opsm", "delta": 0.1}], "grpo",
     r"algo\.corrections\[1\] repeats 'opsm' \(first at algo\.corrections\[0\]\)"),
    ([{"type": "token_tis"}, {"type": "seq_tis"}], "grpo", r"\[0\] and \[1\] both weight the loss"),
    ([{"type": "k3_reject"}, {"type": "token_tis"}], "vcpo",
     r"algo\.corrections\[1\] \(token_tis\) .* objective\.type='vcpo' already weighs it"),
    ([{"type": "seq_tis"}], "gspo", r"objective\.type='gspo'.*gspo or cispo with ratio_to: proximal"),
    ([{"type": "token_reject", "lower": 1.5, "upper": 2.0}], "grpo", r"lower"),
    ([{"type": "geo_reject", "lower": 1.0, "upper": 1.0}], "grpo", r"lower=1\.0 must be < upper=1\.0"),
    ([{"type": "k3_reject", "threshold": 0}], "grpo", r"threshold"),
    ([{"type": "k3_reject", "reduce": "median"}], "grpo", r"reduce"),
])
def test_corrections_that_cannot_run_are_refused_naming_the_stage_and_the_fix(
    corrections: list, objective: str, message: str,
) -> None:
    with pytest.raises(ValueError, match=message):
        AlgoConfig.model_validate({"objective": {"type": objective}, "corrections": corrections})


def test_rejections_stack_under_every_objective_and_k3_reductions_are_distinct_stages() -> None:
    rejections = [{"type": "token_reject"}, {"type": "seq_reject"}, {"type": "geo_reject"},
                  {"type": "k3_reject"}, {"type": "k3_reject", "reduce": "max"}, {"type": "opsm"}]
    from learner.backends.algorithm_from_config import build_corrections

    for kind in sorted(OBJECTIVES):
        algo = AlgoConfig.model_validate({"objective": {"type": kind}, "corrections": rejections})
        stages = build_corrections(algo)
        assert [stage.label for stage in stages] == ["token_reject", "seq_reject", "geo_reject", "k3_reject",
                                                     "k3_reject_max", "opsm"], kind
        assert [stage.reduce for stage in stages[3:5]] == ["mean", "max"]
    with pytest.raises(ValueError, match="k3_reject"):  # the same reduction twice is one stage listed twice
        AlgoConfig.model_validate({"objective": {"type": "grpo"},
                                   "corrections": [{"type": "k3_reject"}, {"type": "k3_reject"}]})


def test_corrections_with_a_reused_proximal_pass_are_refused() -> None:
    with pytest.raises(ValueError, match=r"learner\.proximal='reuse'.*set learner\.proximal to 'separate'"):
        RunConfig.model_validate({"algo": {"corrections": [{"type": "opsm"}]},
                                  "learner": {"proximal": "reuse"}})
