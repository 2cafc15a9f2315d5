"""Dataset loading: every format, dotted paths, bad rows skipped and counted, clear errors."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from agent_env.datasets import DatasetError, default_data_dir, load_samples, rows_to_samples
from agent_env.samples import Sample
from configs.task_schema import FieldMap, TaskConfig


def _task(dataset: dict[str, Any], fields: dict[str, Any] | None = None, **extra: Any) -> TaskConfig:
    return TaskConfig.model_validate({
        "name": "demo",
        "dataset": dataset,
        "fields": fields or {"answer": "answer", "template_fields": {"question": "question"}},
        "prompt": {"user": "{question}"},
        "reward": {"type": "exact_match"},
        **extra,
    })


def _jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_jsonl_bad_rows_are_skipped_and_counted_per_reason(tmp_path: Path) -> None:
    _jsonl(tmp_path / "rows.jsonl", [
        {"question": "1+1?", "answer": "2"},
        {"question": "no answer here"},
        {"question": "   ", "answer": "3"},
        {"question": "null answer", "answer": None},
        "{not json",
        [1, 2, 3],
        "",  # blank lines are not rows
        {"question": "2+2?", "answer": 4},
    ])
    loaded = load_samples(_task({"type": "file", "path": "rows.jsonl"}), task_dir=tmp_path)
    assert [s.sample_id for s in loaded.samples] == ["0", "6"]  # ids are row positions (blank line skipped)
    assert [s.answer for s in loaded.samples] == ["2", 4]
    assert loaded.samples[0].fields == {"question": "1+1?"}
    assert loaded.skip_reasons == {
        "missing field 'answer' (fields.answer)": 1,
        "empty field 'question' (fields.template_fields.question)": 1,
        "answer is None or empty ('answer', fields.answer)": 1,
        "line is not valid JSON": 1,
        "row is a list, not an object": 1,
    }
    assert loaded.skipped == 5
    assert loaded.source == str(tmp_path / "rows.jsonl")


def test_parquet_nested_paths_reach_into_lists_and_structs(tmp_path: Path) -> None:
    table = pa.table({
        "prompt": [[{"role": "user", "content": "What is 6*7?"}], [{"role": "user", "content": "3-1?"}],
                   [{"role": "user", "content": "5+5?"}]],
        "reward_model": [{"ground_truth": "42", "style": "rule"}, {"ground_truth": None, "style": "rule"},
                         {"ground_truth": "10", "style": "rule"}],
        "extra_info": [{"index": 7}, {"index": 8}, {"index": 9}],
        "unused": ["x", "y", "z"],
    })
    pq.write_table(table, tmp_path / "dapo.parquet")
    fields = {"id": "extra_info.index", "answer": "reward_model.ground_truth",
              "template_fields": {"question": "prompt.0.content"}}
    loaded = load_samples(_task({"type": "file", "path": "dapo.parquet"}, fields), task_dir=tmp_path)
    assert [(s.sample_id, s.fields["question"], s.answer) for s in loaded.samples] == [
        ("7", "What is 6*7?", "42"), ("9", "5+5?", "10")]
    assert loaded.skip_reasons == {"answer is None or empty ('reward_model.ground_truth', fields.answer)": 1}


def test_a_dict_answer_collects_several_columns_as_plain_python(tmp_path: Path) -> None:
    pq.write_table(pa.table({"target": [24, 10], "nums": [[3, 3, 8, 8], [1, 2, 7]]}), tmp_path / "cd.parquet")
    fields = {"answer": {"target": "target", "numbers": "nums"},
              "template_fields": {"numbers": "nums", "target": "target"}}
    task = _task({"type": "file", "path": "cd.parquet"}, fields, prompt={"user": "{numbers} -> {target}"})
    loaded = load_samples(task, task_dir=tmp_path)
    assert loaded.samples[0] == Sample(sample_id="0", fields={"numbers": [3, 3, 8, 8], "target": 24},
                                       answer={"target": 24, "numbers": [3, 3, 8, 8]})
    assert type(loaded.samples[1].answer["numbers"]) is list


def test_numpy_values_become_plain_python() -> None:
    np = pytest.importorskip("numpy")
    rows = [{"q": np.str_("hi"), "nums": np.array([1, 2]), "t": np.int64(3)}]
    field_map = FieldMap(answer={"target": "t", "numbers": "nums"}, template_fields={"question": "q"})
    sample = rows_to_samples(rows, field_map, source="memory").samples[0]
    assert sample.answer == {"target": 3, "numbers": [1, 2]}
    assert type(sample.answer["target"]) is int and type(sample.answer["numbers"][0]) is int


def test_csv_and_json_files_load(tmp_path: Path) -> None:
    (tmp_path / "aime.csv").write_text("id,problem,answer\n1,Find x.,70\n2,,5\n")
    (tmp_path / "rows.json").write_text(json.dumps([{"question": "a", "answer": "b"}]))
    fields = {"id": "id", "answer": "answer", "template_fields": {"question": "problem"}}
    loaded = load_samples(_task({"type": "file", "path": "aime.csv"}, fields), task_dir=tmp_path)
    assert [(s.sample_id, s.answer) for s in loaded.samples] == [("1", "70")]  # csv values are strings
    assert loaded.skip_reasons == {"empty field 'problem' (fields.template_fields.question)": 1}
    from_json = load_samples(_task({"type": "file", "path": "rows.json"}), task_dir=tmp_path)
    assert from_json.samples[0].answer == "b"


def test_a_json_object_instead_of_an_array_says_what_to_use(tmp_path: Path) -> None:
    (tmp_path / "rows.json").write_text(json.dumps({"question": "a", "answer": "b"}))
    with pytest.raises(DatasetError, match=r"expected a JSON array of row objects.*\.jsonl"):
        load_samples(_task({"type": "file", "path": "rows.json"}), task_dir=tmp_path)


def test_when_no_row_is_usable_the_error_names_file_field_and_fix(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "rows.jsonl", [{"question": "q", "reward_model": {"ground_truth": "1"}}] * 3)
    with pytest.raises(DatasetError) as info:
        load_samples(_task({"type": "file", "path": "rows.jsonl"}), task_dir=tmp_path)
    message = str(info.value)
    assert str(path) in message
    assert "none of the 3 row(s) is usable (missing field 'answer' (fields.answer): 3 row(s))" in message
    assert "Fix fields.answer" in message
    assert "The first row's fields are: question, reward_model.ground_truth." in message


def test_a_missing_file_names_the_path_and_the_setting(tmp_path: Path) -> None:
    expected = r"dataset file not found: .*nope\.jsonl \(dataset\.path='nope\.jsonl'\)"
    with pytest.raises(DatasetError, match=expected):
        load_samples(_task({"type": "file", "path": "nope.jsonl"}), task_dir=tmp_path)


def test_an_unknown_suffix_asks_for_the_format(tmp_path: Path) -> None:
    _jsonl(tmp_path / "rows.txt", [{"question": "q", "answer": "a"}])
    with pytest.raises(DatasetError, match=r"set dataset\.format"):
        load_samples(_task({"type": "file", "path": "rows.txt"}), task_dir=tmp_path)
    loaded = load_samples(_task({"type": "file", "path": "rows.txt", "format": "jsonl"}), task_dir=tmp_path)
    assert len(loaded.samples) == 1


def test_a_corrupt_parquet_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match=r"bad\.parquet: cannot read it as parquet"):
        load_samples(_task({"type": "file", "path": "bad.parquet"}), task_dir=tmp_path)


def test_data_dir_placeholder_uses_the_argument_then_the_environment(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    _jsonl(data / "rows.jsonl", [{"question": "q", "answer": "a"}])
    task = _task({"type": "file", "path": "{data_dir}/rows.jsonl"})
    assert len(load_samples(task, task_dir=tmp_path / "elsewhere", data_dir=data).samples) == 1
    assert default_data_dir({"VCPO_DATA_DIR": str(data)}) == data
    assert default_data_dir({}).parts[-2:] == ("shared", "data")


def test_limit_keeps_the_first_usable_samples(tmp_path: Path) -> None:
    good = [{"question": f"q{i}", "answer": i} for i in range(5)]
    _jsonl(tmp_path / "rows.jsonl", [{"question": "bad"}, *good])
    loaded = load_samples(_task({"type": "file", "path": "rows.jsonl", "limit": 3}), task_dir=tmp_path)
    assert [s.answer for s in loaded.samples] == [0, 1, 2]
    loaded = load_samples(_task({"type": "file", "path": "rows.jsonl"}), task_dir=tmp_path, limit=2)
    assert [s.answer for s in loaded.samples] == [0, 1]


def test_eval_uses_the_eval_dataset_and_its_own_field_map(tmp_path: Path) -> None:
    _jsonl(tmp_path / "train.jsonl", [{"question": "t", "answer": "1"}])
    _jsonl(tmp_path / "eval.jsonl", [{"problem": "e", "solution": "2"}])
    task = _task({"type": "file", "path": "train.jsonl"}, eval_dataset={
        "type": "file", "path": "eval.jsonl",
        "fields": {"answer": "solution", "template_fields": {"question": "problem"}}})
    assert load_samples(task, which="train", task_dir=tmp_path).samples[0].answer == "1"
    assert load_samples(task, which="eval", task_dir=tmp_path).samples[0].fields == {"question": "e"}
    no_eval = _task({"type": "file", "path": "train.jsonl"})
    assert load_samples(no_eval, which="eval", task_dir=tmp_path).samples[0].answer == "1"


def test_the_countdown_generator_feeds_the_same_field_map_as_the_parquet() -> None:
    fields = {"answer": {"target": "target", "numbers": "nums"},
              "template_fields": {"numbers": "nums", "target": "target"}}
    task = _task({"type": "generator", "name": "countdown", "num_samples": 20, "seed": 3}, fields,
                 prompt={"user": "{numbers} {target}"})
    first = load_samples(task, task_dir=Path("."))
    again = load_samples(task, task_dir=Path("."), limit=5)
    assert len(first.samples) == 20 and first.skipped == 0
    assert again.samples == first.samples[:5]
    assert first.source == "generator:countdown(seed=3)"


def _fake_datasets(monkeypatch: pytest.MonkeyPatch, load: Any) -> None:
    module = types.ModuleType("datasets")
    module.load_dataset = load  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_hub_rows_go_through_the_field_map(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def load(dataset_id: str, subset: str | None, split: str) -> list[dict[str, str]]:
        calls.append((dataset_id, subset, split))
        return [{"question": "q", "answer": "7"}]

    _fake_datasets(monkeypatch, load)
    task = _task({"type": "hub", "id": "openai/gsm8k", "subset": "main", "split": "test"})
    loaded = load_samples(task, task_dir=Path("."))
    assert calls == [("openai/gsm8k", "main", "test")]
    assert loaded.samples[0].answer == "7" and loaded.source == "hub:openai/gsm8k[test]"


def test_an_unreachable_hub_dataset_suggests_a_local_file(monkeypatch: pytest.MonkeyPatch) -> None:
    def load(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("no network")

    _fake_datasets(monkeypatch, load)
    with pytest.raises(DatasetError, match=r"could not load hub dataset 'org/x'.*offline\? give a local path "
                                           r"via dataset\.type=file"):
        load_samples(_task({"type": "hub", "id": "org/x"}), task_dir=Path("."))
