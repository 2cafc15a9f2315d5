"""examples/sqlite_tool: a tool plug-in as its own installable package, used by a task's agent loop.

The package is installed offline (`pip install --no-deps --no-build-isolation --no-index --target`,
from a copy so the build leaves nothing in the checkout). Everything that imports it runs in one
subprocess with the install folder on PYTHONPATH (tests/examples/sqlite_plugin_check.py); this
process never sees the plug-in, so what is found was found through the installed entry points.

For both entry points (`sqlite` in-process, `sqlite_sandboxed` in the real bubblewrap sandbox): a
real agent-loop episode with the real HF engine and a tiny model memorised to write one ```sql block
for the task's first question ("How many orders did Ada place?"), read the rows and box 3; then
queries that must be refused (writes, ATTACH, VACUUM INTO), stopped (too slow) or cut (too many
rows), each an error result and never an exception, with the database file unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent_env.datasets import load_samples
from configs.task_schema import load_task_config
from tests.examples.memorise import memorise_episode, task_prompt_ids
from tools.base import ToolConfigError
from tools.registry import known_tools, validate_tool_settings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sqlite_tool"
README = EXAMPLE / "README.md"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
HAS_BWRAP = shutil.which("bwrap") is not None
TOOL_TYPES = [pytest.param("sqlite"), pytest.param("sqlite_sandboxed", marks=needs_bwrap)]
TOOL_CLASSES = {"sqlite": "vcpo_sqlite_tool.tools:SqliteTool",
                "sqlite_sandboxed": "vcpo_sqlite_tool.tools:SandboxedSqliteTool"}

# The memorised episode of the first question; the observation is what the tool prints for the
# query on shop.sql's data (Ada's orders 1, 3 and 6), in the loop's markdown observation format.
QUERY = ("SELECT o.item, o.quantity FROM orders o JOIN customers c ON c.id = o.customer_id "
         "WHERE c.name = 'Ada' ORDER BY o.id;")
TURN_1 = f"I will list Ada's orders.\n```sql\n{QUERY}\n```\n"
OBSERVATION = "\n```output\nitem | quantity\nnotebook | 2\npen | 5\nlamp | 1\n(3 rows)\n```\n"
TURN_2 = "Ada placed 3 orders, so the answer is \\boxed{3}."

WRITES = {
    "insert": "INSERT INTO orders VALUES (8, 4, 'pen', 1, 1.2)",
    "update": "UPDATE customers SET city = 'Paris'",
    "delete": "DELETE FROM orders",
    "drop": "DROP TABLE orders",
    "create": "CREATE TABLE notes (text TEXT)",
    "pragma_setting": "PRAGMA query_only = OFF",
    "transaction": "BEGIN IMMEDIATE",
}


def _env(*paths: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in paths), "OMP_NUM_THREADS": "1"}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package installed into a folder, offline, as `pip install` would install it."""
    work = tmp_path_factory.mktemp("sqlite-plugin")
    source = work / "source"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "shop.sqlite*", "__pycache__"))
    site = work / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(site), str(source)],
        capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    return site


@pytest.fixture(scope="module")
def database(plugin_site: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """shop.sql built with the package's own builder, as the README says (into a temporary folder)."""
    target = tmp_path_factory.mktemp("shop") / "shop.sqlite"
    build = subprocess.run([sys.executable, "-m", "vcpo_sqlite_tool.make_database",
                            "examples/sqlite_tool/shop.sql", str(target)],
                           cwd=ROOT, env=_env(plugin_site), capture_output=True, text=True, timeout=60)
    assert build.returncode == 0 and build.stdout.strip() == str(target), build.stderr
    return target


@pytest.fixture(scope="module")
def memorised_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    task = load_task_config(EXAMPLE / "task.yaml")
    first = load_samples(task, task_dir=EXAMPLE).samples[0]
    assert (first.sample_id, first.answer) == ("ada-orders", "3")
    out_dir = tmp_path_factory.mktemp("memorised-sql")
    return memorise_episode(out_dir, task_prompt_ids(task, first), TURN_1 + OBSERVATION + TURN_2)


@pytest.fixture(scope="module")
def report(plugin_site: Path, database: Path, memorised_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One subprocess with the plug-in on its path runs every check (see the module docstring)."""
    work = tmp_path_factory.mktemp("sqlite-report")
    before = _sha256(database)
    queries = {name: {"sql": sql} for name, sql in WRITES.items()} | {
        "attach": {"sql": f"ATTACH DATABASE '{work / 'other.sqlite'}' AS other"},
        "vacuum_into": {"sql": f"VACUUM INTO '{work / 'copy.sqlite'}'"},
        "slow": {"sql": "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
                        "SELECT count(*) FROM n", "timeout_s": 0.5},  # never ends by itself
        "many_rows": {"sql": "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n LIMIT 25) "
                             "SELECT i FROM n"},
        "unknown_table": {"sql": "SELECT * FROM invoices"},
        "two_statements": {"sql": "SELECT 1; DELETE FROM orders"},
        "schema": {"sql": "PRAGMA table_info(customers)"},
    }
    request = {"model": str(memorised_dir), "task": str(EXAMPLE / "task.yaml"), "database": str(database),
               "tool_types": ["sqlite", "sqlite_sandboxed"] if HAS_BWRAP else ["sqlite"], "queries": queries}
    (work / "request.json").write_text(json.dumps(request))
    command = [sys.executable, "-m", "tests.examples.sqlite_plugin_check", str(work / "request.json"),
               str(work / "report.json")]
    run = subprocess.run(command, cwd=ROOT, env=_env(plugin_site, ROOT), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads((work / "report.json").read_text())
    result["database_unchanged"] = _sha256(database) == before
    result["files_created"] = sorted(p.name for p in work.iterdir() if p.suffix == ".sqlite")
    result["site"] = str(plugin_site)
    return result


# ---------------------------------------------------------------------------------------------
# Installation and discovery


def test_the_readme_installs_builds_and_checks_with_these_commands() -> None:
    text = README.read_text()
    for command in ("pip install ./examples/sqlite_tool",
                    "python -m vcpo_sqlite_tool.make_database examples/sqlite_tool/shop.sql "
                    "examples/sqlite_tool/shop.sqlite",
                    "vcpo config check examples/sqlite_tool/task.yaml"):
        assert re.search(rf"^{re.escape(command)}$", text, re.MULTILINE), command


def test_without_the_plugin_installed_the_type_is_unknown_and_the_error_says_how_to_register() -> None:
    assert "sqlite" not in known_tools()  # this process does not have the plug-in on its path
    with pytest.raises(ToolConfigError, match=r"unknown tool type 'sqlite'.*vcpo\.tools"):
        validate_tool_settings(load_task_config(EXAMPLE / "task.yaml").tool or {})


def test_the_installed_package_registers_both_entry_points(report: dict[str, Any]) -> None:
    assert {name: report["known_tools"].get(name) for name in TOOL_CLASSES} == TOOL_CLASSES


def test_vcpo_config_check_accepts_the_task_once_the_plugin_is_installed(plugin_site: Path) -> None:
    check = subprocess.run([str(Path(sys.executable).parent / "vcpo"), "config", "check",
                            "examples/sqlite_tool/task.yaml"], cwd=ROOT, env=_env(plugin_site),
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    assert "type: sqlite\n" in check.stdout and "database: examples/sqlite_tool/shop.sqlite" in check.stdout


# ---------------------------------------------------------------------------------------------
# The agent loop with each entry point


@pytest.mark.parametrize("tool_type", TOOL_TYPES)
def test_an_episode_runs_the_sql_block_shows_the_rows_and_is_rewarded(report: dict[str, Any],
                                                                      tool_type: str) -> None:
    checked = report["tools"][tool_type]
    assert checked["tool_class"] == TOOL_CLASSES[tool_type] and checked["sample_id"] == "ada-orders"
    assert checked["tool_file"].startswith(report["site"])  # the installed copy, not the checkout's
    episode = checked["episode"]
    first, last = episode["turns"][0], episode["turns"][-1]
    assert first["text"] == TURN_1 and first["code"] == QUERY
    assert (first["tool_status"], first["observation"]) == ("ok", OBSERVATION)  # the rows the model sees
    assert last["text"] == TURN_2 and last["code"] is None
    assert (episode["tool_calls"], episode["answer"], episode["reward"]) == (1, "3", 1.0)


# ---------------------------------------------------------------------------------------------
# Refusals and limits: error results, never exceptions


@pytest.mark.parametrize("tool_type", TOOL_TYPES)
@pytest.mark.parametrize("name", sorted(WRITES))
def test_a_query_that_writes_is_refused(report: dict[str, Any], tool_type: str, name: str) -> None:
    result = report["tools"][tool_type]["queries"][name]
    assert result["status"] == "error" and result["message"].startswith("Refused: ")
    assert "This SQL tool is read-only" in result["message"]
    assert result["stderr"].strip() == result["message"]  # the line the model sees (last stderr line)
    assert report["database_unchanged"]


@pytest.mark.parametrize("tool_type", TOOL_TYPES)
def test_attach_and_vacuum_into_are_refused_and_create_no_file(report: dict[str, Any],
                                                               tool_type: str) -> None:
    queries = report["tools"][tool_type]["queries"]
    for name in ("attach", "vacuum_into"):
        assert queries[name]["status"] == "error"
        assert queries[name]["message"].startswith("Refused: opening another database file")
    assert report["files_created"] == []


@pytest.mark.parametrize("tool_type", TOOL_TYPES)
def test_a_query_past_its_time_limit_is_stopped_with_a_timeout_result(report: dict[str, Any],
                                                                      tool_type: str) -> None:
    result = report["tools"][tool_type]["queries"]["slow"]
    assert result["status"] == "timeout" and "interrupted after 0.5 s" in result["message"]
    assert result["wall_time_s"] < 5  # the call's 0.5 s, not the task's 5 s or a hang


@pytest.mark.parametrize("tool_type", TOOL_TYPES)
def test_sqlite_errors_are_error_results_with_sqlites_message(report: dict[str, Any], tool_type: str) -> None:
    queries = report["tools"][tool_type]["queries"]
    assert (queries["unknown_table"]["status"], queries["unknown_table"]["message"]) == (
        "error", "OperationalError: no such table: invoices")
    assert queries["two_statements"]["status"] == "error"
    assert "one statement at a time" in queries["two_statements"]["message"]


@pytest.mark.parametrize("tool_type", TOOL_TYPES)
def test_rows_beyond_max_rows_are_not_shown_and_the_result_says_so(report: dict[str, Any],
                                                                  tool_type: str) -> None:
    lines = report["tools"][tool_type]["queries"]["many_rows"]["stdout"].splitlines()
    # task.yaml: max_rows 20 of the 25 rows; header "i", rows 1..20, then the note
    assert lines[:21] == ["i", *map(str, range(1, 21))] and len(lines) == 22
    assert lines[-1].startswith("(first 20 rows shown; the query returned more")


@pytest.mark.parametrize("tool_type", TOOL_TYPES)
def test_schema_pragmas_are_readable(report: dict[str, Any], tool_type: str) -> None:
    result = report["tools"][tool_type]["queries"]["schema"]
    assert result["status"] == "ok"
    assert result["stdout"].splitlines()[1:4] == [
        "0 | id | INTEGER | 0 | NULL | 1", "1 | name | TEXT | 1 | NULL | 0", "2 | city | TEXT | 1 | NULL | 0"]
