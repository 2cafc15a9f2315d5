"""examples/custom_task: the user's own data and reward, through the real `vcpo` command.

The `vcpo` commands are read from the example's README (its ```bash blocks) and run as a user types
them: the installed `vcpo` script, in the repository root, with the README's `PYTHONPATH`. Only
test-speed arguments are appended (later overrides and options win): a tiny model that memorised a
tool-using episode of the task's first problem instead of the default model, the HF engine, 2 steps,
outputs in a temporary folder. The memorised model makes the scores real: it computes 42 km in miles
in the bubblewrap sandbox and boxes 26.1, which the custom reward must score 1.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent_env.datasets import load_samples
from agent_env.samples import Sample
from configs.task_schema import load_task_config
from examples.custom_task.reward import conversion_reward, parse_number
from run.observability.metrics_log import read_metrics
from tests.examples.memorise import memorise_episode, task_prompt_ids

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_task"
VCPO = Path(sys.executable).parent / "vcpo"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")

# The memorised episode of the first problem, "Convert 42 kilometres to miles.": the observation is
# what the real sandbox prints for the code (42 * 0.621371 = 26.097582 in floating point).
TURN_1 = "Let me compute.\n```python\nprint(42 * 0.621371)\n```\n"
OBSERVATION = "\n```output\n26.097582\n```\n"
TURN_2 = "So the answer is \\boxed{26.1}."


# ---------------------------------------------------------------------------------------------
# The reward function on its own


def _score(response: str, answer: float) -> float:
    return conversion_reward(response, Sample(sample_id="s", fields={}, answer=answer)).score


def test_the_reward_scores_by_relative_error() -> None:
    assert _score("so \\boxed{26.1}", 26.0976) == 1.0  # |26.1 − 26.0976| / 26.0976 ≈ 0.0001 ≤ 1%
    assert _score("\\boxed{26.1 miles}", 26.0976) == 1.0  # the unit is ignored
    assert _score("\\boxed{25}", 26.0976) == 0.5  # 1.0976 / 26.0976 ≈ 4.2%: within 10%
    assert _score("\\boxed{42}", 26.0976) == 0.1  # a number, but 61% off: format credit only
    assert _score("about 26.1 miles", 26.0976) == 0.0  # not boxed
    assert _score("\\boxed{12,600}", 12600) == 1.0  # thousands separators
    assert _score("\\boxed{9.46 \\times 10^{12}}", 9460730472580.8) == 1.0  # 0.008% off
    assert _score("\\boxed{9.46e12}", 9460730472580.8) == 1.0


def test_the_reward_reports_what_it_read_and_whether_it_is_correct() -> None:
    result = conversion_reward("\\boxed{ 25 }", Sample(sample_id="s", fields={}, answer=26.0976))
    assert (result.extracted, result.is_correct, result.error) == ("25", False, None)


@pytest.mark.parametrize("response", [
    "\\boxed{", "\\boxed{}", "\\boxed{about twenty}", "\\boxed{1e999}", "\\boxed{1 \\times 10^{400}}",
    "\\boxed{" + "9" * 5000 + "}", "\\boxed{\\frac{1}{0}}", "\x00\ufffd\\boxed{\x00}", "}}}\\boxed{{{",
])
def test_bad_model_output_gets_a_low_score_not_an_exception(response: str) -> None:
    assert _score(response, 26.0976) in (0.0, 0.1)


def test_parse_number_reads_no_number_as_none() -> None:
    assert parse_number("about twenty") is None and parse_number("1e999") is None
    assert parse_number("≈ -3.5 units") == -3.5


# ---------------------------------------------------------------------------------------------
# The README's commands


def readme_commands() -> list[list[str]]:
    """Every `vcpo ...` line of the README's ```bash blocks, split as a shell would."""
    text = (EXAMPLE / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines()]
    return [shlex.split(line, comments=True) for line in lines if line.startswith("vcpo ")]


def readme_command(subcommand: str) -> list[str]:
    (command,) = [c for c in readme_commands() if c[1] == subcommand]
    return command


def _run(command: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess:
    """`command` as typed in the repo root after the README's `export PYTHONPATH=$PWD`."""
    assert command[0] == "vcpo" and VCPO.is_file(), f"no vcpo script beside {sys.executable}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(VCPO), *command[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def test_the_readme_checks_trains_and_evaluates_with_pythonpath_set() -> None:
    text = (EXAMPLE / "README.md").read_text()
    assert "\nexport PYTHONPATH=$PWD\n" in text  # what _run reproduces
    assert [command[1] for command in readme_commands()] == ["config", "train", "eval"]
    for command in readme_commands():  # every file a command names exists
        assert all((ROOT / arg).is_file() for arg in command if arg.endswith((".yaml", ".jsonl")) and
                   not arg.startswith("evals/")), command


def test_readme_config_check_passes_as_written() -> None:
    result = _run(readme_command("config"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "task: examples/custom_task/task.yaml" in result.stdout and "path: default" in result.stdout


@pytest.fixture(scope="module")
def rows() -> dict[str, Sample]:
    task = load_task_config(EXAMPLE / "task.yaml")
    return {sample.sample_id: sample for sample in load_samples(task, task_dir=EXAMPLE).samples}


@pytest.fixture(scope="module")
def memorised_dir(tmp_path_factory: pytest.TempPathFactory, rows: dict[str, Sample]) -> Path:
    task = load_task_config(EXAMPLE / "task.yaml")
    prompt = task_prompt_ids(task, rows["km-to-miles"])
    out_dir = tmp_path_factory.mktemp("memorised-conversion")
    return memorise_episode(out_dir, prompt, TURN_1 + OBSERVATION + TURN_2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, memorised_dir: Path
            ) -> tuple[subprocess.CompletedProcess, Path]:
    """The README's train command, 2 steps from the memorised model (shared by the train and eval tests).
    Only the first problem is trained on: the one the model memorised (on the others it babbles)."""
    run_dir = tmp_path_factory.mktemp("custom-task") / "run"
    result = _run([*readme_command("train"), f"model.path={memorised_dir}", "engine.backend=hf",
                   f"run_dir={run_dir}", "trainer.total_steps=2", "learner.device=cpu",
                   "task_overrides=[dataset.limit=1]", "--no-progress"])
    return result, run_dir


def _failure_report(result: subprocess.CompletedProcess, run_dir: Path) -> str:
    log = run_dir / "logs" / "libraries.log"  # engine and library output of the run, when diverted
    return result.stderr[-3000:] + (log.read_text()[-3000:] if log.is_file() else "")


@needs_bwrap
def test_readme_train_logs_steps_scored_by_the_custom_reward(trained: tuple, rows: dict[str, Sample]) -> None:
    result, run_dir = trained
    assert result.returncode == 0, _failure_report(result, run_dir)
    records = read_metrics(run_dir)
    assert [r["trainer_step"] for r in records] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 and r["rollout/reward_errors"] == 0 for r in records)
    episodes = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(episodes) == 2 * 2 * 4  # steps × groups per step × group size (run.yaml)
    for episode in episodes:  # each logged reward is the custom reward of that episode's text
        # (the text also holds the tool outputs: numbers, never a \boxed{})
        assert episode["reward"] == conversion_reward(episode["text"], rows[episode["sample_id"]]).score
    assert any(e["reward"] > 0 and e["tool_calls"] >= 1 for e in episodes)  # boxed after a tool call
    assert (run_dir / "export" / "config.json").is_file()


@needs_bwrap
def test_readme_eval_of_the_trained_model_writes_samples_and_summary(trained: tuple, tmp_path: Path) -> None:
    result, run_dir = trained
    assert result.returncode == 0, _failure_report(result, run_dir)
    out = tmp_path / "custom_task.jsonl"
    evaluation = _run([*readme_command("eval"), "--model", str(run_dir / "export"), "--backend", "hf",
                       "--out", str(out), "--limit", "1", "--k", "2", "eval.temperature=0", "--no-progress"])
    assert evaluation.returncode == 0, evaluation.stderr[-3000:]
    meta, *samples = (json.loads(line) for line in out.read_text().splitlines())
    assert meta["kind"] == "meta" and meta["meta"]["k"] == 2 and len(samples) == 2
    for sample in samples:  # greedy: the memorised episode, its real tool output, the custom reward's 1
        assert sample["turns"][0]["code"] == "print(42 * 0.621371)"
        assert "26.097582" in sample["turns"][0]["observation"]
        assert (sample["extracted"], sample["reward"], sample["is_correct"]) == ("26.1", 1.0, True)
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    metrics = ("avg@2", "pass@2", "maj@2", "tool_calls_mean")
    assert [summary[name] for name in metrics] == [1.0, 1.0, 1.0, 1.0]
    assert "avg@2" in evaluation.stdout and "100.0%" in evaluation.stdout


# ---------------------------------------------------------------------------------------------
# A broken reward path

MISSING = "reward.function=examples.custom_task.reward:missing_function"


def test_a_missing_reward_function_stops_train_naming_the_task_file_the_field_and_the_fix(
        tmp_path: Path, memorised_dir: Path) -> None:
    result = _run([*readme_command("train"), f"model.path={memorised_dir}", "engine.backend=hf",
                   f"run_dir={tmp_path / 'run'}", f"task_overrides=[{MISSING}]", "--no-progress"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    error = result.stderr[result.stderr.index("error:"):]
    assert "examples/custom_task/task.yaml" in error  # before any model is loaded
    assert "reward.function='examples.custom_task.reward:missing_function'" in error
    assert "has no function 'missing_function'; define it as def missing_function(response, sample)" in error
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_config_check_names_the_task_file_and_field_of_a_missing_reward_function() -> None:
    result = _run([*readme_command("config")[:3], "examples/custom_task/task.yaml", MISSING])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    error = result.stderr[result.stderr.index("error:"):]
    assert "examples/custom_task/task.yaml" in error
    assert "reward.function" in error and "missing_function" in error
