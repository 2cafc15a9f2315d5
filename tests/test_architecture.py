"""The architecture's layering, checked on the source: imports only point downwards.

ARCHITECTURE.md: `vcpo/` imports nothing of the project (and only torch outside the stdlib);
`tools/` and `rollout/` import only `vcpo/` at most; `agent_env/` may import `rollout/` and
`tools/`, and the task schema in `configs/` (pydantic-only, the bottom layer: a task component
takes its own validated section, as STYLE.md §4 asks); `learner/` (and the CLI in it) may import
all; `configs/` imports only itself (pydantic, yaml). Imports inside `if TYPE_CHECKING:` blocks
count too: the rule is about design, not runtime.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"vcpo", "tools", "rollout", "agent_env", "learner", "configs"}
ALLOWED = {
    "vcpo": set(),
    "configs": set(),
    "tools": {"vcpo"},
    "rollout": {"vcpo"},
    "agent_env": {"vcpo", "rollout", "tools", "configs"},
    "learner": {"vcpo", "rollout", "tools", "agent_env", "configs"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_project_imports_point_downwards(package: str) -> None:
    violations = {
        str(path.relative_to(ROOT)): sorted((_imports(path) & PROJECT) - ALLOWED[package] - {package})
        for path in _sources(package)
    }
    assert not {k: v for k, v in violations.items() if v}, "imports against the layering"


def test_vcpo_imports_only_torch_and_the_stdlib() -> None:
    allowed = set(sys.stdlib_module_names) | {"torch", "vcpo", "__future__"}
    bad = {str(p.relative_to(ROOT)): sorted(_imports(p) - allowed) for p in _sources("vcpo")}
    assert not {k: v for k, v in bad.items() if v}
