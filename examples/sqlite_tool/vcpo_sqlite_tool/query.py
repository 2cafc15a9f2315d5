"""Run one read-only SQL query on a sqlite file and describe the rows as text for the model.

Standard library only and no imports from this package: the sandboxed tool sends this file's source
into the bubblewrap sandbox, where it runs as `__main__` (`main()` reads a JSON request on stdin and
prints the JSON outcome). The in-process tool imports it. Both therefore enforce the same rules
with the same code and show the model the same text.

Read-only three ways: the file is opened with `mode=ro` (sqlite itself refuses writes); `PRAGMA
query_only`; and an authorizer that allows only reading (SELECT, reading columns, functions other
than load_extension, recursive CTEs, and a few schema PRAGMAs such as `table_info`). Everything
else is refused before it runs, with a message naming the statement: writes, DDL, transactions,
ATTACH (also `VACUUM INTO`, which attaches its target), setting PRAGMAs. One statement per call.

Limits: a query past its deadline is interrupted (a progress handler checks the clock every
`_PROGRESS_STEPS` virtual-machine instructions); at most `max_rows` rows are fetched; text longer
than `max_cell_chars` is cut and blobs are shown by their size; sqlite refuses any string, blob or
row over `MAX_VALUE_BYTES` (so `randomblob(1e9)` fails instead of allocating a gigabyte). Memory as
a whole is not bounded here: the sandboxed tool adds an address-space cap around this process.

Not here: threads, async, the Tool protocol (vcpo_sqlite_tool/tools.py).
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

MAX_VALUE_BYTES = 1_000_000
"""Largest string, blob or row sqlite may build or read during a query (SQLITE_LIMIT_LENGTH)."""

_PROGRESS_STEPS = 1000
"""VM instructions between deadline checks (~microseconds each: the check itself is cheap)."""

_READ_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE}
_READ_PRAGMAS = {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
                 "foreign_key_list"}
"""PRAGMAs that only describe the schema; their argument is a table or index name, never a setting."""
_REFUSED_FUNCTIONS = {"load_extension"}

_ACTION_NAMES = {
    getattr(sqlite3, f"SQLITE_{name}"): name.replace("_", " ")
    for name in ("CREATE_INDEX", "CREATE_TABLE", "CREATE_TEMP_INDEX", "CREATE_TEMP_TABLE",
                 "CREATE_TEMP_TRIGGER", "CREATE_TEMP_VIEW", "CREATE_TRIGGER", "CREATE_VIEW", "DELETE",
                 "DROP_INDEX", "DROP_TABLE", "DROP_TEMP_INDEX", "DROP_TEMP_TABLE", "DROP_TEMP_TRIGGER",
                 "DROP_TEMP_VIEW", "DROP_TRIGGER", "DROP_VIEW", "INSERT", "PRAGMA", "TRANSACTION",
                 "UPDATE", "ATTACH", "DETACH", "ALTER_TABLE", "REINDEX", "ANALYZE", "CREATE_VTABLE",
                 "DROP_VTABLE", "FUNCTION", "SAVEPOINT")
}

Status = Literal["ok", "error", "refused", "timeout"]


class QueryOutcome(NamedTuple):
    """What one query did. `rows` hold display-ready values (str, int, float or None)."""

    status: Status
    """ok; error (sqlite rejected the query: syntax, unknown table, ...); refused (not read-only);
    timeout (interrupted at the deadline)."""
    columns: list[str]
    rows: list[list[Any]]
    has_more_rows: bool = False
    """True when the query had more than `max_rows` rows (they were not fetched)."""
    message: str = ""
    """One line for the model when status is not ok."""


def database_uri(path: str, *, is_immutable: bool = False) -> str:
    """The `file:` URI that opens `path` read-only; `immutable` also skips locking and journal
    checks (right for a file on a read-only mount, such as inside the sandbox)."""
    query = "mode=ro&immutable=1" if is_immutable else "mode=ro"
    return f"file:{urllib.parse.quote(path)}?{query}"


def run_query(uri: str, sql: str, *, timeout_s: float, max_rows: int, max_cell_chars: int,
              is_cancelled: Callable[[], bool] = lambda: False) -> QueryOutcome:
    """Run `sql` read-only on the database at `uri`; problems of the query are in the outcome.
    `is_cancelled` is polled with the deadline: True stops the query like a timeout does."""
    deadline = time.monotonic() + timeout_s
    refusals: list[str] = []
    connection = sqlite3.connect(uri, uri=True, isolation_level=None)
    try:
        connection.execute("PRAGMA query_only = ON")
        connection.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
        connection.set_authorizer(_authorizer(refusals))
        connection.set_progress_handler(lambda: int(time.monotonic() > deadline or is_cancelled()),
                                        _PROGRESS_STEPS)
        try:
            cursor = connection.execute(sql)
            fetched = cursor.fetchmany(max_rows + 1)
        except sqlite3.Error as error:
            return _failure(error, refusals, timeout_s, time.monotonic() > deadline)
        columns = [column[0] for column in cursor.description or ()]
        rows = [[_display(value, max_cell_chars) for value in row] for row in fetched[:max_rows]]
        return QueryOutcome("ok", columns, rows, has_more_rows=len(fetched) > max_rows)
    finally:
        connection.close()


Authorizer = Callable[[int, str | None, str | None, str | None, str | None], int]
"""sqlite's authorizer callback: (action, arg1, arg2, database, trigger or view) -> OK or DENY."""


def _authorizer(refusals: list[str]) -> Authorizer:
    """Allow reading; refuse everything else, recording what was refused in `refusals`."""

    def authorize(action: int, arg1: str | None, arg2: str | None, _db: str | None,
                  _source: str | None) -> int:
        if action in _READ_ACTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() not in _REFUSED_FUNCTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in _READ_PRAGMAS:
            return sqlite3.SQLITE_OK
        refusals.append(_describe_action(action, arg1, arg2))
        return sqlite3.SQLITE_DENY

    return authorize


def _describe_action(action: int, arg1: str | None, arg2: str | None) -> str:
    """What a refused statement tried, in the model's terms (arg1/arg2 per sqlite's authorizer docs)."""
    if action == sqlite3.SQLITE_ATTACH:  # VACUUM INTO attaches its target file too
        return f"opening another database file ({arg1!r}, by ATTACH or VACUUM INTO)"
    if action == sqlite3.SQLITE_FUNCTION:
        return f"the function {arg2}()"
    if action == sqlite3.SQLITE_PRAGMA:
        return f"PRAGMA {arg1}" + (f" = {arg2}" if arg2 is not None else "")
    name = _ACTION_NAMES.get(action, f"statement kind {action}")
    return f"{name} on {arg1!r}" if arg1 else name


def _failure(error: sqlite3.Error, refusals: list[str], timeout_s: float, is_late: bool) -> QueryOutcome:
    if refusals:
        return QueryOutcome("refused", [], [], message=(
            f"Refused: {refusals[0]} is not allowed. This SQL tool is read-only: write one SELECT query "
            "on the task's database (no INSERT, UPDATE, DELETE, CREATE, ATTACH, PRAGMA settings)."))
    if is_late and "interrupt" in str(error).lower():
        return QueryOutcome("timeout", [], [], message=(
            f"Query interrupted after {timeout_s:g} s (the time limit); make it cheaper, e.g. filter "
            "first or add a LIMIT."))
    return QueryOutcome("error", [], [], message=f"{type(error).__name__}: {error}")


def _display(value: Any, max_cell_chars: int) -> Any:
    """A value the model can read and JSON can carry: long text cut, blobs shown by size."""
    if isinstance(value, bytes):
        return f"<blob of {len(value)} bytes>"
    if isinstance(value, str) and len(value) > max_cell_chars:
        return value[:max_cell_chars] + "…"
    return value


def format_rows(outcome: QueryOutcome) -> str:
    """The text the model sees for an ok outcome: a header line, one line per row, a count line.

        item | quantity
        pen | 10
        (1 row)
    """
    def cell(value: Any) -> str:
        return "NULL" if value is None else str(value)

    lines = [" | ".join(outcome.columns)] if outcome.columns else []
    lines += [" | ".join(cell(value) for value in row) for row in outcome.rows]
    count = len(outcome.rows)
    if outcome.has_more_rows:
        lines.append(f"(first {count} rows shown; the query returned more: aggregate or add a LIMIT)")
    else:
        lines.append(f"({count} row{'' if count == 1 else 's'})")
    return "\n".join(lines) + "\n"


def main() -> None:
    """Sandbox entry: stdin {"uri", "sql", "timeout_s", "max_rows", "max_cell_chars"} → stdout JSON."""
    request = json.load(sys.stdin)
    outcome = run_query(request["uri"], request["sql"], timeout_s=request["timeout_s"],
                        max_rows=request["max_rows"], max_cell_chars=request["max_cell_chars"])
    print(json.dumps(outcome._asdict()))


if __name__ == "__main__":
    main()
