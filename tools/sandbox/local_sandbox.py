"""The default tool: model-written Python (or bash) run locally under bubblewrap.

Each `run` gets a fresh interpreter in a fresh sandbox (no network, read-only system, private
size-capped tmpfs, own PID namespace, clean environment, rlimits, wall-clock kill of the whole
tree, byte-capped output). `session()` keeps one interpreter alive across calls of a trajectory.
The isolation itself is built in `_bwrap.py` and `_sandbox_runner.py`; this module is the policy:
limits per call, concurrency, warm pool, sessions and result mapping.

Concurrency: up to `max_concurrency` executions run at once (a semaphore); more callers wait.
Sessions hold a sandbox while idle but take a slot only while executing. Cancelling a `run`
kills its sandbox. Leaving the context kills every sandbox the tool started.
Without bubblewrap the tool refuses to start (see `_launcher.INSTALL_HINT`).
"""

from __future__ import annotations

import asyncio
import base64
import os
import weakref
from types import TracebackType
from typing import Any, ClassVar

from pydantic import BaseModel

from tools.base import ToolCall, ToolResult
from tools.sandbox._launcher import SandboxLauncher
from tools.sandbox._outcome import outcome_to_result
from tools.sandbox._sandbox_process import SandboxProcess
from tools.sandbox._warm_pool import WarmPool
from tools.settings import LocalSandboxSettings


class LocalPythonSandbox:
    """`async with LocalPythonSandbox(settings) as tool: result = await tool.run(ToolCall(code=...))`"""

    name: ClassVar[str] = "python"
    settings_model: ClassVar[type[BaseModel]] = LocalSandboxSettings

    def __init__(self, settings: LocalSandboxSettings | None = None) -> None:
        self.settings = settings or LocalSandboxSettings()
        self._launcher: SandboxLauncher | None = None
        self._pool: WarmPool | None = None
        self._slots = asyncio.Semaphore(self.settings.max_concurrency)
        self._sessions: weakref.WeakSet[LocalSandboxSession] = weakref.WeakSet()
        self._counts = {"calls": 0, "timeouts": 0, "memory": 0, "errors": 0, "truncated": 0}

    async def __aenter__(self) -> LocalPythonSandbox:
        launcher = await SandboxLauncher.create(self.settings)
        # Start one sandbox now so that a broken setup fails here, with bwrap's own message.
        await (await launcher.start()).close()
        self._launcher = launcher
        max_concurrent_starts = self.settings.max_concurrent_starts or 4 * (os.cpu_count() or 1)
        self._pool = WarmPool(launcher.start, self.settings.warm_pool_size, max_concurrent_starts)
        await self._pool.__aenter__()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for session in list(self._sessions):
            await session.close()
        if self._pool is not None:
            await self._pool.__aexit__(exc_type, exc, tb)
        self._pool = None
        self._launcher = None

    @property
    def launcher(self) -> SandboxLauncher:
        if self._launcher is None:
            raise RuntimeError("use the tool inside `async with LocalPythonSandbox(settings) as tool:`")
        return self._launcher

    async def run(self, call: ToolCall) -> ToolResult:
        """Run `call` in a fresh sandbox (pre-started if the warm pool has one) and kill it after."""
        async with self._slots:
            sandbox = await self._acquire()
            try:
                return await self._execute(
                    sandbox, call, preamble=self.settings.preamble, is_last=True, is_session=False
                )
            finally:
                self._replenish()

    def session(self) -> LocalSandboxSession:
        """A stateful interpreter: `async with tool.session() as session: await session.run(call)`."""
        session = LocalSandboxSession(self)
        self._sessions.add(session)
        return session

    async def wait_for_warm_pool(self) -> None:
        """Wait until the warm pool has no sandbox starting (for benchmarks and tests)."""
        if self._pool is not None:
            await self._pool.wait_until_settled()

    def metrics(self) -> dict[str, float]:
        """Counters since start, keyed `tools/python_<name>`."""
        pool = self._pool
        values = {f"tools/python_{key}": float(value) for key, value in self._counts.items()}
        values["tools/python_warm_pool_hits"] = float(pool.hits if pool else 0)
        values["tools/python_warm_pool_misses"] = float(pool.misses if pool else 0)
        return values

    def _replenish(self) -> None:
        if self._pool is not None:
            self._pool.replenish()

    async def _acquire(self) -> SandboxProcess:
        if self._pool is None:
            raise RuntimeError("use the tool inside `async with LocalPythonSandbox(settings) as tool:`")
        return await self._pool.acquire()

    async def _execute(
        self, sandbox: SandboxProcess, call: ToolCall, *, preamble: str, is_last: bool, is_session: bool
    ) -> ToolResult:
        settings = self.settings
        timeout_s = min(call.timeout_s or settings.timeout_s, settings.timeout_s)
        memory_limit_mb = min(call.memory_limit_mb or settings.memory_limit_mb, settings.memory_limit_mb)
        cpu_time_limit_s = settings.effective_cpu_time_limit_s
        if call.timeout_s is not None:
            cpu_time_limit_s = min(cpu_time_limit_s, int(timeout_s) + 1)
        request: dict[str, Any] = {
            "code": call.code,
            "language": call.language,
            "preamble": preamble if call.language == "python" else "",
            "stdin": call.stdin,
            "files": {path: base64.b64encode(content).decode() for path, content in call.files.items()},
            "fetch_files": list(call.fetch_files),
            "max_fetch_file_bytes": settings.max_fetch_file_bytes,
            "cpu_time_limit_s": cpu_time_limit_s,
            "memory_limit_bytes": memory_limit_mb << 20,
            "is_last": is_last,
        }
        outcome = await sandbox.execute(
            request, timeout_s=timeout_s, max_output_bytes=settings.max_output_bytes
        )
        result = outcome_to_result(
            outcome,
            timeout_s=timeout_s,
            cpu_time_limit_s=cpu_time_limit_s,
            memory_limit_mb=memory_limit_mb,
            is_session=is_session,
        )
        self._count(result)
        return result

    def _count(self, result: ToolResult) -> None:
        self._counts["calls"] += 1
        key = {"timeout": "timeouts", "memory": "memory", "error": "errors", "output_truncated": "truncated"}
        if result.status in key:
            self._counts[key[result.status]] += 1


class LocalSandboxSession:
    """One long-lived interpreter; calls run one after another in the same namespace.

    A call that kills the interpreter (timeout, os._exit, fatal signal) returns a result with
    `is_session_reset=True`; the next call starts a fresh interpreter (preamble included).
    """

    def __init__(self, tool: LocalPythonSandbox) -> None:
        self._tool = tool
        self._sandbox: SandboxProcess | None = None
        self._lock = asyncio.Lock()
        self._is_closed = False

    async def __aenter__(self) -> LocalSandboxSession:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def run(self, call: ToolCall) -> ToolResult:
        async with self._lock:
            if self._is_closed:
                raise RuntimeError("this session is closed; open a new one with tool.session()")
            async with self._tool._slots:
                is_fresh = self._sandbox is None
                if self._sandbox is None:
                    self._sandbox = await self._tool._acquire()
                preamble = self._tool.settings.preamble if is_fresh else ""
                try:
                    result = await self._tool._execute(
                        self._sandbox, call, preamble=preamble, is_last=False, is_session=True
                    )
                finally:
                    self._tool._replenish()
            if result.is_session_reset:
                self._sandbox = None
            return result

    async def close(self) -> None:
        """Kill the interpreter. Idempotent."""
        self._is_closed = True
        sandbox, self._sandbox = self._sandbox, None
        if sandbox is not None:
            await sandbox.close()
