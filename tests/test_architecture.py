"""The architecture's layering, checked on the source: imports only point downwards.

The rules are written once, in the packages themselves: each layer's and each subpackage's
`__init__.py` docstring has a "May import:" paragraph naming (in backticks) what it may import, and a
layer whose top modules import one of its subpackages says so in an "Its top modules may import:"
paragraph. This test parses those paragraphs and checks the code against them, so a docstring that
stops saying the truth fails here. docs/architecture.md draws the same layers. Imports inside
`if TYPE_CHECKING:` blocks count too: the rule is about design, not runtime.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = {"vcpo", "tools", "rollout", "agent_env", "learner", "run", "configs", "benchmarks", "cli"}
_NAME = re.compile(r"`([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)`")


def _docstring(package_dir: Path) -> str:
    return ast.get_docstring(ast.parse((package_dir / "__init__.py").read_text())) or ""


def declared(package_dir: Path, marker: str = "May import:") -> set[str] | None:
    """The backticked module names of the docstring's `marker` paragraph; None without one."""
    doc = _docstring(package_dir)
    at = doc.find(marker)
    if at < 0:
        return None
    return set(_NAME.findall(doc[at + len(marker):].split("\n\n")[0]))


def _subpackages(layer: str) -> list[str]:
    """Dotted names, relative to the layer, of its folders that are Python packages."""
    return sorted(".".join(p.parent.relative_to(ROOT / layer).parts)
                  for p in (ROOT / layer).rglob("__init__.py") if p.parent != ROOT / layer)


def _unit_rules(layer: str) -> dict[str, set[str]]:
    """Unit (subpackage, or '.' for the layer's top modules) → the units of the same layer it may import."""
    def to_unit(name: str) -> str | None:
        if name == layer:
            return "."
        return name[len(layer) + 1:] if name.startswith(layer + ".") else None

    rules: dict[str, set[str]] = {}
    top = declared(ROOT / layer, "Its top modules may import:") or set()
    if any(p.name != "__init__.py" for p in (ROOT / layer).glob("*.py")):
        rules["."] = {u for name in top if (u := to_unit(name)) is not None}
    for unit in _subpackages(layer):
        names = declared(ROOT / layer / unit.replace(".", "/"))
        rules[unit] = set() if names is None else {u for name in names if (u := to_unit(name)) is not None}
    return rules


ALLOWED = {layer: (declared(ROOT / layer) or set()) & PROJECT for layer in sorted(PROJECT)}
UNITS = {layer: rules for layer in sorted(PROJECT) if len(rules := _unit_rules(layer)) > 1}


def test_every_package_says_what_it_may_import_and_names_real_modules() -> None:
    packages = [ROOT / layer for layer in PROJECT]
    packages += [ROOT / layer / unit.replace(".", "/") for layer in PROJECT for unit in _subpackages(layer)]
    for package in packages:
        names = declared(package)
        where = package.relative_to(ROOT)
        assert names is not None, f"{where}/__init__.py: say what it may import in a 'May import:' paragraph"
        for name in names | (declared(package, "Its top modules may import:") or set()):
            path = ROOT / name.replace(".", "/")
            assert path.is_dir() or path.with_suffix(".py").is_file(), f"{where}: `{name}` is no module"


LIBRARY_LAYERS = ("vcpo", "tools", "rollout", "agent_env", "learner")
"""Layers whose `__init__.py` is only their index: no re-exports to keep in sync, nothing imported with it."""


@pytest.mark.parametrize("layer", LIBRARY_LAYERS)
def test_a_library_layers_init_is_its_index_and_re_exports_nothing(layer: str) -> None:
    """The docstring alone: it names every module and subpackage of the layer (so a newcomer finds each
    one there), and the file imports nothing (a name is imported from the module that defines it)."""
    tree = ast.parse((ROOT / layer / "__init__.py").read_text())
    assert len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr), (
        f"{layer}/__init__.py holds more than its docstring: import names from their modules instead")
    doc = _docstring(ROOT / layer)
    named = set(re.findall(r"`([a-z_][a-z0-9_]*)/?`", doc))
    present = {p.stem for p in (ROOT / layer).glob("*.py") if p.name != "__init__.py"}
    present |= {p.parent.name for p in (ROOT / layer).glob("*/__init__.py")}
    assert present <= named, f"{layer}/__init__.py does not describe {sorted(present - named)}"


def test_a_subpackage_names_only_what_its_layer_may_import() -> None:
    for layer in PROJECT:
        for unit in _subpackages(layer):
            names = declared(ROOT / layer / unit.replace(".", "/")) or set()
            outside = {name.split(".")[0] for name in names}
            assert outside - {layer} <= ALLOWED[layer], f"{layer}/{unit}: beyond {layer}'s own list"


def test_the_rules_read_from_the_docstrings_are_the_layering() -> None:
    """The layers as docs/architecture.md draws them; a docstring edit that changes them shows here."""
    layering = {"vcpo": set(), "configs": set(), "tools": {"vcpo"}, "rollout": {"vcpo"},
                "agent_env": {"vcpo", "rollout", "tools", "configs"},
                "learner": {"vcpo", "rollout", "configs"},
                "run": {"vcpo", "rollout", "tools", "agent_env", "configs", "learner"},
                "benchmarks": {"vcpo", "rollout", "tools", "agent_env", "configs", "learner", "run"},
                "cli": {"vcpo", "rollout", "tools", "agent_env", "configs", "learner", "run", "benchmarks"}}
    assert layering == ALLOWED
    assert UNITS["learner"]["forward"] == set() and UNITS["learner"]["traj_grads"] == {"forward"}
    assert UNITS["run"]["observability"] == set() and UNITS["run"]["launch"] == {"train", "observability"}
    assert UNITS["agent_env"]["evaluation"] == {"."} and UNITS["agent_env"]["."] == set()
    assert set(UNITS) == {"agent_env", "benchmarks", "learner", "run", "rollout", "tools", "vcpo"}


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
# Inside a layer: subpackages by concern, imports in one direction (UNITS, read from each
# subpackage's "May import:" paragraph above). A "unit" is a subpackage, or "." for the modules
# directly in the layer's folder. A package's own __init__.py may gather names from anything below it (the
# library layers' hold only their index, tested above); every other module keeps to its unit's list.


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
            continue  # a package's __init__ may gather names from below it
        unit = _unit_of(_module_name(path), layer)
        assert unit is not None, f"{path.relative_to(ROOT)} belongs to no unit of {layer}: add it to UNITS"
        allowed = UNITS[layer][unit] | {unit}
        bad = sorted(name for name in _project_imports(path)
                     if (target := _unit_of(name, layer)) is not None and target not in allowed)
        if bad:
            violations[str(path.relative_to(ROOT))] = bad
    assert not violations, f"imports against the direction between {layer}'s subpackages"


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


def test_no_function_is_longer_than_100_lines() -> None:
    """A function past 100 lines does several things; name them (the longest today is under 100)."""
    long = []
    for layer in PROJECT:
        for path in (ROOT / layer).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1 if node.end_lineno else 0
                    if lines > 100:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long
