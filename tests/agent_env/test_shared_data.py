"""The shipped tasks against the real benchmark files in ../shared/data (skipped when absent).

Every dataset loads with no skipped rows, every gold answer is accepted by its own reward when
written the way a model would, and clearly wrong answers are rejected.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from agent_env.countdown import score_expression, solve
from agent_env.datasets import load_samples
from agent_env.rewards import build_reward, gsm8k_gold_number, math_answers_match
from agent_env.samples import Sample
from cli.config_catalog import CONFIG_ROOT
from configs.task_schema import AnswerConfig, RewardConfig, load_task_config

TASKS = sorted((CONFIG_ROOT / "tasks").glob("*.yaml"))


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("which", ["train", "eval"])
@pytest.mark.parametrize("path", TASKS, ids=lambda p: p.stem)
def test_every_shipped_task_loads_its_data_without_skips(path: Path, which: str, shared_data: Path) -> None:
    task = load_task_config(path)
    limit = 20 if which == "train" and task.dataset.type == "generator" else None
    loaded = load_samples(task, which=which, task_dir=path.parent, data_dir=shared_data, limit=limit)
    assert loaded.skipped == 0, loaded.skip_reasons
    assert loaded.samples
    sample = loaded.samples[0]
    task.prompt.user.format(**sample.fields)  # every placeholder has a value
    assert len({s.sample_id for s in loaded.samples}) == len(loaded.samples)  # ids are unique


def test_expected_row_counts(shared_data: Path) -> None:
    def count(name: str, which: str) -> int:
        task = load_task_config(CONFIG_ROOT / "tasks" / f"{name}.yaml")
        return len(load_samples(task, which=which, task_dir=CONFIG_ROOT, data_dir=shared_data).samples)

    assert (count("gsm8k", "train"), count("gsm8k", "eval")) == (7473, 1319)
    assert count("math500", "eval") == 500
    assert count("aime2025", "eval") == 30
    assert count("dapo_math", "train") == 17917
    assert (count("countdown_tinyzero", "train"), count("countdown_tinyzero", "eval")) == (10240, 1024)


# ---------------------------------------------------------------------------------------------
# MATH-500 and AIME with math-verify (all 500 + 30 rows take ~5 s)


def test_every_math500_gold_verifies_against_itself(shared_data: Path) -> None:
    reward = build_reward(RewardConfig(type="math_verify"), AnswerConfig())
    failures = []
    for row in _jsonl(shared_data / "math500" / "test.jsonl"):
        gold = row["answer"]
        sample = Sample(sample_id=row["unique_id"], fields={}, answer=gold)
        if not reward(f"The answer is \\boxed{{{gold}}}.", sample).is_correct:
            failures.append(("boxed", gold))
        if not math_answers_match(gold, f"${gold}$"):
            failures.append(("dollar", gold))
    assert not failures


def test_wrong_math500_answers_are_rejected(shared_data: Path) -> None:
    golds = [row["answer"] for row in _jsonl(shared_data / "math500" / "test.jsonl")]

    def value_text(answer: str) -> str:  # 'x = 5' and '5' state the same value
        return answer.rpartition("=")[2].replace(" ", "")

    accepted = []
    for index, gold in enumerate(golds):
        if gold.isdigit():  # a plain integer: gold + 1 is wrong
            wrong = str(int(gold) + 1)
        else:  # the next problem's answer that states another value
            others = golds[index + 1 :] + golds[:index]
            wrong = next(o for o in others if value_text(o) != value_text(gold) and "=" not in o)
        if math_answers_match(gold, wrong):
            accepted.append((gold, wrong))
    assert not accepted


def test_every_aime2025_answer_verifies_also_zero_padded(shared_data: Path) -> None:
    rows = _jsonl(shared_data / "aime2025" / "aime2025_matharena.jsonl")
    assert len(rows) == 30
    reward = build_reward(RewardConfig(type="math_verify"), AnswerConfig())
    for row in rows:
        answer = int(row["answer"])
        sample = Sample(sample_id=row["id"], fields={}, answer=row["answer"])
        assert reward(f"\\boxed{{{answer}}}", sample).is_correct, row["id"]
        assert reward(f"\\boxed{{{answer:03d}}}", sample).is_correct, row["id"]  # 25 vs "025"
        assert not reward(f"\\boxed{{{answer + 1}}}", sample).is_correct, row["id"]


def test_aime2024_zero_padded_golds_match_plain_integers(shared_data: Path) -> None:
    for row in _jsonl(shared_data / "aime2024" / "test.jsonl"):
        gold = row["answer"]  # a zero-padded string such as "025"
        assert math_answers_match(gold, str(int(gold))), gold


# ---------------------------------------------------------------------------------------------
# GSM8K


def test_gsm8k_final_answers_are_extracted_from_every_row(shared_data: Path) -> None:
    rows = _jsonl(shared_data / "gsm8k" / "test.jsonl") + _jsonl(shared_data / "gsm8k" / "train.jsonl")
    assert all(gsm8k_gold_number(row["answer"]) is not None for row in rows)
    assert gsm8k_gold_number(rows[0]["answer"]) == 18  # Janet's ducks: (16 - 3 - 4) * 2 = 18


def test_gsm8k_reward_accepts_every_test_gold(shared_data: Path) -> None:
    reward = build_reward(RewardConfig(type="gsm8k"), AnswerConfig())
    for index, row in enumerate(_jsonl(shared_data / "gsm8k" / "test.jsonl")):
        final = row["answer"].rpartition("####")[2].strip()
        sample = Sample(sample_id=str(index), fields={}, answer=row["answer"])
        assert reward(f"\\boxed{{{final}}}", sample).is_correct, final
        assert not reward(f"\\boxed{{{gsm8k_gold_number(final) + 1}}}", sample).is_correct, final


# ---------------------------------------------------------------------------------------------
# Countdown (TinyZero test split)


def test_every_tinyzero_countdown_row_is_solved_and_corruptions_fail(shared_data: Path) -> None:
    task = load_task_config(CONFIG_ROOT / "tasks" / "countdown_tinyzero.yaml")
    samples = load_samples(task, which="eval", task_dir=CONFIG_ROOT, data_dir=shared_data).samples
    reward = build_reward(task.reward, task.answer)
    assert len(samples) == 1024
    for sample in samples:
        numbers, target = sample.answer["numbers"], sample.answer["target"]
        equation = solve(numbers, target)
        assert equation is not None, sample.answer
        assert reward(f"<answer>{equation}</answer>", sample).score == 1.0
        changed = re.sub(r"\d+", lambda m: str(int(m.group()) + 1000), equation, count=1)
        assert not score_expression(changed, numbers, target)               # one number changed
        assert not score_expression(equation, [*numbers, 1], target)        # a given number left unused
        twice = f"({equation}) * {numbers[0]} / {numbers[0]}"               # same value, a number used twice
        assert not score_expression(twice, numbers, target)
        assert not score_expression(equation, numbers, target + 1)          # target changed


def test_every_distinct_dapo_ground_truth_verifies_against_itself(shared_data: Path) -> None:
    import pyarrow.parquet as pq

    table = pq.read_table(shared_data / "dapo_math_17k" / "dapo_math_17k.parquet", columns=["reward_model"])
    golds = sorted({row["ground_truth"] for row in table.column("reward_model").to_pylist()})
    assert len(golds) > 2000  # integer strings, some negative or > 1e6
    assert [gold for gold in golds if not math_answers_match(gold, gold)] == []
