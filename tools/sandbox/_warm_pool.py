"""Started, idle sandboxes waiting for code, so a call need not wait for bwrap and Python to boot.

Every sandbox is still used for exactly one one-shot call (or one session) and then killed: the
pool changes *when* a sandbox starts, not how long it lives, so no state passes between calls.

Concurrency: sandboxes start in background tasks, at most `max_concurrent_starts` at once (a
start mostly waits on the kernel, so a few per CPU overlap; many more would only thrash). The
pool aims to hold `size` idle sandboxes plus one for every waiting caller. It refills when a
caller is done (`replenish`), not when it takes a sandbox, so a call on an idle machine does not
share the CPU with the start of its replacement. `acquire` takes an idle sandbox, or else waits
for the next one that finishes starting, so a burst of callers shares the start-up work instead
of each paying for its own. A start failure goes to a waiting caller as its exception; with
nobody waiting it is logged and retried after a pause. Closing the pool cancels starts in
flight, kills idle sandboxes and fails the callers still waiting.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType

from tools.base import ToolUnavailableError
from tools.sandbox._sandbox_process import SandboxProcess

logger = logging.getLogger(__name__)

_RETRY_AFTER_FAILURE_S = 2.0


class WarmPool:
    """Keeps up to `size` ready sandboxes. Use as an async context manager."""

    def __init__(
        self, start: Callable[[], Awaitable[SandboxProcess]], size: int, max_concurrent_starts: int
    ) -> None:
        self._start = start
        self._size = size
        self._max_concurrent_starts = max_concurrent_starts
        self._idle: collections.deque[SandboxProcess] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[SandboxProcess]] = collections.deque()
        self._starting: set[asyncio.Task[None]] = set()
        self._is_failing = False
        """The last start failed (cleared by the next success)."""
        self._is_open = False
        self._late: list[SandboxProcess] = []
        """Sandboxes that finished starting after the pool closed: killed, and awaited by the close."""
        self.hits = 0
        """Calls served by a sandbox that was idle when they asked."""
        self.misses = 0
        """Calls that had to wait for a sandbox to start."""

    async def __aenter__(self) -> WarmPool:
        self._is_open = True
        self._top_up()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._is_open = False
        starting = list(self._starting)
        for task in starting:
            task.cancel()
        await asyncio.gather(*starting, return_exceptions=True)
        while self._late:
            await self._late.pop().close()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(RuntimeError("the sandbox tool was closed while this call waited"))
        while self._idle:
            await self._idle.popleft().close()

    async def wait_until_settled(self) -> None:
        """Wait until no sandbox is starting (the pool is full or out of demand), or until starts
        fail: a failing pool keeps retrying in the background, and this must not wait for that."""
        while self._starting and not self._is_failing:
            await asyncio.wait(set(self._starting), timeout=0.1, return_when=asyncio.FIRST_COMPLETED)

    def replenish(self) -> None:
        """Start sandboxes until the pool is full again (see the module docstring for when)."""
        self._top_up()

    async def acquire(self) -> SandboxProcess:
        """A ready sandbox; the caller owns it, must close it, and should `replenish()` afterwards."""
        while self._idle:
            sandbox = self._idle.popleft()
            if sandbox.is_running:
                self.hits += 1
                return sandbox
            await sandbox.close()
        self.misses += 1
        waiter: asyncio.Future[SandboxProcess] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._top_up()
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._deliver(waiter.result())  # it arrived as we were cancelled: not ours any more
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise

    def _top_up(self) -> None:
        wanted = self._size + len(self._waiters)
        while (
            self._is_open
            and len(self._idle) + len(self._starting) < wanted
            and len(self._starting) < self._max_concurrent_starts
        ):
            task = asyncio.create_task(self._start_one(), name="vcpo-sandbox-start")
            self._starting.add(task)

    async def _start_one(self) -> None:
        try:
            sandbox = await self._start()
        except ToolUnavailableError as error:
            self._is_failing = True
            waiter = self._next_waiter()
            if waiter is not None:
                waiter.set_exception(error)
            else:
                logger.warning(
                    "could not pre-start a sandbox (retrying in %.0f s): %s", _RETRY_AFTER_FAILURE_S, error
                )
                await asyncio.sleep(_RETRY_AFTER_FAILURE_S)
        else:
            self._is_failing = False
            self._deliver(sandbox)
        finally:
            current = asyncio.current_task()
            if current is not None:
                self._starting.discard(current)
        self._top_up()

    def _next_waiter(self) -> asyncio.Future[SandboxProcess] | None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                return waiter
        return None

    def _deliver(self, sandbox: SandboxProcess) -> None:
        if not self._is_open:
            sandbox.kill_soon()
            self._late.append(sandbox)
            return
        waiter = self._next_waiter()
        if waiter is not None:
            waiter.set_result(sandbox)
        else:
            self._idle.append(sandbox)
