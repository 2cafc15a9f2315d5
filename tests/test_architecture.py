"""The architecture's layering, checked on the source: imports only point downwards.

docs/architecture.md: `vcpo/` imports nothing of the project (and only torch outside the stdlib);
`tools/` and `rollout/` import only `vcpo/` at most; `agent_env/` may import `rollout/` and
`tools/`, and the task schema in `configs/` (pydantic-only, the bottom layer: a task component
takes its own validated section); `learner/` (and the CLI in it) may import
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


# ---------------------------------------------------------------------------------------------
# Inside a layer: subpackages by concern, imports in one direction (each subpackage's __init__.py
# says what it owns and what it may import). A "unit" is a subpackage, or "." for the modules
# directly in the layer's folder. A package's own __init__.py is its public facade and may re-export
# from anything below it; every other module keeps to its unit's list.

_LEARNER_BELOW_LAUNCH = {"train", "backends", "backends.megatron", "traj_grads", "forward", "distributed",
                         "observability"}
UNITS = {
    "learner": {
        "observability": set(),
        "forward": set(),
        "distributed": set(),
        "traj_grads": {"forward"},
        "backends": {"forward", "traj_grads", "distributed"},
        "backends.megatron": {"backends", "forward", "traj_grads", "distributed"},
        "train": {"backends", "backends.megatron", "traj_grads", "forward", "distributed", "observability"},
        "launch": _LEARNER_BELOW_LAUNCH,
        "benchmarks": _LEARNER_BELOW_LAUNCH | {"launch"},
        "cli": _LEARNER_BELOW_LAUNCH | {"launch", "benchmarks"},
    },
    "rollout": {".": set(), "engines": {"."}, "bench": {".", "engines"}},
    "tools": {".": set(), "sandbox": {"."}, "sandbox_fusion": {".", "sandbox"}},
}


def _project_imports(path: Path) -> set[str]:
    """Every project module this file imports (dotted, as written; lazy imports included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return {name for name in found if name.split(".")[0] in PROJECT}


def _unit_of(dotted: str, layer: str) -> str | None:
    """The unit (subpackage or '.') a dotted module of `layer` belongs to; None outside the layer."""
    parts = dotted.split(".")
    if parts[0] != layer:
        return None
    units = UNITS[layer]
    for depth in (2, 1):  # the deepest unit first: backends.megatron before backends
        candidate = ".".join(parts[1:1 + depth])
        if len(parts) > depth and candidate in units:
            return candidate
    return "." if "." in units and len(parts) >= 2 else None


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("layer", sorted(UNITS))
def test_subpackages_import_in_one_direction(layer: str) -> None:
    violations: dict[str, list[str]] = {}
    for path in _sources(layer):
        if path.name == "__init__.py":
            continue  # a facade re-exports (learner's by name only, lazily)
        unit = _unit_of(_module_name(path), layer)
        assert unit is not None, f"{path.relative_to(ROOT)} belongs to no unit of {layer}: add it to UNITS"
        allowed = UNITS[layer][unit] | {unit}
        bad = sorted(name for name in _project_imports(path)
                     if (target := _unit_of(name, layer)) is not None and target not in allowed)
        if bad:
            violations[str(path.relative_to(ROOT))] = bad
    assert not violations, f"imports against the direction between {layer}'s subpackages"


def test_every_subpackage_says_what_it_owns_and_may_import() -> None:
    for layer, units in UNITS.items():
        for unit in units:
            if unit == ".":
                continue
            init = ROOT / layer / unit.replace(".", "/") / "__init__.py"
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            assert "May import" in doc, f"{init.relative_to(ROOT)}: say what it owns and what it may import"


def test_no_folder_holds_more_than_15_modules() -> None:
    for layer in PROJECT:
        for folder in [ROOT / layer, *(p for p in (ROOT / layer).rglob("*") if p.is_dir())]:
            if folder.name == "__pycache__":
                continue
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            where = folder.relative_to(ROOT)
            assert len(modules) <= 15, f"{where}: {len(modules)} modules; split it by concern"


def test_no_import_cycles_between_modules() -> None:
    """Over every static import of the project (lazy ones included), no module reaches itself.
    `from pkg import name` counts as importing pkg.name when that is a module, else pkg."""
    modules = {_module_name(p): p for layer in PROJECT for p in _sources(layer)}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for target in _project_imports(path):
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]  # `from a.b import C` → a.b
            if target in modules and target != name:
                edges.add(target)
        graph[name] = edges
    facades = {name for name, path in modules.items() if path.name == "__init__.py"}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node] - facades):  # a facade only gathers names; it is no dependency
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            pytest.fail("import cycle: " + " → ".join(cycle))
