"""Turn a task's dataset (file, hub or generator) into `Sample`s.

Rows are read as plain Python (dicts, lists, strings, numbers; parquet and numpy values are
converted), then mapped through the task's `FieldMap`: dotted paths such as `prompt.0.content`
pick the template fields, the ground truth and optionally an id.

One bad row never stops a load: rows with a missing or empty field, a None or non-JSON-able
answer, or an unparseable JSON line are skipped and counted per reason (`DatasetLoad.skip_reasons`).
A `DatasetError` is raised only when the source cannot be read at all or no row is usable; it names
the file, the field path and the setting to fix.

Not here: prompt rendering and tokenisation (the agent loop), scoring (agent_env/rewards.py).
Hub datasets need the optional `datasets` package and network (or a warm HF cache).
"""

from __future__ import annotations

import csv
import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from agent_env.countdown import generate_countdown_rows
from agent_env.keychain import generate_keychain_rows
from agent_env.samples import Sample
from configs.task_schema import (
    DATA_DIR_PLACEHOLDER,
    DatasetConfig,
    FieldMap,
    FileDataset,
    GeneratorDataset,
    HubDataset,
    TaskConfig,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR_ENV = "VCPO_DATA_DIR"
"""Environment variable naming the data folder that replaces `{data_dir}` in dataset paths."""

_FORMATS_BY_SUFFIX = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DatasetError(ValueError):
    """A dataset that cannot be used at all: missing or unreadable, or without one usable row."""


class DatasetLoad(BaseModel):
    """The usable samples of a dataset and an account of the rows that were skipped."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    samples: list[Sample]
    """The usable rows as samples, in file order (at most `limit` of them)."""
    skipped: int
    """How many rows were skipped (the sum of `skip_reasons`)."""
    skip_reasons: dict[str, int]
    """Why rows were skipped → how many, e.g. {"missing field 'answer' (fields.answer)": 2}."""
    source: str = ""
    """Where the rows came from (file path, hub id or generator), for logs."""


def default_data_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """The folder `{data_dir}` stands for: $VCPO_DATA_DIR, else `../shared/data` beside the repo."""
    value = environ.get(DATA_DIR_ENV)
    return Path(value).expanduser() if value else REPO_ROOT.parent / "shared" / "data"


def load_samples(
    task: TaskConfig,
    *,
    which: Literal["train", "eval", "heldout"] = "train",
    task_dir: Path,
    data_dir: Path | None = None,
    limit: int | None = None,
) -> DatasetLoad:
    """The samples of the task's training dataset, of its eval dataset (`eval_dataset`, else
    `dataset`), or of its held-out dataset (`heldout_dataset`; an error without one). `task_dir` is the
    task file's folder (relative paths start there); `data_dir` replaces `{data_dir}` (None =
    `default_data_dir()`); `limit` (else the dataset's own `limit`) keeps the first N usable samples."""
    if which == "heldout":
        if task.heldout_dataset is None:
            raise ValueError(f"task {task.name!r} has no heldout_dataset; add one to the task file (e.g. the "
                             "training generator with another seed) or set trainer.eval_every=0")
        dataset, section = task.heldout_dataset, "heldout_dataset"
    elif which == "eval" and task.eval_dataset is not None:
        dataset, section = task.eval_dataset, "eval_dataset"
    else:
        dataset, section = task.dataset, "dataset"
    field_map, map_name = (dataset.fields, f"{section}.fields") if dataset.fields else (task.fields, "fields")
    limit = limit if limit is not None else dataset.limit
    rows, source = _read_rows(dataset, section, task_dir, data_dir, limit, field_map)
    return rows_to_samples(rows, field_map, source=source, map_name=map_name, limit=limit)


def resolve_dataset_path(dataset: FileDataset, task_dir: Path, data_dir: Path | None = None) -> Path:
    """The file a `file` dataset names: `{data_dir}` replaced, relative paths from `task_dir`."""
    text = dataset.path.replace(DATA_DIR_PLACEHOLDER, str(data_dir or default_data_dir()))
    path = Path(text).expanduser()
    return path if path.is_absolute() else Path(task_dir) / path


# ---------------------------------------------------------------------------------------------
# Rows → samples


@dataclass(frozen=True)
class _BadRow:
    """A row that could not even be read (e.g. invalid JSON); carries the skip reason."""

    reason: str


class _Skip(Exception):
    """Internal: this row is unusable for `reason` (counted, never raised to the caller)."""

    def __init__(self, reason: str, setting: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.setting = setting


def rows_to_samples(rows: Iterable[Any], field_map: FieldMap, *, source: str, map_name: str = "fields",
                    limit: int | None = None) -> DatasetLoad:
    """Map rows through `field_map`, skipping and counting bad rows; raise DatasetError if none is
    usable. `map_name` is how the field map is named in errors (e.g. `eval_dataset.fields`)."""
    samples: list[Sample] = []
    reasons: Counter[str] = Counter()
    settings: set[str] = set()
    first_row: Any = None
    total = 0
    for index, row in enumerate(rows):
        if limit is not None and len(samples) >= limit:
            break
        total += 1
        first_row = row if first_row is None else first_row
        try:
            samples.append(_row_to_sample(row, index, field_map, map_name))
        except _Skip as skip:
            reasons[skip.reason] += 1
            settings.add(skip.setting)
    if not samples:
        raise DatasetError(_nothing_usable(source, total, reasons, settings, first_row))
    return DatasetLoad(samples=samples, skipped=sum(reasons.values()), skip_reasons=dict(reasons),
                       source=source)


def _row_to_sample(row: Any, index: int, field_map: FieldMap, map_name: str) -> Sample:
    if isinstance(row, _BadRow):
        raise _Skip(row.reason, "the data file")
    if not isinstance(row, Mapping):
        raise _Skip(f"row is a {type(row).__name__}, not an object", "the data file")
    sample_id = str(index)
    if field_map.id is not None:
        value = _to_plain(_field(row, field_map.id, f"{map_name}.id"))
        if value is None or str(value).strip() == "":
            raise _Skip(f"empty field '{field_map.id}' ({map_name}.id)", f"{map_name}.id")
        sample_id = str(value)
    fields: dict[str, Any] = {}
    for name, path in field_map.template_fields.items():
        setting = f"{map_name}.template_fields.{name}"
        value = _to_plain(_field(row, path, setting))
        if value is None or (isinstance(value, str) and not value.strip()):
            raise _Skip(f"empty field '{path}' ({setting})", setting)
        fields[name] = value
    return Sample(sample_id=sample_id, fields=fields, answer=_answer(row, field_map.answer, map_name))


def _answer(row: Mapping[str, Any], spec: str | dict[str, str], map_name: str) -> Any:
    setting = f"{map_name}.answer"
    if isinstance(spec, str):
        answer = _to_plain(_field(row, spec, setting))
        missing = answer is None or (isinstance(answer, str) and not answer.strip())
        where = spec
    else:
        answer = {name: _to_plain(_field(row, path, f"{setting}.{name}")) for name, path in spec.items()}
        missing = any(value is None for value in answer.values())
        where = ", ".join(spec.values())
    if missing:
        raise _Skip(f"answer is None or empty ('{where}', {setting})", setting)
    try:
        json.dumps(answer, allow_nan=False)
    except (TypeError, ValueError):
        raise _Skip(f"answer is not JSON-able ('{where}', {setting})", setting) from None
    return answer


def _field(row: Mapping[str, Any], path: str, setting: str) -> Any:
    """The value at a dotted path (`a.b.0.c`: mapping keys and list indices)."""
    node: Any = row
    for part in path.split("."):
        if isinstance(node, Mapping) and part in node:
            node = node[part]
            continue
        node = _to_plain(node)
        if isinstance(node, list) and part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
            node = node[int(part)]
            continue
        raise _Skip(f"missing field '{path}' ({setting})", setting)
    return node


def _to_plain(value: Any) -> Any:
    """Plain Python for JSON: numpy arrays/scalars via `.tolist()`, tuples as lists, recursively."""
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {str(key): _to_plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(item) for item in value]
    to_list = getattr(value, "tolist", None)  # numpy / pandas values, without importing numpy
    return _to_plain(to_list()) if callable(to_list) else value


def _nothing_usable(source: str, total: int, reasons: Counter[str], settings: set[str],
                    first_row: Any) -> str:
    if total == 0:
        return f"{source}: the dataset has no rows; check the file or the dataset settings"
    listed = "; ".join(f"{reason}: {count} row(s)" for reason, count in reasons.most_common())
    keys = ""
    if isinstance(first_row, Mapping):
        keys = f" The first row's fields are: {', '.join(_paths(first_row))}."
    fix = ", ".join(sorted(settings))
    return (f"{source}: none of the {total} row(s) is usable ({listed}). Fix {fix} to name a path that "
            f"exists in the rows (dotted, e.g. prompt.0.content).{keys}")


def _paths(row: Mapping[str, Any], prefix: str = "", depth: int = 0) -> list[str]:
    """Dotted paths of a row's nested mapping keys (two levels deep), to suggest in errors."""
    found: list[str] = []
    for key, value in row.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and depth < 1:
            found.extend(_paths(value, f"{path}.", depth + 1))
        else:
            found.append(path)
    return found


# ---------------------------------------------------------------------------------------------
# Reading rows


def _read_rows(dataset: DatasetConfig, section: str, task_dir: Path, data_dir: Path | None, limit: int | None,
               field_map: FieldMap) -> tuple[Iterable[Any], str]:
    if isinstance(dataset, FileDataset):
        path = resolve_dataset_path(dataset, task_dir, data_dir)
        return _read_file(path, dataset, section, field_map), str(path)
    if isinstance(dataset, HubDataset):
        return _read_hub(dataset, section), f"hub:{dataset.id}[{dataset.split}]"
    assert isinstance(dataset, GeneratorDataset)
    count = dataset.num_samples if limit is None else min(limit, dataset.num_samples)
    if dataset.name == "keychain":
        rows = generate_keychain_rows(count, dataset.seed, min_hops=dataset.min_hops,
                                      max_hops=dataset.max_hops)
        return rows, f"generator:keychain(seed={dataset.seed})"
    rows = generate_countdown_rows(
        count, dataset.seed, min_numbers=dataset.min_numbers, max_numbers=dataset.max_numbers,
        max_number=dataset.max_number, min_target=dataset.min_target, max_target=dataset.max_target)
    return rows, f"generator:{dataset.name}(seed={dataset.seed})"


def _read_file(path: Path, dataset: FileDataset, section: str, field_map: FieldMap) -> Iterator[Any]:
    if not path.is_file():
        raise DatasetError(
            f"dataset file not found: {path} ({section}.path={dataset.path!r}). Fix the path; "
            f"{DATA_DIR_PLACEHOLDER} is ${DATA_DIR_ENV} or ../shared/data beside the repo, relative "
            "paths start at the task file's folder")
    file_format = dataset.format
    if file_format == "auto":
        file_format = _FORMATS_BY_SUFFIX.get(path.suffix.lower(), "")
        if not file_format:
            raise DatasetError(f"{path}: cannot tell the format from the suffix {path.suffix!r}; "
                               f"set {section}.format to one of jsonl, json, parquet, csv")
    readers = {"jsonl": _read_jsonl, "json": _read_json, "csv": _read_csv}
    try:
        if file_format == "parquet":
            return _read_parquet(path, _top_level_columns(field_map))
        return readers[file_format](path)
    except (OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
        if isinstance(exc, DatasetError):
            raise
        raise DatasetError(f"{path}: cannot read it as {file_format} ({exc}); check the file or set "
                           f"{section}.format") from exc


def _read_jsonl(path: Path) -> Iterator[Any]:
    lines = path.read_text(encoding="utf-8").splitlines()  # read now, so I/O errors surface here
    return (_json_line(line) for line in lines if line.strip())


def _json_line(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return _BadRow("line is not valid JSON")


def _read_json(path: Path) -> Iterator[Any]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON array of row objects, got a {type(data).__name__}; "
                           "for one object per line use a .jsonl file (or format: jsonl)")
    return iter(data)


def _read_csv(path: Path) -> Iterator[Any]:
    with path.open(newline="", encoding="utf-8") as handle:
        return iter(list(csv.DictReader(handle)))


def _read_parquet(path: Path, columns: list[str]) -> Iterator[Any]:
    """Only the columns the field map uses are read; rows are converted batch by batch."""
    import pyarrow.parquet as pq  # heavy import, needed only for parquet files

    parquet = pq.ParquetFile(path)
    present = [name for name in columns if name in parquet.schema_arrow.names]
    # Keep the row count even when no requested column exists: every row is then "missing field".
    read_columns = present or parquet.schema_arrow.names[:1]
    table = parquet.read(columns=read_columns)
    return (
        {key: value for key, value in row.items() if key in present}
        for batch in table.to_batches(max_chunksize=1024)
        for row in batch.to_pylist()
    )


def _top_level_columns(field_map: FieldMap) -> list[str]:
    answer = field_map.answer
    answer_paths = [answer] if isinstance(answer, str) else list(answer.values())
    paths = [*answer_paths, *field_map.template_fields.values(), *([field_map.id] if field_map.id else [])]
    return sorted({path.split(".")[0] for path in paths})


def _read_hub(dataset: HubDataset, section: str) -> Iterator[Any]:
    hint = f"offline? give a local path via {section}.type=file ({section}.path: ...)"
    try:
        import datasets  # optional, heavy; imported only for hub datasets
    except ImportError as exc:
        raise DatasetError(f"hub dataset {dataset.id!r} needs the `datasets` package ({exc}); "
                           f"pip install datasets, or {hint}") from exc
    try:
        loaded = datasets.load_dataset(dataset.id, dataset.subset, split=dataset.split)
    except Exception as exc:  # datasets raises many types (network, not found, bad split)
        raise DatasetError(f"could not load hub dataset {dataset.id!r} (subset={dataset.subset!r}, "
                           f"split={dataset.split!r}): {type(exc).__name__}: {exc}; {hint}") from exc
    return iter(loaded)
