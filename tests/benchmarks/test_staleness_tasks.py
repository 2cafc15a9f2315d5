"""The staleness benchmark's tasks: disjoint train/evaluation prompts, the answer formats, the
compact chat template, and pre-teaching that resumes exactly where an interrupted one stopped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from benchmarks.staleness import tasks as staleness_tasks
from benchmarks.staleness.schema import StalenessBenchConfig

METHOD = [{"name": "m", "algo": {"objective": {"type": "seq_tis"}}, "lr": 1e-3}]


def _bench(**changes: object) -> StalenessBenchConfig:
    raw = {"methods": METHOD, "task": "count", "count_min": 2, "count_max": 4, "hidden_size": 16,
           "num_layers": 1, "intermediate_size": 32, "pretrain_batch": 8, "pretrain_success": 0.99}
    return StalenessBenchConfig.model_validate({**raw, **changes})


def test_count_and_alphabet_problems_are_split_into_disjoint_train_and_evaluation_prompts() -> None:
    for task in ("count", "alphabet"):
        train, held_out = staleness_tasks.problems(_bench(task=task, count_max=6))
        assert train and held_out and not {p.prompt for p in train} & {p.prompt for p in held_out}
    train, _ = staleness_tasks.problems(_bench(count_min=3, count_max=3))
    sample = train[0]
    first, last = (int(x) for x in sample.prompt.split("-"))
    assert sample.answer == f"{first} {first + 1} {last}" and last == first + 2
    letters, _ = staleness_tasks.problems(_bench(task="alphabet", count_min=3, count_max=3))
    assert all(len(p.answer) == len("a, b, c") and p.prompt == f"{p.answer[0]}-{p.answer[-1]}"
               for p in letters)


def test_the_alphabet_separator_shapes_answers_pattern_and_policy_key(tmp_path: Path) -> None:
    arrows = _bench(task="alphabet", count_min=3, count_max=3, separator=" > ")
    train, held_out = staleness_tasks.problems(arrows)
    assert {p.answer for p in train + held_out} == {
        " > ".join(chr(ord("a") + i) for i in range(start, start + 3)) for start in range(24)}
    task = yaml.safe_load(staleness_tasks.task_file(arrows, tmp_path).read_text())
    pattern = re.compile(task["answer"]["pattern"])
    assert pattern.match("d > e > f") and not pattern.match("d, e, f")
    assert task["loop"]["max_new_tokens_per_turn"] == 4 * 3 + 4  # 1 + len(" > ") tokens per letter
    commas = _bench(task="alphabet", count_min=3, count_max=3)
    assert staleness_tasks.policy_fingerprint(arrows) != staleness_tasks.policy_fingerprint(commas)
    with pytest.raises(ValueError, match="separator"):
        _bench(task="alphabet", separator="x")  # a letter would make the answer ambiguous


def test_an_alphabet_range_longer_than_the_alphabet_is_refused() -> None:
    with pytest.raises(ValueError, match=r"count_max=27.*at most 26 letters"):
        _bench(task="alphabet", count_min=5, count_max=27)


def test_the_compact_template_renders_the_prompt_and_an_arrow() -> None:
    tokenizer = staleness_tasks._tokenizer(_bench())
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "17-41"}], add_generation_prompt=True,
                                        tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert tokenizer.decode(ids) == "17-41=>"


def test_pre_teaching_resumes_where_it_stopped_exactly_as_one_uninterrupted_run(tmp_path: Path) -> None:
    whole = staleness_tasks.pretrained_policy(_bench(pretrain_steps=100), tmp_path / "whole")
    halves = tmp_path / "halves"
    first = staleness_tasks.pretrained_policy(_bench(pretrain_steps=50), halves)
    second = staleness_tasks.pretrained_policy(_bench(pretrain_steps=100), halves)  # continues from step 50
    state = torch.load(next(halves.glob("teaching-*.pt")), weights_only=False)
    assert state["step"] == 100 and [s for s, _ in state["history"]] == [50, 100]
    want, got = load_file(whole / "model.safetensors"), load_file(second / "model.safetensors")
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    assert any(not torch.equal(load_file(first / "model.safetensors")[n], want[n]) for n in want)
