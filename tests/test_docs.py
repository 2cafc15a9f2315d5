"""The docs stay true to the code they describe.

Every user-facing doc (README.md, docs/*.md, examples/**/README.md):

* names only repo paths that exist — a path in backticks or a code block that starts with one of the
  repo's top-level folders, and every relative markdown link;
* refers to nothing outside the repo (no `../` paths, no design docs of a shared folder, no `.md`
  file the repo does not have);
* spells every `vcpo …` command as the real CLI parses it: a real subcommand, real choices
  (`vcpo bench NAME`, `vcpo config check`), options that subcommand's argparse parser accepts (the
  parser is built by `cli.main._build_parser`, not copied here), and `a.b.c=value` overrides
  that name real fields of the config they apply to.

docs/README.md indexes every page of docs/. docs/task_yaml.md documents every field of `TaskConfig`
(walked recursively) and of every built-in tool's settings, with the schema's defaults, and lists no
field that does not exist; its complete example validates. The last tests feed each check a broken
snippet, so none of them can silently pass everything.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
REPO_DIRS = (".ci", "agent_env", "benchmarks", "cli", "configs", "docs", "learner", "rollout", "run",
             "scripts", "tests", "tools", "vcpo")
"""The repo's top-level folders: a path in code that starts with one of them names a repo file."""
REPO_FILES = ("README.md", "pyproject.toml")


def _docs() -> list[str]:
    found = {"README.md"}
    found.update(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    found.update(p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("**/README.md"))
    return sorted(found)


DOCS = _docs()


def test_the_repo_folders_named_here_exist() -> None:
    assert all((ROOT / name).exists() for name in (*REPO_DIRS, *REPO_FILES))


# ---------------------------------------------------------------------------------------------
# Reading markdown: fenced code blocks, inline code spans, link targets


@dataclass
class Markdown:
    text: str
    blocks: list[str] = field(default_factory=list)
    """Fenced code blocks, each with backslash-continued lines joined."""
    spans: list[str] = field(default_factory=list)
    """Inline code spans outside fenced blocks (may span lines within a paragraph)."""
    links: list[str] = field(default_factory=list)
    """Markdown link and image targets outside code."""
    fences: list[tuple[int, int | None, str]] = field(default_factory=list)
    """(first line, closing line or None when never closed, info string) of each fenced block."""


_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def parse_markdown(text: str) -> Markdown:
    md = Markdown(text)
    prose: list[str] = []
    fence: str | None = None
    block: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        match = _FENCE.match(line)
        if match and match.group(1)[0] == "`" and "`" in line.strip()[len(match.group(1)):]:
            match = None  # CommonMark: a backtick fence's info string holds no backtick (```a``` is code)
        if fence is None and match:
            fence, block = match.group(1), []
            md.fences.append((number, None, line.strip()[len(fence):].strip()))
            prose.append("")
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            md.blocks.append(re.sub(r"\\\n\s*", " ", "\n".join(block)))
            md.fences[-1] = (md.fences[-1][0], number, md.fences[-1][2])
            fence = None
        elif fence is not None:
            block.append(line)
        else:
            prose.append(line)
    for paragraph in re.split(r"\n\s*\n", "\n".join(prose)):
        md.spans.extend(m.group(2).strip() for m in _SPAN.finditer(paragraph))
        md.links.extend(_LINK.findall(_SPAN.sub("", paragraph)))
    return md


def _code_lines(md: Markdown, *, without_comments: bool = False) -> Iterator[str]:
    """Every code block line and every code span (a span's line breaks become spaces); with
    `without_comments`, a block line loses its `# comment`."""
    for block in md.blocks:
        for line in block.splitlines():
            yield re.split(r"(?:^|\s)#", line, maxsplit=1)[0] if without_comments else line
    for span in md.spans:
        yield " ".join(span.split())


# ---------------------------------------------------------------------------------------------
# Check 1: repo paths exist

_TOP = "|".join(re.escape(name) for name in REPO_DIRS)
_REPO_PATH = re.compile(rf"(?<![\w./~$@:-])((?:{_TOP})/[\w./-]*|(?:README\.md|pyproject\.toml)(?![\w.-]))")
_EXTERNAL_LINK = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|#)", re.IGNORECASE)


def _looks_like_a_path(token: str) -> bool:
    """`rollout/manager.py`, `docs/`, `learner/traj_grads/x`, but not a metric key (`rollout/turns_mean`)."""
    return token.endswith("/") or "." in token.rsplit("/", 1)[-1] or token.count("/") >= 2


def named_paths(md: Markdown) -> set[str]:
    found = {m.group(1).rstrip(".") for line in _code_lines(md) for m in _REPO_PATH.finditer(line)}
    return {token for token in found if _looks_like_a_path(token)}


def path_problems(doc: str, text: str) -> list[str]:
    md = parse_markdown(text)
    problems = [f"`{path}` does not exist" for path in sorted(named_paths(md)) if not (ROOT / path).exists()]
    for target in md.links:
        if _EXTERNAL_LINK.match(target):
            continue
        path = ((ROOT / doc).parent / target.split("#")[0].split("?")[0]).resolve()
        if path.is_relative_to(ROOT) and not path.exists():
            problems.append(f"link ({target}) points at nothing")
    return problems


@pytest.mark.parametrize("doc", DOCS)
def test_named_paths_exist(doc: str) -> None:
    text = (ROOT / doc).read_text()
    md = parse_markdown(text)
    if not doc.startswith("examples/"):
        assert named_paths(md) or md.links, f"{doc} names no repo path (the parser is wrong)"
    assert not path_problems(doc, text), f"{doc}: {path_problems(doc, text)}"


def fence_problems(text: str) -> list[str]:
    """Fenced blocks that swallow prose: a line starting with ``` opens a code block (CommonMark, as
    GitHub renders it) — an info string of several words is a sentence that begins with a fence."""
    problems = []
    for start, end, info in parse_markdown(text).fences:
        if end is None:
            problems.append(f"the code block opened on line {start} is never closed")
        elif len(info.split()) > 1:
            problems.append(f"line {start} starts with a fence ({info[:40]!r}…): lines {start}–{end} render "
                            "as one code block; move the backticks off the start of the line")
    return problems


@pytest.mark.parametrize("doc", DOCS)
def test_no_code_block_swallows_prose(doc: str) -> None:
    problems = fence_problems((ROOT / doc).read_text())
    assert not problems, f"{doc}: {problems}"


# ---------------------------------------------------------------------------------------------
# Check 2: nothing outside the repo

_OUTSIDE = [re.compile(r"\.\./shared"), re.compile(r"shared/docs"), re.compile(r"shared folder")]
_DOTDOT = re.compile(r"(?<![\w.])\.\./[\w./-]*")
_MD_NAME = re.compile(r"(?<![\w./-])([\w./-]*\w\.md)\b")


def _repo_markdown_names() -> set[str]:
    names = {name for name in REPO_FILES if name.endswith(".md")}
    for folder in REPO_DIRS:
        names.update(p.name for p in (ROOT / folder).rglob("*.md"))
    return names


def outside_problems(doc: str, text: str) -> list[str]:
    md = parse_markdown(text)
    problems = [f"mentions {m.group(0)!r}" for pattern in _OUTSIDE for m in pattern.finditer(text)]
    problems += [f"code names {m.group(0)!r} outside the repo" for line in _code_lines(md)
                 for m in _DOTDOT.finditer(line)]
    for target in md.links:
        if not _EXTERNAL_LINK.match(target):
            path = ((ROOT / doc).parent / target.split("#")[0]).resolve()
            if not path.is_relative_to(ROOT):
                problems.append(f"link ({target}) leaves the repo")
    return problems + missing_markdown(doc, text)


def missing_markdown(path: str, text: str, also_known: frozenset[str] = frozenset()) -> list[str]:
    """The `*.md` names in `text` that are neither beside `path`, at the repo root, nor a repo document."""
    known = _repo_markdown_names() | also_known
    return [f"refers to {name}, which the repo does not have"
            for name in sorted({m.group(1) for m in _MD_NAME.finditer(text)})
            if not ((ROOT / name).exists() or ((ROOT / path).parent / name).exists()
                    or Path(name).name in known)]


@pytest.mark.parametrize("doc", DOCS)
def test_no_doc_refers_to_files_outside_the_repo(doc: str) -> None:
    problems = outside_problems(doc, (ROOT / doc).read_text())
    assert not problems, f"{doc}: {problems}"


# ---------------------------------------------------------------------------------------------
# Check 2b: code and configs point only at documents the repo has, and carry no work-log history
# (an issue number or a session belongs in a commit message or a note, not in a comment)

_SOURCE_SUFFIXES = (".py", ".yaml", ".yml", ".sh")
_HISTORY = [re.compile(r"\b[Ii]ssues? #\d+"),
            re.compile(r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
                       r"|\d+(?:st|nd|rd|th)) session\b", re.IGNORECASE)]


def _sources() -> list[str]:
    this = Path(__file__).resolve()
    return sorted(str(p.relative_to(ROOT)) for folder in REPO_DIRS if folder != "docs"
                  for p in (ROOT / folder).rglob("*") if p.suffix in _SOURCE_SUFFIXES and p.is_file()
                  and p.resolve() != this and "__pycache__" not in p.parts)


SOURCES = _sources()


# files the code writes (a benchmark's report), not documents it points a reader at
_WRITTEN = frozenset({"summary.md"})


def source_problems(path: str, text: str) -> list[str]:
    problems = [f"mentions {m.group(0)!r}" for m in re.finditer(r"(?:\.\./)?shared/docs\b[\w./-]*", text)]
    problems += missing_markdown(path, text, _WRITTEN)
    problems += [f"history in code: {m.group(0)!r}" for pattern in _HISTORY for m in pattern.finditer(text)]
    return problems


def test_the_source_scan_covers_the_packages_configs_and_scripts() -> None:
    assert {"vcpo/opob.py", "configs/default.yaml", "scripts/run.sh",
            "run/train/trainer.py"} <= set(SOURCES)


@pytest.mark.parametrize("path", SOURCES)
def test_no_source_refers_to_missing_docs_or_carries_history(path: str) -> None:
    problems = source_problems(path, (ROOT / path).read_text(errors="replace"))
    assert not problems, f"{path}: {problems}"


@pytest.mark.parametrize("snippet", [
    "# See ../shared/docs/VCPO.md for the math.",
    '"""The layers (ARCHITECTURE.md)."""',
    "# measured in docs/results.md, " + "issue" + " #19",  # assembled: this file carries no history itself
    "# since the " + "seventh" + " session the proximal pass is reused",
])
def test_the_source_check_catches_a_bad_reference_or_history(snippet: str) -> None:
    assert source_problems("vcpo/example.py", snippet)


def test_the_source_check_accepts_a_reference_into_docs() -> None:
    assert not source_problems("vcpo/example.py", "# the formula is in docs/algorithm.md (OPOB)")


# ---------------------------------------------------------------------------------------------
# Check 3: `vcpo …` commands parse with the real CLI; their overrides name real config fields

_VCPO = re.compile(r"(?:^|(?<=[\s/(\"'`]))vcpo[ \t]+(?=[a-z-])")
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(?:[./][\w./-]*)?$|[<>…]|\.\.\.")
_SHELL_OPERATOR = re.compile(r"^[;&|<>]+$")


@dataclass
class DocCommand:
    text: str
    tokens: list[str]
    subcommand: str | None = None
    positionals: list[str] = field(default_factory=list)
    options: dict[str, str | None] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)

    @property
    def has_placeholder(self) -> bool:
        return any(_PLACEHOLDER.search(token) for token in self.tokens)


def _split(text: str) -> list[str]:
    text = re.sub(r"<[^<>\s]+(?: [^<>\s]+)*>", "…", text)  # <task>, <the cached warm start>: placeholders
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote in prose around a command
        tokens = text.split()
    for index, token in enumerate(tokens):
        if _SHELL_OPERATOR.match(token):
            return tokens[:index]
    return tokens


def vcpo_commands(text: str) -> list[DocCommand]:
    md = parse_markdown(text)
    commands = [DocCommand(line.strip(), _split(line[m.end():]))
                for line in _code_lines(md, without_comments=True) for m in _VCPO.finditer(line)]
    # "vcpo train: …" is the program's own output quoted in a doc, not a command
    return [c for c in commands if not (c.tokens and c.tokens[0].endswith(":"))]


def _parser() -> argparse.ArgumentParser:
    from cli.main import _build_parser

    return _build_parser()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("the vcpo parser has no subcommands")


def _is_placeholder(token: str) -> bool:
    return bool(_PLACEHOLDER.search(token))


def _check_value(action: argparse.Action, value: str, what: str) -> list[str]:
    if _is_placeholder(value):
        return []
    if action.choices is not None and value not in action.choices:
        return [f"{what} {value!r} is not one of {sorted(action.choices)}"]
    if action.type in (int, float):
        try:
            action.type(value)
        except ValueError:
            return [f"{what} {value!r} is not a {action.type.__name__}"]
    return []


def command_problems(command: DocCommand, parser: argparse.ArgumentParser | None = None) -> list[str]:
    """Parse `command` as `vcpo` would (filling in its parts); what the real parser would reject."""
    parser = parser or _parser()
    top_options = {s for action in parser._actions for s in action.option_strings}
    tokens = list(command.tokens)
    while tokens and tokens[0].startswith("-"):
        if tokens[0] not in top_options:
            return [f"vcpo has no option {tokens[0]}"]
        tokens.pop(0)
    if not tokens or _is_placeholder(tokens[0]):
        return []
    subcommands = _subcommands(parser)
    command.subcommand = tokens[0]
    if tokens[0] not in subcommands:
        return [f"no subcommand {tokens[0]!r} (known: {sorted(subcommands)})"]
    sub = subcommands[tokens[0]]
    options = {s: action for action in sub._actions for s in action.option_strings}
    problems: list[str] = []
    free: list[str] = []
    index = 1
    while index < len(tokens):
        token = tokens[index]
        if token.startswith("-") and len(token) > 1 and not re.match(r"-\d", token):
            name, sep, value = token.partition("=")
            action = options.get(name)
            if action is None:
                problems.append(f"vcpo {command.subcommand} has no option {name} (valid: {sorted(options)})")
            elif action.nargs != 0:
                if not sep and index + 1 < len(tokens):
                    index += 1
                    value = tokens[index]
                command.options[name] = value
                problems += _check_value(action, value, name) if value else []
            else:
                command.options[name] = None
        else:
            free.append(token)
        index += 1
    command.overrides = [t for t in free if "=" in t and not t.startswith(("/", "."))]
    command.positionals = [t for t in free if t not in command.overrides]
    positional_actions = [a for a in sub._actions if not a.option_strings]
    if command.overrides and "overrides" not in {a.dest for a in positional_actions}:
        problems.append(f"vcpo {command.subcommand} takes no a.b.c=value overrides: {command.overrides}")
    for action, value in zip(positional_actions, command.positionals, strict=False):
        if action.nargs not in (None, 1):
            break  # a list or an optional positional: nothing more to match by position
        problems += _check_value(action, value, action.dest)
    return problems


@pytest.mark.parametrize("doc", DOCS)
def test_vcpo_commands_use_real_subcommands_choices_and_options(doc: str) -> None:
    parser = _parser()
    commands = vcpo_commands((ROOT / doc).read_text())
    problems = {c.text: p for c in commands if (p := command_problems(c, parser))}
    assert not problems, f"{doc}: {problems}"


def _validate_task_file(path: Path, overrides: list[str]) -> None:
    from configs.task_schema import load_task_config
    from tools.registry import known_tools, validate_tool_settings

    task = load_task_config(path, overrides)
    if task.tool is not None and task.tool.get("type") in known_tools():  # a plug-in the doc installs
        validate_tool_settings(task.tool)                                  # first is checked by its test


def _resolve(spec: str, beside: Path) -> Path:
    return next((p for p in (ROOT / spec, beside / spec) if p.is_file()), ROOT / spec)


def override_problems(command: DocCommand) -> list[str]:
    """Load the config `command` applies its a.b.c=value overrides to, as the CLI would."""
    from cli.config_catalog import bench_command_schema, bench_schema_of, is_bench_config
    from configs.loader import ConfigError, apply_overrides, load_config, read_yaml_tree, validate_config
    from configs.schema import RunConfig
    from tools.base import ToolConfigError

    sub, args = command.subcommand, command.positionals
    try:
        if sub == "train":
            path = ROOT / (args[0] if args else "configs/default.yaml")
            config = load_config(path, RunConfig, command.overrides)
            _validate_task_file(_resolve(config.task, path.parent), config.task_overrides)
        elif sub == "eval" and args:
            _validate_task_file(ROOT / args[0], command.overrides)
        elif sub == "config" and len(args) > 1:
            path = ROOT / args[1]
            raw = read_yaml_tree(path)
            if "prompt" in raw and "reward" in raw:
                _validate_task_file(path, command.overrides)
            elif is_bench_config(path):
                load_config(path, bench_schema_of(path), command.overrides)
            else:
                config = load_config(path, RunConfig, command.overrides)
                _validate_task_file(_resolve(config.task, path.parent), config.task_overrides)
        elif sub == "bench" and args:
            config_path = command.options.get("--config")
            if config_path is None and args[0] == "staleness":  # as the CLI: the shipped file by default
                config_path = "benchmarks/configs/staleness.yaml"
            schema = bench_command_schema(args[0], None if config_path is None else ROOT / config_path)
            if config_path is not None:
                load_config(ROOT / config_path, schema, command.overrides)
            else:
                raw: dict[str, Any] = {}
                paths = apply_overrides(raw, command.overrides, source="<command line>")
                validate_config(raw, schema, "<command line>", paths)
    except (ConfigError, ToolConfigError) as exc:
        return [str(exc)]
    return []


@pytest.mark.parametrize("doc", DOCS)
def test_overrides_in_vcpo_commands_name_real_config_fields(doc: str) -> None:
    parser = _parser()
    problems = {}
    for command in vcpo_commands((ROOT / doc).read_text()):
        if command_problems(command, parser) or command.has_placeholder:
            continue  # reported by the test above / not a runnable command
        if found := override_problems(command):
            problems[command.text] = found
    assert not problems, f"{doc}: {problems}"


# ---------------------------------------------------------------------------------------------
# Check 4: docs/README.md indexes every page


def index_problems(index_text: str, pages: list[str]) -> list[str]:
    linked = {Path(target.split("#")[0]).name for target in parse_markdown(index_text).links}
    return [f"docs/README.md does not link {page}" for page in pages if page not in linked]


def test_docs_index_links_every_page() -> None:
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert not index_problems((ROOT / "docs" / "README.md").read_text(), pages)


# ---------------------------------------------------------------------------------------------
# Check 5: docs/task_yaml.md documents the schema, field by field

TASK_DOC = ROOT / "docs" / "task_yaml.md"


@dataclass(frozen=True)
class FieldRow:
    path: str
    default: str
    heading: str


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def field_rows(text: str) -> list[FieldRow]:
    """Rows of the tables whose first column is `field`: (path, default cell, nearest heading)."""
    rows: list[FieldRow] = []
    heading, header, in_fence = "", None, False
    for line in text.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        if in_fence:
            continue
        if line.startswith("#"):
            heading = line
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = [cell.lower() for cell in cells]
        elif header[0] == "field" and not set("".join(cells)) <= set("-: "):
            path = re.fullmatch(r"`([\w.]+)`", cells[0])
            assert path, f"{cells[0]!r}: the field column holds one `dotted.path`"
            rows.append(FieldRow(path.group(1), cells[header.index("default")], heading))
    return rows


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def schema_fields(model: type[BaseModel], prefix: str = "") -> dict[str, list[FieldInfo]]:
    """Every field path under `model` (union members merged: `dataset.path`, `dataset.id`, ...)."""
    found: dict[str, list[FieldInfo]] = {}
    for name, info in model.model_fields.items():
        found.setdefault(prefix + name, []).append(info)
        for sub in _models_in(info.annotation):
            for path, infos in schema_fields(sub, f"{prefix}{name}.").items():
                found.setdefault(path, []).extend(infos)
    return found


def required_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    """The paths the doc must list: every field, each model documented once at its shallowest place
    (`eval_dataset` has `dataset`'s fields, `dataset.fields` the top-level `fields`')."""
    required: set[str] = set()
    seen: set[type[BaseModel]] = {model}
    queue = [(model, prefix)]
    while queue:
        current, at = queue.pop(0)
        for name, info in current.model_fields.items():
            required.add(at + name)
            for sub in _models_in(info.annotation):
                if sub not in seen:
                    seen.add(sub)
                    queue.append((sub, f"{at}{name}."))
    return required


def _render(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    lines = yaml.safe_dump(value, default_flow_style=True, width=1 << 20).splitlines()
    if isinstance(value, str) and len(lines) > 2:  # a string with line breaks: its JSON form, on one line
        return json.dumps(value)
    return lines[0]


def default_problem(row: FieldRow, infos: list[FieldInfo]) -> str | None:
    """Whether the row's default cell says what the schema does (sections and tags are not compared)."""
    if row.path.rsplit(".", 1)[-1] == "type":
        return None
    expected = set()
    for info in infos:
        if info.is_required():
            expected.add("required")
            continue
        value = info.get_default(call_default_factory=True)
        if isinstance(value, BaseModel):
            return None
        expected.add(f"`{_render(value)}`")
    if len(expected) != 1:
        return None  # union members disagree: the doc explains it in words
    (want,) = expected
    return None if row.default == want else f"`{row.path}`: default {row.default} but the schema says {want}"


def _tool_models() -> dict[str, type[BaseModel]]:
    from tools.registry import BUILTIN_TOOLS, resolve_tool_class

    return {name: resolve_tool_class(name).settings_model for name in BUILTIN_TOOLS}


def task_doc_problems(text: str) -> list[str]:
    from configs.task_schema import TaskConfig

    rows = field_rows(text)
    problems: list[str] = []
    task_rows = [row for row in rows if not row.path.startswith("tool.")]
    valid = schema_fields(TaskConfig)
    documented = {row.path for row in task_rows}
    problems += [f"`{p}` is not documented" for p in sorted(required_paths(TaskConfig) - documented)]
    for row in task_rows:
        if row.path not in valid:
            problems.append(f"`{row.path}` is documented but TaskConfig has no such field")
        elif found := default_problem(row, valid[row.path]):
            problems.append(found)
    tools = _tool_models()
    by_tool: dict[str, set[str]] = {name: set() for name in tools}
    for row in rows:
        if not row.path.startswith("tool."):
            continue
        tag = re.search(r"type: (\w+)", row.heading)
        if tag is None or tag.group(1) not in tools:
            problems.append(f"`{row.path}` is under {row.heading!r}, not a `type: <built-in tool>` heading")
            continue
        name = tag.group(1)
        by_tool[name].add(row.path)
        fields = schema_fields(tools[name], "tool.")
        if row.path not in fields:
            problems.append(f"`{row.path}` is documented for type {name}, whose settings have no such field")
        elif found := default_problem(row, fields[row.path]):
            problems.append(f"type {name}: {found}")
    for name, model in tools.items():
        missing = sorted(set(schema_fields(model, "tool.")) - by_tool[name])
        problems += [f"type {name}: `{path}` is not documented" for path in missing]
    return problems


def test_task_yaml_documents_every_schema_and_tool_field_with_its_default() -> None:
    problems = task_doc_problems(TASK_DOC.read_text())
    assert not problems, "\n".join(problems)


def test_the_task_yaml_example_validates(tmp_path: Path) -> None:
    from cli.config_catalog import check_task_config

    blocks = [b for b in parse_markdown(TASK_DOC.read_text()).blocks if re.search(r"^name:", b, re.M)]
    assert blocks, "docs/task_yaml.md has no complete example (a yaml block with name:)"
    path = tmp_path / "example.yaml"
    path.write_text(blocks[0])
    task = check_task_config(path)
    documented_sections = {"dataset", "eval_dataset", "fields", "prompt", "tool", "loop", "answer", "filters",
                           "reward", "eval"}
    assert documented_sections <= set(yaml.safe_load(blocks[0])), "the example leaves a section out"
    assert task.name


# ---------------------------------------------------------------------------------------------
# The checks catch broken docs (each would otherwise pass vacuously)


@pytest.mark.parametrize("snippet", [
    "See `configs/tasks/no_such_task.yaml`.",
    "```bash\n.venv/bin/vcpo eval learner/no_such_module.py\n```",
    "Read [the guide](no_such_page.md).",
])
def test_the_path_check_catches_a_missing_path(snippet: str) -> None:
    assert path_problems("docs/broken.md", snippet)


@pytest.mark.parametrize("snippet", [
    "Data lives in `../shared/data`.",
    "The design is in the shared/docs folder.",
    "See `ARCHITECTURE.md` for the layers.",
    "As STACK.md measured, bf16 is faster.",
    "[design](../../elsewhere/VCPO.md)",
])
def test_the_outside_check_catches_a_reference_outside_the_repo(snippet: str) -> None:
    assert outside_problems("docs/broken.md", snippet)


@pytest.mark.parametrize("snippet", [
    "`vcpo trian configs/default.yaml`",
    "`vcpo bench no_such_bench`",
    "`vcpo config chek configs/default.yaml`",
    "`vcpo eval configs/tasks/gsm8k.yaml --no-such-option 3`",
    "`vcpo eval configs/tasks/gsm8k.yaml --backend no_such_backend`",
    "`vcpo eval configs/tasks/gsm8k.yaml --k four`",
    "`vcpo plot runs/default rollout.max_lag=4`",
    "```bash\n.venv/bin/vcpo train \\\n  --no-progres configs/default.yaml\n```",
])
def test_the_command_check_catches_a_wrong_command(snippet: str) -> None:
    (command,) = vcpo_commands(snippet)
    assert command_problems(command)


@pytest.mark.parametrize("snippet", [
    "`vcpo train configs/default.yaml rollout.max_lagg=4`",
    "`vcpo train configs/default.yaml algo.objective.type=no_such_objective`",
    "`vcpo eval configs/tasks/gsm8k.yaml eval.kk=2`",
    "`vcpo config check configs/tasks/countdown.yaml loop.max_turn=3`",
    "`vcpo bench opob --config benchmarks/configs/opob.yaml repeats=often`",
    "`vcpo bench staleness mode=no_such_mode`",
])
def test_the_override_check_catches_a_field_that_does_not_exist(snippet: str) -> None:
    (command,) = vcpo_commands(snippet)
    assert not command_problems(command)
    assert override_problems(command)


@pytest.mark.parametrize("snippet", [
    "Turn 1 prints it in a\n```python block, then turn 2 boxes it.\n\n```bash\nls\n```",
    "```bash\nvcpo train\n",
])
def test_the_fence_check_catches_a_block_that_swallows_prose(snippet: str) -> None:
    assert fence_problems(snippet)


def test_the_index_check_catches_an_unlisted_page() -> None:
    assert index_problems("[a](architecture.md)", ["architecture.md", "glossary.md"])


def test_the_task_doc_check_catches_missing_stale_and_wrong_rows() -> None:
    text = TASK_DOC.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `loop.max_turns`"))
    assert any("`loop.max_turns` is not documented" in p for p in task_doc_problems(text.replace(row, "")))
    stale = text.replace(row, row + "\n| `loop.max_turnz` | int | `5` | gone |")
    assert any("`loop.max_turnz`" in p for p in task_doc_problems(stale))
    wrong = text.replace(row, row.replace("`5`", "`6`"))
    assert any("default `6`" in p for p in task_doc_problems(wrong))
    tool_row = next(line for line in text.splitlines() if line.startswith("| `tool.warm_pool_size`"))
    assert any("`tool.warm_pool_size` is not documented" in p
               for p in task_doc_problems(text.replace(tool_row, "")))


def test_the_results_pages_generated_tables_are_what_their_committed_data_gives(tmp_path: Path) -> None:
    """The README's and docs/results.md's tables marked as generated are rendered from committed JSON
    (`python -m benchmarks.results_page`); a figure edited by hand, or data changed without
    rerunning the renderer, fails here."""
    from benchmarks import results_page

    readme = (ROOT / "README.md").read_text()
    assert results_page.blocks(readme) == ["main_job_readme", "seeds_with_test_set", "main_job_other_runs",
                                           "results_at_a_glance"]
    rendered, changed = results_page.render(readme)
    assert not changed and rendered == readme, f"README.md: {changed} differ from their JSON; rerun it"
    for page, required in (("results.md", {"staleness_ten_seeds", "main_job_seeds"}),
                           ("performance.md", {"gpu_check_parts", "bench_learner", "bench_learner_long"})):
        text = (ROOT / "docs" / page).read_text()
        assert required <= set(results_page.blocks(text)), page
        assert len(text.splitlines()) <= 300, f"docs/{page} holds the current figures; history: docs/log.md"
        rendered, changed = results_page.render(text)
        assert not changed, f"docs/{page}: {changed} differ from their JSON; rerun the renderer"
        assert rendered == text
    text = (ROOT / "docs" / "results.md").read_text()
    data = json.loads((ROOT / "docs" / "results" / "staleness_10seeds.json").read_text())
    data["retention"][0]["retention"] += 0.5
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "staleness_10seeds.json").write_text(json.dumps(data))
    for path in (ROOT / "docs" / "results").glob("*.json"):
        if path.name != "staleness_10seeds.json":
            shutil.copy(path, tmp_path / "docs" / "results")
    assert results_page.render(text, root=tmp_path)[1] == ["staleness_ten_seeds"]


def test_repeated_main_job_runs_fold_into_one_row_with_their_spread() -> None:
    """Runs sharing a condition are repeats of one experiment: one row giving the range of their scores,
    gains and times, and the lowest of their intervals; a run of its own keeps its own interval."""
    from benchmarks import results_page

    def run(name: str, end: float, gain: float, low: float, wall_s: float, condition: str | None) -> dict:
        summary = {"heldout": [{"success": 0.1}, {"success": end}],
                   "heldout_change": {"gain": gain, "low": low, "high": gain + 0.07},
                   "phases_s": {"warm start": 0, "startup": 40, "RL": wall_s / 2, "held-out eval": 300}}
        return {"name": name, "host": "Xeon", "date": "2026-11-2" + name[-1], "setup_s": None,
                "wall_s": wall_s, "summary": summary, **({"condition": condition} if condition else {})}

    data = {"runs": [run("alone 1", 0.5, 0.4, 0.3, 600, None),
                     run("again 2", 0.9, 0.8, 0.72, 600, "cached"),
                     run("again 3", 0.95, 0.85, 0.78, 900, "cached")]}
    rows = results_page.main_job_other_runs(data).splitlines()[2:]
    assert rows == [
        "| alone 1 | Xeon | 10.0% → 50.0%: +40.0 (+30.0 to +47.0) | 10.0 min | "
        "— · 0 s · 40 s · 300 s · 300 s |",
        "| cached: 2 runs, 2026-11-22 to 2026-11-23 | Xeon | 10.0% → 90.0–95.0%: +80.0 to +85.0 (every run's "
        "interval above +72.0) | 10.0–15.0 min | — · 0 s · 40 s · 300–450 s · 300 s |"]


def test_the_staleness_answer_says_yes_or_no_only_where_the_seeds_resolve_both_halves() -> None:
    """The plain answer at the largest k is read from the retention rows: "yes" when VCPO keeps ≥ 95% and
    GRPO loses ≥ 20%, both resolved; "no" when either half is resolved against; else "not resolved", with
    what the means say."""
    from benchmarks import results_page
    from benchmarks.staleness.bench import retention_table

    def answer(grpo_k32: list[float], vcpo_k32: list[float]) -> str:
        per_seed = {("grpo", 0): [0.80, 0.82, 0.84], ("grpo", 32): grpo_k32,
                    ("vcpo_spec", 0): [0.90, 0.91, 0.92], ("vcpo_spec", 32): vcpo_k32}
        summary = [{"method": method, "lag": lag, "numerics": "fp32", "status": "ok", "seeds": len(scores),
                    "final_success": sum(scores) / len(scores), "final_success_ci95": 0.05,
                    "final_success_per_seed": scores} for (method, lag), scores in per_seed.items()]
        data = {"config": {"lags": [0, 32], "seeds": [2, 4, 5]}, "summary": summary,
                "retention": retention_table(summary)}
        return results_page.staleness_answer(data)

    assert answer([0.00, 0.01, 0.02], [0.90, 0.91, 0.92]).endswith("VCPO, spec OPOB: **yes**.\n")
    assert answer([0.80, 0.82, 0.84], [0.90, 0.91, 0.92]).endswith("VCPO, spec OPOB: **no**.\n")
    assert answer([0.00, 0.01, 0.02], [0.50, 0.52, 0.54]).endswith("VCPO, spec OPOB: **no**.\n")
    unresolved = answer([0.00, 0.80, 0.10], [0.90, 0.91, 0.92])
    assert "GRPO keeps 37%" in unresolved and "(loses ≥ 20%, not resolved)" in unresolved
    assert unresolved.endswith("**not resolved** on 3 seeds (the means say yes).\n")
