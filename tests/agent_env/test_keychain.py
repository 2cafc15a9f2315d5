"""Keychain, the long-horizon tool task: the map in the sandbox is the generator's, one hop per block,
and a solver's episode through the real loop and sandbox is one tool turn per hop whose history is
compacted — the warm start's demonstrations, segment by segment."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agent_env.datasets import load_samples
from agent_env.demonstrations import SolverPolicy, scripted_demonstrations, solver_finishes
from agent_env.keychain import (
    SANDBOX_PREAMBLE,
    chain,
    generate_keychain_rows,
    hop_key,
    solver_summary,
    solver_turns,
)
from agent_env.turns import find_boxed
from configs.task_schema import GeneratorDataset
from run.train.warm_start import KEYCHAIN_SOLVER
from run.train.wiring import load_task
from tests.run.train.test_train_e2e import needs_bwrap

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "configs" / "tasks" / "keychain.yaml"


def test_rows_are_seeded_chains_of_six_to_nine_hops() -> None:
    rows = generate_keychain_rows(200, seed=3)
    assert rows == generate_keychain_rows(200, seed=3) and rows != generate_keychain_rows(200, seed=4)
    assert {row["hops"] for row in rows} == {6, 7, 8, 9}
    for row in rows[:20]:
        keys = chain(row["start"], row["hops"])
        assert row["answer"] == str(keys[-1]) and all(1000 <= key <= 9999 for key in keys)
        assert keys[1] == hop_key(row["start"])


def test_the_task_runs_the_generators_map_in_the_sandbox_once_per_block() -> None:
    task, _ = load_task(TASK)
    assert task.loop.preamble == SANDBOX_PREAMBLE  # the shipped task file carries the same map
    for key in (1000, 4321, 9999):
        fresh: dict = {}
        exec(compile(SANDBOX_PREAMBLE, "<preamble>", "exec"), fresh)  # our own text, as the sandbox runs it
        assert fresh["hop"](key) == hop_key(key)
        with pytest.raises(RuntimeError, match="once per code block"):
            fresh["hop"](key)


@pytest.mark.parametrize("stray", [{"max_numbers": 5}, {"min_target": 3}])
def test_countdown_settings_on_a_keychain_generator_are_refused(stray: dict) -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="do not apply to the keychain generator"):
        GeneratorDataset.model_validate({"name": "keychain", "num_samples": 4, **stray})


@pytest.mark.parametrize("name", ["countdown", "keychain"])
def test_a_dumped_generator_dataset_reloads_and_only_a_setting_that_differs_is_refused(name: str) -> None:
    """A run writes its task with every field (run_dir/task.yaml): the other generator's fields at their
    defaults change nothing and reload; one set to another value is still refused."""
    from pydantic import ValidationError

    dumped = GeneratorDataset.model_validate({"name": name, "num_samples": 4}).model_dump(mode="json")
    assert GeneratorDataset.model_validate(dumped).model_dump(mode="json") == dumped
    stray = {"countdown": {"max_hops": 12}, "keychain": {"max_number": 50}}[name]
    with pytest.raises(ValidationError, match=f"{next(iter(stray))} do not apply to the {name} generator"):
        GeneratorDataset.model_validate({**dumped, **stray})


def _policy() -> SolverPolicy:
    return SolverPolicy(lambda sample: solver_turns(int(sample.fields["start"]), int(sample.fields["hops"])),
                        lambda sample, done: solver_summary(int(sample.fields["start"]),
                                                            int(sample.fields["hops"]), done))


@needs_bwrap
@pytest.mark.parametrize("compaction", ["keep_last", "summarize"])
def test_a_solvers_episodes_through_the_real_loop_and_sandbox_are_compacted_demonstrations(
        default_model_dir: Path, compaction: str) -> None:
    """The solver plays the policy: every hop's output comes from the real sandbox, the loop compacts the
    history past its budget, and each segment is one demonstration whose trained text is the solver's."""
    task, path = load_task(TASK, [f"loop.context.compaction={compaction}", "dataset.num_samples=6"])
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    samples = load_samples(task, which="train", task_dir=path.parent).samples
    demos = scripted_demonstrations(task, samples, tokenizer, _policy(), count=3)
    assert len(demos) > 3  # three episodes, each compacted at least once
    trained_texts = [tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
                     for ids, mask in demos]
    finals = [text for text in trained_texts if "\\boxed{" in text]
    assert len(finals) == 3
    answers = {find_boxed(text) for text in finals}
    assert answers == {str(sample.answer) for sample in samples[:3]}
    for ids, mask in demos:
        assert len(ids) <= task.loop.max_total_tokens and not mask[0]
        trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        untrained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        assert "```output" not in trained and "Start at key" in untrained
        if compaction == "summarize" and "Summary:" in untrained:
            assert "is done; the current key is" in trained  # the summary is written, hence trained


def test_the_warm_starts_solver_refuses_a_sample_without_a_chain() -> None:
    from agent_env.samples import Sample

    with pytest.raises(ValueError, match="fields start and hops"):
        KEYCHAIN_SOLVER.turns(Sample(sample_id="x", fields={"numbers": [1, 2]}, answer="3"))


@needs_bwrap
def test_without_compaction_the_longest_chains_outgrow_the_budget(default_model_dir: Path) -> None:
    """What the task is for: a 9-hop episode does not fit loop.max_total_tokens unless its history is
    compacted — the loop truncates it, and no demonstration of it is written."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    kept = {}
    for compaction in ("none", "keep_last"):
        task, path = load_task(TASK, [f"loop.context.compaction={compaction}", "dataset.min_hops=9",
                                      "dataset.num_samples=2"])
        samples = load_samples(task, which="train", task_dir=path.parent).samples
        kept[compaction] = scripted_demonstrations(task, samples, tokenizer, _policy(), count=2)
    assert kept["none"] == [] and len(kept["keep_last"]) >= 4


@needs_bwrap
def test_the_solver_finishes_short_chains_inside_the_budget_and_long_ones_only_when_compacted(
        default_model_dir: Path) -> None:
    """`solver_finishes`: per sample, whether the solver's own episode ends inside the budget — the ceiling of
    a loop that only truncates (6 hops fit in 448 tokens, 9 do not), none with compaction."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    finished = {}
    for compaction in ("none", "keep_last"):
        for hops in (6, 9):
            task, path = load_task(TASK, [f"loop.context.compaction={compaction}", f"dataset.min_hops={hops}",
                                          f"dataset.max_hops={hops}", "dataset.num_samples=2"])
            samples = load_samples(task, which="train", task_dir=path.parent).samples
            result = solver_finishes(task, samples, tokenizer, _policy())
            assert set(result) == {sample.sample_id for sample in samples}
            finished[compaction, hops] = list(result.values())
    assert finished == {("none", 6): [True, True], ("none", 9): [False, False],
                        ("keep_last", 6): [True, True], ("keep_last", 9): [True, True]}
