"""The two tools this package registers in the `vcpo.tools` entry-point group (see pyproject.toml).

* `sqlite` (`SqliteTool`): runs the model's query in this process, on a worker thread with its own
  read-only connection. Cheap (no process per call); bounds time, rows and value sizes, not memory.
* `sqlite_sandboxed` (`SandboxedSqliteTool`): runs the same query code (`query.py`) inside vcpo's
  bubblewrap sandbox, a fresh process per query with no network, a read-only system, the database
  bound read-only and an address-space cap, by handing it to `tools.sandbox.local_sandbox.
  LocalPythonSandbox` as Python code. For queries you trust less: a memory-hungry query or a sqlite
  bug stays in a disposable process, away from the training process.

Both declare `code_fence = "sql"`, so the agent loop hands them the content of ```` ```sql ````
blocks as `ToolCall.code` (`language`, `stdin` and `files` of the call mean nothing to SQL and are
ignored). Both are stateless: a session just forwards to `run`. A problem with the query (refused,
wrong, too slow) is data in the `ToolResult`; a missing or unreadable database raises
`ToolConfigError` when the tool starts, naming the setting.

From vcpo this imports `tools.base` only (the protocol's data types and errors); the sandboxed
tool imports vcpo's sandbox when it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from tools.base import ToolCall, ToolConfigError, ToolResult
from vcpo_sqlite_tool import query
from vcpo_sqlite_tool.query import QueryOutcome, database_uri, format_rows, run_query

_SANDBOX_START_SLACK_S = 5.0
"""Seconds the sandbox may take beyond the query's own limit (interpreter start-up), before it kills
the process: the query's deadline normally fires first and gives the friendlier message."""

_SANDBOX_OUTPUT_BYTES = 4 << 20
"""Stdout kept of the sandboxed program (the JSON outcome); a larger result is reported as too large."""


class SqliteToolSettings(BaseModel):
    """Settings of `type: sqlite` (in-process)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    database: str = Field(min_length=1)
    """Path of the sqlite file the model queries (opened read-only); relative paths are from the
    directory vcpo runs in."""
    timeout_s: float = Field(5.0, gt=0, le=600)
    """Wall-clock limit per query in seconds; a slower query is interrupted and the model told so."""
    max_rows: int = Field(50, ge=1, le=10_000)
    """Rows shown to the model; further rows are not fetched (the result says there were more)."""
    max_cell_chars: int = Field(200, ge=8, le=100_000)
    """Longest text shown per value (cut with '…'); blobs are shown by their size."""
    max_concurrency: int = Field(8, ge=1, le=256)
    """Queries running at once; more wait."""


class SandboxedSqliteSettings(SqliteToolSettings):
    """Settings of `type: sqlite_sandboxed` (each query in vcpo's bubblewrap sandbox)."""

    memory_limit_mb: int = Field(256, ge=64)
    """Address-space cap of the sandboxed process in MiB (Python + sqlite's page cache and sorts)."""
    warm_pool_size: int = Field(2, ge=0)
    """Sandboxes started ahead and idle (hides start-up latency); 0 starts each on demand."""


def check_database(setting: str) -> Path:
    """The database file `setting` names, resolved; ToolConfigError if it is missing or not sqlite."""
    path = Path(setting).expanduser()
    resolved = (path if path.is_absolute() else Path.cwd() / path).resolve()
    if not resolved.is_file():
        raise ToolConfigError(
            f"tool.database = {setting!r}: no such file ({resolved}; relative paths are from the directory "
            "vcpo runs in). Give the path of a sqlite file; the example's is built by "
            "python -m vcpo_sqlite_tool.make_database examples/sqlite_tool/shop.sql "
            "examples/sqlite_tool/shop.sqlite"
        )
    probe = run_query(database_uri(str(resolved)), "SELECT count(*) FROM sqlite_master", timeout_s=5.0,
                      max_rows=1, max_cell_chars=8)
    if probe.status != "ok":
        raise ToolConfigError(f"tool.database = {setting!r} ({resolved}) cannot be read as a sqlite "
                              f"database: {probe.message}")
    return resolved


def outcome_to_result(outcome: QueryOutcome, wall_time_s: float) -> ToolResult:
    """The protocol's result: rows as stdout; a refusal or sqlite error as an error whose stderr is
    the one line the model sees; an interrupted query as a timeout."""
    if outcome.status == "ok":
        return ToolResult(status="ok", stdout=format_rows(outcome), exit_code=0, wall_time_s=wall_time_s)
    if outcome.status == "timeout":
        return ToolResult(status="timeout", message=outcome.message, wall_time_s=wall_time_s)
    return ToolResult(status="error", stderr=outcome.message + "\n", exit_code=1, message=outcome.message,
                      wall_time_s=wall_time_s)


class _StatelessSession:
    """`tool.session()`: a read-only query keeps no state between calls, so calls just go to `run`."""

    def __init__(self, tool: SqliteTool | SandboxedSqliteTool) -> None:
        self._tool = tool

    async def __aenter__(self) -> _StatelessSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        return None

    async def run(self, call: ToolCall) -> ToolResult:
        return await self._tool.run(call)


class SqliteTool:
    """`async with SqliteTool(SqliteToolSettings(database=...)) as tool: await tool.run(ToolCall(code=sql))`.

    Concurrency: up to `max_concurrency` queries run at once, each on a worker thread. Cancelling a
    `run` stops its query at sqlite's next progress check (every ~1000 VM instructions)."""

    name: ClassVar[str] = "sqlite"
    code_fence: ClassVar[str] = "sql"
    settings_model: ClassVar[type[BaseModel]] = SqliteToolSettings

    def __init__(self, settings: SqliteToolSettings) -> None:
        self.settings = settings
        self._uri: str | None = None
        self._slots = asyncio.Semaphore(settings.max_concurrency)

    async def __aenter__(self) -> SqliteTool:
        self._uri = database_uri(str(check_database(self.settings.database)))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._uri = None

    async def run(self, call: ToolCall) -> ToolResult:
        """Run `call.code` as one read-only query; its problems come back as data."""
        if self._uri is None:
            raise RuntimeError("use the tool inside `async with SqliteTool(settings) as tool:`")
        settings, cancelled = self.settings, threading.Event()
        timeout_s = min(call.timeout_s or settings.timeout_s, settings.timeout_s)
        started = time.perf_counter()
        async with self._slots:
            try:
                outcome = await asyncio.to_thread(
                    run_query, self._uri, call.code, timeout_s=timeout_s, max_rows=settings.max_rows,
                    max_cell_chars=settings.max_cell_chars, is_cancelled=cancelled.is_set)
            except asyncio.CancelledError:
                cancelled.set()  # the worker thread cannot be cancelled; this stops its query
                raise
        return outcome_to_result(outcome, time.perf_counter() - started)

    def session(self) -> _StatelessSession:
        return _StatelessSession(self)


class SandboxedSqliteTool:
    """Like `SqliteTool`, but every query runs in a fresh bubblewrap sandbox (vcpo's local Python
    sandbox running `query.py`), with the database file bound read-only at its host path.

    Concurrency and cancellation are the sandbox's: `max_concurrency` sandboxes at once; cancelling a
    `run` kills its sandbox. Without bubblewrap the tool refuses to start (vcpo's message says how
    to install it)."""

    name: ClassVar[str] = "sqlite_sandboxed"
    code_fence: ClassVar[str] = "sql"
    settings_model: ClassVar[type[BaseModel]] = SandboxedSqliteSettings

    def __init__(self, settings: SandboxedSqliteSettings) -> None:
        self.settings = settings
        self._stack = contextlib.AsyncExitStack()
        self._sandbox: Any = None
        self._uri = ""
        self._program = ""

    async def __aenter__(self) -> SandboxedSqliteTool:
        from tools.sandbox.local_sandbox import LocalPythonSandbox
        from tools.settings import LocalSandboxSettings

        settings = self.settings
        database = check_database(settings.database)
        # inside, the file sits on a read-only bind mount: immutable skips sqlite's locks and journal
        self._uri = database_uri(str(database), is_immutable=True)
        self._program = Path(query.__file__).read_text(encoding="utf-8")  # runs as __main__: main()
        sandbox = LocalPythonSandbox(LocalSandboxSettings(
            timeout_s=settings.timeout_s + _SANDBOX_START_SLACK_S, memory_limit_mb=settings.memory_limit_mb,
            extra_read_only_paths=(str(database),), warm_pool_size=settings.warm_pool_size,
            max_concurrency=settings.max_concurrency, max_output_bytes=_SANDBOX_OUTPUT_BYTES))
        self._sandbox = await self._stack.enter_async_context(sandbox)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._sandbox = None
        await self._stack.aclose()

    async def run(self, call: ToolCall) -> ToolResult:
        """Run `call.code` as one read-only query in a fresh sandbox; its problems come back as data."""
        if self._sandbox is None:
            raise RuntimeError("use the tool inside `async with SandboxedSqliteTool(settings) as tool:`")
        settings = self.settings
        request = {"uri": self._uri, "sql": call.code, "max_rows": settings.max_rows,
                   "timeout_s": min(call.timeout_s or settings.timeout_s, settings.timeout_s),
                   "max_cell_chars": settings.max_cell_chars}
        # the query travels on stdin, never spliced into the program's source
        result: ToolResult = await self._sandbox.run(ToolCall(code=self._program, stdin=json.dumps(request)))
        if result.status == "output_truncated":
            message = (f"The result is larger than {_SANDBOX_OUTPUT_BYTES >> 20} MiB; select fewer or "
                       "shorter columns, or aggregate.")
            return ToolResult(status="error", stderr=message + "\n", exit_code=1, message=message,
                              wall_time_s=result.wall_time_s)
        if result.status != "ok":  # killed (time, memory) or the program failed: the sandbox's account
            return result
        try:
            outcome = QueryOutcome(**json.loads(result.stdout))
        except (ValueError, TypeError) as error:  # our program printed something else: a bug, not data
            raise RuntimeError(f"the sandboxed query program printed no outcome ({error}): "
                               f"{result.stdout[:200]!r}") from error
        return outcome_to_result(outcome, result.wall_time_s)

    def session(self) -> _StatelessSession:
        return _StatelessSession(self)

