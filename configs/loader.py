"""Load YAML into typed configs: `extends:` inheritance, `a.b.c=value` overrides, readable errors.

Every problem is collected and reported at once, each naming the file (or the override), the field
path, the bad value and the fix. Nothing here knows the schema's content: it works for any
`StrictModel` subclass.

Not here: deciding defaults (they live in the schema) or touching the filesystem beyond reading the
given YAML files and writing the resolved config.
"""

from __future__ import annotations

import difflib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

T = TypeVar("T", bound=BaseModel)

EXTENDS_KEY = "extends"


class ConfigError(ValueError):
    """One or more config problems; `problems` lists them, the message shows them all."""

    def __init__(self, source: str, problems: Sequence[str]) -> None:
        self.source = source
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid config {source} ({len(self.problems)} problem(s)):\n{lines}")


def load_config(path: str | Path, schema: type[T], overrides: Sequence[str] = ()) -> T:
    """Read `path` (following `extends:`), apply `a.b.c=value` overrides, validate into `schema`."""
    path = Path(path)
    raw = read_yaml_tree(path)
    override_paths = apply_overrides(raw, overrides, source=str(path))
    return validate_config(raw, schema, source=str(path), override_paths=override_paths)


def read_yaml_tree(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a YAML mapping; a top-level `extends: other.yaml` (relative to this file) is merged
    underneath it (this file's keys win, mappings merge recursively)."""
    path = path.resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(str(path), [f"'{EXTENDS_KEY}' forms a cycle: {chain}; remove one of the links"])
    if not path.is_file():
        raise ConfigError(str(path), ["file not found; check the path (relative paths are from the "
                                      "current directory, or from the including file for 'extends')"])
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise ConfigError(str(path), [f"{where}not valid YAML ({getattr(exc, 'problem', exc)}); "
                                      "fix the syntax at that position"]) from exc
    if not isinstance(data, dict):
        raise ConfigError(str(path), [f"the top level must be a mapping of keys, got {type(data).__name__}"])
    parent = data.pop(EXTENDS_KEY, None)
    if parent is None:
        return data
    if not isinstance(parent, str):
        raise ConfigError(str(path), [f"'{EXTENDS_KEY}' must be a path string, got {parent!r}"])
    base = read_yaml_tree((path.parent / parent), (*_seen, path))
    return deep_merge(base, data)


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`; nested mappings merge, everything else is replaced. Inputs untouched.

    A tagged section whose `type` changes (e.g. objective vcpo → grpo) is replaced, not merged: the
    old variant's keys mean nothing to the new one.
    """
    merged = dict(base)
    for key, value in top.items():
        old = merged.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and _same_variant(old, value):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _same_variant(old: dict[str, Any], new: dict[str, Any]) -> bool:
    return new.get("type", old.get("type")) == old.get("type")


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str], source: str) -> set[tuple[str, ...]]:
    """Apply `a.b.c=value` overrides in place (value parsed as YAML: `1e-6`, `true`, `[1,2]`).

    Returns the overridden key paths, so validation errors can say the value came from the command
    line. Intermediate mappings are created; unknown keys are caught by validation. A `…type=X` that
    changes a tagged section's variant (e.g. `algo.objective.type=grpo` over vcpo) replaces the section
    by `{type: X}`, as `extends:` does (`deep_merge`): the old variant's keys mean nothing to the new
    one. Such overrides apply first, so `a.type=X a.key=v` and `a.key=v a.type=X` mean the same.
    """
    problems: list[str] = []
    paths: set[tuple[str, ...]] = set()
    type_first = sorted(overrides, key=lambda item: item.partition("=")[0].strip().split(".")[-1] != "type")
    for item in type_first:
        key, sep, text = item.partition("=")
        keys = tuple(key.strip().split("."))
        if not sep or not all(keys):
            problems.append(f"override '{item}': expected the form a.b.c=value (e.g. optim.lr=1e-6)")
            continue
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        node = raw
        for depth, part in enumerate(keys[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(f"override '{item}': '{'.'.join(keys[: depth + 1])}' is a value "
                                f"({child!r}), not a section; override it directly")
                break
            node = child
        else:
            if keys[-1] == "type" and "type" in node and node["type"] != value:
                node.clear()  # another variant: its old keys would only be reported as unknown
            node[keys[-1]] = value
            paths.add(keys)
    if problems:
        raise ConfigError(source, problems)
    return paths


def validate_config(
    raw: dict[str, Any], schema: type[T], source: str, override_paths: set[tuple[str, ...]] = frozenset()
) -> T:
    """Validate a raw mapping; on failure raise one ConfigError listing every problem."""
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        problems = [_describe(error, schema, override_paths) for error in exc.errors()]
        raise ConfigError(source, problems) from None


def _describe(error: Any, schema: type[BaseModel], override_paths: set[tuple[str, ...]]) -> str:
    loc = tuple(str(part) for part in error["loc"])
    field = ".".join(loc) or "<root>"
    origin = " (from a command-line override)" if _without_tags(schema, loc) in override_paths else ""
    kind = error["type"]
    if kind == "extra_forbidden":
        known = _known_fields(schema, loc[:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return (f"{field}{origin}: unknown key; {hint}valid keys here: {', '.join(sorted(known)) or 'none'}")
    if kind == "missing":
        return f"{field}: required but missing; add it ({_field_doc(schema, loc)})"
    value = error.get("input")
    msg = error["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if isinstance(value, dict):  # a cross-field rule of a whole section: the message names the fields
        return f"{field}{origin}: {msg}"
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return f"{field}{origin}: bad value {shown}: {msg}. Field: {_field_doc(schema, loc)}"


def _without_tags(schema: type[BaseModel], loc: tuple[str, ...]) -> tuple[str, ...]:
    """`loc` minus the tagged-union tags pydantic inserts (algo.objective.grpo.x → algo.objective.x)."""
    kept: list[str] = []
    for depth, part in enumerate(loc):
        parent = _walk(schema, loc[:depth])
        union_tags = {t for m in _model_types_at(schema, loc[:depth]) for t in _tags(m)}
        if parent is None and depth and part in union_tags:
            continue
        kept.append(part)
    return tuple(kept)


def _model_types_at(schema: type[BaseModel], loc: tuple[str, ...]) -> list[type[BaseModel]]:
    parent = _walk(schema, loc[:-1])
    field = parent.model_fields.get(loc[-1]) if parent is not None and loc else None
    return _model_types(field.annotation) if field is not None else []


def _walk(schema: type[BaseModel], loc: tuple[str, ...]) -> type[BaseModel] | None:
    """The model class at `loc`: follows nested models, list indices and tagged-union tags
    (pydantic puts the tag value in the error location, e.g. `algo.objective.grpo.clip_low`)."""
    candidates: list[type[BaseModel]] = [schema]
    for part in loc:
        if part.isdigit():  # a list index: same model(s)
            continue
        if len(candidates) == 1 and part in candidates[0].model_fields:
            candidates = _model_types(candidates[0].model_fields[part].annotation)
        else:
            candidates = [m for m in candidates if part in _tags(m)]
        if not candidates:
            return None
    return candidates[0] if len(candidates) == 1 else None


def _model_types(annotation: Any) -> list[type[BaseModel]]:
    """Every BaseModel class inside an annotation (plain, Optional, list[...], Annotated unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in getattr(annotation, "__args__", ()) or ():
        found.extend(_model_types(arg))
    origin = getattr(annotation, "__origin__", None)
    if not found and origin is not None and origin is not annotation:
        found = _model_types(origin)
    return found


def _tags(model: type[BaseModel]) -> tuple[Any, ...]:
    """The values of a tagged-union member's `type: Literal[...]` field (empty if none)."""
    field = model.model_fields.get("type")
    return tuple(getattr(field.annotation, "__args__", ()) or ()) if field is not None else ()


def _known_fields(schema: type[BaseModel], loc: tuple[str, ...]) -> list[str]:
    model = _walk(schema, loc)
    return list(model.model_fields) if model is not None else []


def _field_doc(schema: type[BaseModel], loc: tuple[str, ...]) -> str:
    if not loc:
        return "see the schema"
    model = _walk(schema, loc[:-1])
    field = model.model_fields.get(loc[-1]) if model is not None else None
    return (field.description or "undocumented") if field is not None else "see the schema"


def write_resolved_config(config: BaseModel, run_dir: Path, name: str = "config.yaml") -> Path:
    """Write the fully resolved config (defaults filled in) into the run directory, atomically."""
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / name
    text = yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=f".{name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
