"""The task YAML schema: shipped tasks load, every field is documented, mistakes name file and field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from cli.config_catalog import CONFIG_ROOT, check_task_config, shipped_config_files
from configs import task_schema
from configs.loader import ConfigError
from configs.task_schema import TaskConfig, load_task_config, template_placeholders

TASKS_DIR = CONFIG_ROOT / "tasks"
SHIPPED_TASKS = sorted(TASKS_DIR.glob("*.yaml"))

MINIMAL = """\
name: demo
dataset: {type: file, path: rows.jsonl}
fields: {answer: answer, template_fields: {question: question}}
prompt: {user: "{question} Put the answer in \\\\boxed{{}}."}
reward: {type: exact_match}
"""


def _write(tmp_path: Path, text: str, name: str = "task.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(path: Path, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_task_config(path, overrides)
    return str(info.value)


@pytest.mark.parametrize("path", SHIPPED_TASKS, ids=lambda p: p.name)
def test_every_shipped_task_loads_with_a_valid_tool_and_reward(path: Path) -> None:
    task = check_task_config(path)
    assert task.name == path.stem


def test_the_catalog_validates_task_files_as_tasks() -> None:
    assert set(SHIPPED_TASKS) <= set(shipped_config_files())
    assert {"countdown", "countdown_notool", "countdown_tinyzero", "gsm8k", "gsm8k_notool", "math500",
            "math500_notool", "aime2025", "aime2025_notool", "dapo_math"} <= {p.stem for p in SHIPPED_TASKS}


def _schema_models() -> list[type[BaseModel]]:
    found = [obj for obj in vars(task_schema).values()
             if isinstance(obj, type) and issubclass(obj, BaseModel)]
    return [model for model in found if model.__module__ == task_schema.__name__]


@pytest.mark.parametrize("model", _schema_models(), ids=lambda m: m.__name__)
def test_every_task_field_has_a_docstring(model: type[BaseModel]) -> None:
    undocumented = [name for name, field in model.model_fields.items() if not field.description]
    assert not undocumented, f"{model.__name__} fields without a docstring: {undocumented}"


def test_a_minimal_task_gets_the_documented_defaults(tmp_path: Path) -> None:
    task = load_task_config(_write(tmp_path, MINIMAL))
    assert task.tool is None and task.eval_dataset is None
    loop = task.loop
    assert (loop.max_turns, loop.max_total_tokens, loop.max_observation_chars) == (5, 2048, 512)
    assert task.answer.pattern == "boxed"
    assert (task.eval.k, task.eval.temperature, task.eval.metrics) == (1, 0.6, ("avg@k", "pass@k", "maj@k"))
    assert task.prompt.user.format(question="2+2?") == "2+2? Put the answer in \\boxed{}."


def test_a_placeholder_without_a_template_field_names_file_and_both_fields(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL.replace("{question} Put", "{question} {hint} Put"))
    message = _error(path)
    assert str(path) in message
    assert "prompt.user uses {hint} but fields.template_fields has no 'hint'" in message
    assert "add fields.template_fields.hint" in message


def test_single_braces_in_a_template_ask_for_doubled_braces(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL.replace("\\\\boxed{{}}", "\\\\boxed{}"))
    assert "prompt.user: placeholder {} is not a plain name" in _error(path)
    assert "write literal braces as '{{' and '}}'" in _error(path)


def test_placeholders_are_checked_against_a_datasets_own_field_map(tmp_path: Path) -> None:
    text = MINIMAL + ("eval_dataset: {type: file, path: e.jsonl, "
                      "fields: {answer: a, template_fields: {q: p}}}\n")
    message = _error(_write(tmp_path, text))
    assert "prompt.user uses {question} but eval_dataset.fields.template_fields has no 'question'" in message


def test_custom_reward_without_function_names_both_fields(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL.replace("{type: exact_match}", "{type: custom}"))
    message = _error(path)
    assert str(path) in message
    assert "reward.type='custom' needs reward.function" in message


def test_a_function_with_a_built_in_reward_is_a_conflict(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL.replace("{type: exact_match}", "{type: gsm8k, function: 'a.b:c'}"))
    assert "reward.function='a.b:c' is only used with reward.type='custom'" in _error(path)


def test_a_bad_answer_regex_names_the_field(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL + "answer: {pattern: '<answer>(.*?</answer>'}\n")
    message = _error(path)
    assert str(path) in message
    assert "answer.pattern: bad value '<answer>(.*?</answer>': not a valid regex" in message


def test_an_answer_regex_needs_exactly_one_group(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL + "answer: {pattern: '(a)(b)'}\n")
    assert "the regex has 2 groups, needs exactly 1" in _error(path)


def test_a_dataset_path_may_only_use_the_data_dir_placeholder(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL.replace("path: rows.jsonl", "path: '{root}/rows.jsonl'"))
    assert "dataset.file.path: bad value '{root}/rows.jsonl': unknown placeholder(s) {root}" in _error(path)


def test_a_typo_in_a_section_suggests_the_field(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL + "loop: {max_turn: 3}\n")
    assert "loop.max_turn: unknown key; did you mean 'max_turns'?" in _error(path)


def test_generator_ranges_must_be_ordered(tmp_path: Path) -> None:
    generator = "{type: generator, name: countdown, num_samples: 4, min_target: 50, max_target: 20}"
    text = MINIMAL.replace("{type: file, path: rows.jsonl}", generator)
    assert "dataset.min_target=50 > dataset.max_target=20" in _error(_write(tmp_path, text))


def test_overrides_reach_nested_fields(tmp_path: Path) -> None:
    task = load_task_config(_write(tmp_path, MINIMAL), ["loop.max_turns=2", "eval.k=8", "tool.type=python"])
    assert (task.loop.max_turns, task.eval.k, task.tool) == (2, 8, {"type": "python"})


def test_notool_variants_inherit_everything_but_the_tool_and_prompt() -> None:
    with_tool = load_task_config(TASKS_DIR / "countdown.yaml")
    without = load_task_config(TASKS_DIR / "countdown_notool.yaml")
    assert with_tool.tool == {"type": "python", "timeout_s": 10} and without.tool is None
    assert without.dataset == with_tool.dataset and without.reward == with_tool.reward
    assert "python" in with_tool.prompt.user and "python" not in without.prompt.user
    assert (without.loop.max_turns, without.eval.max_turns) == (0, 0)


def test_dapo_math_evaluates_on_aime_with_its_own_field_map() -> None:
    task = load_task_config(TASKS_DIR / "dapo_math.yaml")
    assert task.fields.template_fields == {"question": "prompt.0.content"}
    assert task.eval_dataset is not None and task.eval_dataset.fields is not None
    assert task.eval_dataset.fields.template_fields == {"question": "problem"}


def test_a_bad_tool_spec_is_reported_with_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL + "tool: {type: python, timeout_s: -1}\n")
    expected = r"(?s)tool: invalid settings for tool type 'python'.*timeout_s = -1"
    with pytest.raises(ConfigError, match=expected):
        check_task_config(path)


def test_a_custom_reward_that_does_not_import_is_reported_at_load(tmp_path: Path) -> None:
    path = _write(tmp_path, MINIMAL.replace("{type: exact_match}",
                                            "{type: custom, function: 'no_such_pkg.rewards:score'}"))
    with pytest.raises(ConfigError) as info:
        check_task_config(path)
    message = str(info.value)
    assert str(path) in message
    assert "reward.function: reward.function='no_such_pkg.rewards:score': cannot import module" in message


def test_template_placeholders_lists_the_names() -> None:
    assert template_placeholders("Use {numbers} to make {target}; \\boxed{{}}") == {"numbers", "target"}
    with pytest.raises(ValueError, match="malformed template"):
        template_placeholders("\\boxed{")


def test_task_config_is_frozen(tmp_path: Path) -> None:
    task = load_task_config(_write(tmp_path, MINIMAL))
    with pytest.raises(ValueError):
        task.name = "other"  # type: ignore[misc]
    assert isinstance(task, TaskConfig)


# ---------------------------------------------------------------------------------------------
# Several tools and function calling

TWO_TOOLS = MINIMAL + """\
tools:
  - {type: python, timeout_s: 5}
  - {type: sandbox_fusion, endpoint: "http://127.0.0.1:8080"}
loop: {tool_format: function_call}
"""


def test_a_tools_list_with_function_calling_loads_and_the_one_tool_form_still_does(tmp_path: Path) -> None:
    task = check_task_config(_write(tmp_path, TWO_TOOLS))
    assert [spec["type"] for spec in task.tool_specs()] == ["python", "sandbox_fusion"]
    assert (task.loop.tool_format, task.loop.tool_parser, task.loop.max_parallel_calls) == (
        "function_call", "hermes", 4)
    one = check_task_config(_write(tmp_path, MINIMAL + "tool: {type: python}\n", "one.yaml"))
    assert one.tool_specs() == [{"type": "python"}] and one.loop.tool_format == "code_fence"
    assert load_task_config(_write(tmp_path, MINIMAL, "none.yaml")).tool_specs() == []


def test_several_tools_need_function_calling_and_tool_and_tools_exclude_each_other(tmp_path: Path) -> None:
    fenced = TWO_TOOLS.replace("loop: {tool_format: function_call}\n", "")
    assert "tools lists 2 tools but loop.tool_format is 'code_fence'" in _error(_write(tmp_path, fenced))
    both = TWO_TOOLS + "tool: {type: python}\n"
    assert "both tool and tools are set" in _error(_write(tmp_path, both, "both.yaml"))
    untyped = MINIMAL + "tools: [{timeout_s: 5}]\n"
    assert "tools.0 has no string `type`" in _error(_write(tmp_path, untyped, "untyped.yaml"))


def test_a_bad_spec_in_the_tools_list_names_its_index(tmp_path: Path) -> None:
    path = _write(tmp_path, TWO_TOOLS.replace("timeout_s: 5", "timeout_s: -1"))
    with pytest.raises(ConfigError, match=r"(?s)tools.0: invalid settings for tool type 'python'"):
        check_task_config(path)


def test_an_unknown_parser_and_a_missing_chat_template_are_refused_at_load(tmp_path: Path) -> None:
    path = _write(tmp_path, TWO_TOOLS)
    with pytest.raises(ConfigError) as info:
        check_task_config(path, ["loop.tool_parser=nope", "prompt.chat_template=missing.jinja"])
    problems = "\n".join(info.value.problems)
    assert "loop.tool_parser: unknown tool parser 'nope'; built-in: hermes" in problems
    assert f"prompt.chat_template: no such file {tmp_path / 'missing.jinja'}" in problems
