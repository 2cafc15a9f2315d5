"""Docs refer to real paths: every repo path the README and docs/ name in backticks exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_REPO_PATH = r"((?:scripts|configs|docs|tests|vcpo|tools|rollout|agent_env|learner|\.ci)/[\w./-]+)"
_NAMED = [  # `path`, --config path, [text](path)
    re.compile(f"`{_REPO_PATH}`"),
    re.compile(rf"--config {_REPO_PATH}"),
    re.compile(rf"\]\({_REPO_PATH}\)"),
]


@pytest.mark.parametrize("doc", ["README.md", "docs/results.md"])
def test_named_paths_exist(doc: str) -> None:
    text = (ROOT / doc).read_text()
    named = {path for pattern in _NAMED for path in pattern.findall(text)}
    assert named, f"{doc} names no repo path (the regex is wrong)"
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"{doc} names paths that do not exist: {missing}"
