"""The asyncio machinery shared by engines that step a model on one worker thread (HF, vLLM).

`StepRuntime` owns: the single worker thread every blocking engine call runs on (in submission
order, so the model is only ever touched by one thread); the scheduler task that calls the
engine's `step` while there is work and no pause; the step lock that marks step boundaries
(`pause()` and weight loads take it); the in-flight table of requests and their futures; and the
engine's failure state. Engines compose it (they do not inherit from it).

Concurrency: `generate` coroutines register a request and wait on its future (bounded by the
request timeout); the scheduler resolves futures between steps. Cancelling a waiting `generate`
aborts its request through the engine's abort. A step that raises stops the runtime: every
waiter gets the typed error (EngineOOM for out-of-memory) and later calls raise EngineUnavailable.
Every wait here is bounded (step / request timeouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from rollout.errors import EngineError, EngineOOM, EngineTimeout, EngineUnavailable, InvalidRequest
from rollout.openmp import release_openmp_threads
from rollout.request_record import GenerationProgress
from rollout.types import FinishReason, GenerationResult

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class StepRuntime:
    """Worker thread + scheduler + step boundaries + in-flight requests for one engine."""

    def __init__(self, engine: str, *, step_timeout_s: float, request_timeout_s: float) -> None:
        self.engine = engine
        self.step_timeout_s = step_timeout_s
        self.request_timeout_s = request_timeout_s
        self.in_flight: dict[str, tuple[GenerationProgress, asyncio.Future[GenerationResult]]] = {}
        self.step_lock = asyncio.Lock()
        self.is_closing = False
        self.failure: EngineError | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=_thread_name(engine))
        self._wakeup = asyncio.Event()
        self._is_running = asyncio.Event()
        self._is_running.set()
        self._scheduler: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ the worker thread

    async def call(self, fn: Callable[..., _T], *args: Any, timeout_s: float | None = None) -> _T:
        """Run `fn(*args)` on the worker thread; EngineTimeout after `timeout_s` (default: step)."""
        work = asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))
        limit = timeout_s or self.step_timeout_s
        try:
            return await asyncio.wait_for(work, limit)
        except TimeoutError:
            raise EngineTimeout(
                self.engine,
                f"{getattr(fn, '__name__', 'an engine call')} took longer than "
                f"{limit}s; raise the engine's step/start timeout or lower the load",
            ) from None

    # ------------------------------------------------------------------ scheduling and boundaries

    def start_scheduler(
        self, step: Callable[[], Awaitable[None]], has_work: Callable[[], bool], idle_window_s: float = 0.0
    ) -> None:
        """Call `step()` (under the step lock) while `has_work()` and not paused. An idle runtime
        that gets work waits `idle_window_s` first, so requests sent together start together."""
        self._scheduler = asyncio.create_task(
            self._schedule(step, has_work, idle_window_s), name=f"vcpo-{self.engine}-scheduler"
        )

    async def _schedule(
        self, step: Callable[[], Awaitable[None]], has_work: Callable[[], bool], idle_window_s: float
    ) -> None:
        try:
            while not self.is_closing:
                if not has_work():
                    self._wakeup.clear()
                    # Idle: the worker thread's docked OpenMP team would only slow whoever computes
                    # meanwhile (the learner; rollout/openmp.py). A wake-up during this call is kept.
                    await self.call(release_openmp_threads)
                    await self._wakeup.wait()
                    if idle_window_s and not self.is_closing:
                        await asyncio.sleep(idle_window_s)
                    continue
                await self._is_running.wait()
                async with self.step_lock:
                    if self._is_running.is_set() and not self.is_closing and has_work():
                        await step()
        except Exception as exc:
            self.fail(exc)

    def wake(self) -> None:
        """Tell an idle scheduler there is work."""
        self._wakeup.set()

    @contextlib.asynccontextmanager
    async def boundary(self, what: str) -> AsyncIterator[None]:
        """Hold the step lock: no step runs inside. EngineTimeout if the step in flight overruns."""
        try:
            await asyncio.wait_for(self.step_lock.acquire(), self.step_timeout_s)
        except TimeoutError:
            raise EngineTimeout(
                self.engine,
                f"{what} waited longer than {self.step_timeout_s}s for the step in flight to finish",
            ) from None
        try:
            yield
        finally:
            self.step_lock.release()
            self.wake()  # what ran inside (a weight load) may have started a team; an idle scheduler ends it

    async def pause(self) -> None:
        self._is_running.clear()
        async with self.boundary("pause"):
            pass

    def resume(self) -> None:
        self._is_running.set()

    # ------------------------------------------------------------------ requests

    @staticmethod
    def checked(runtime: StepRuntime | None, engine: str, is_started: bool) -> StepRuntime:
        """`runtime`, after checking the engine can serve (EngineUnavailable with the fix if not)."""
        if runtime is None:
            raise EngineUnavailable(engine, "the engine is not started; use `async with engine:`")
        runtime.check_alive(is_started)
        return runtime

    def check_alive(self, is_started: bool) -> None:
        if self.failure is not None:
            raise EngineUnavailable(
                self.engine, f"the engine stopped after an earlier failure: {self.failure}"
            )
        if not is_started or self.is_closing:
            raise EngineUnavailable(
                self.engine,
                "the engine is not running; use `async with engine:` (it "
                "starts the engine) and do not use it after close()",
            )

    def register(self, progress: GenerationProgress) -> asyncio.Future[GenerationResult]:
        """Add a request to the in-flight table; InvalidRequest for a duplicate id."""
        if progress.request_id in self.in_flight:
            raise InvalidRequest(
                self.engine,
                f"request_id {progress.request_id!r} is already in flight; use a unique id per request",
            )
        future: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        self.in_flight[progress.request_id] = (progress, future)
        return future

    async def wait(
        self,
        request_id: str,
        future: asyncio.Future[GenerationResult],
        abort: Callable[[str], Awaitable[None]],
    ) -> GenerationResult:
        """Wait for a request's result; abort it on timeout (EngineTimeout) or cancellation."""
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.request_timeout_s)
        except TimeoutError:
            await abort(request_id)
            raise EngineTimeout(
                self.engine,
                f"request {request_id!r} took longer than request_timeout_s="
                f"{self.request_timeout_s}; raise it or lower max_new_tokens",
            ) from None
        except asyncio.CancelledError:
            await asyncio.shield(abort(request_id))
            raise

    def resolve(
        self, progress: GenerationProgress, version: int, finish_reason: FinishReason | None = None
    ) -> None:
        """Freeze a request's result (at engine version `version`) and wake its waiter."""
        entry = self.in_flight.pop(progress.request_id, None)
        if entry is not None and not entry[1].done():
            entry[1].set_result(progress.result(version, finish_reason))

    def fail(self, exc: BaseException) -> None:
        """Stop serving: every waiter gets the typed error; later calls raise EngineUnavailable."""
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, EngineError):
            error = exc
        elif "out of memory" in text.lower():
            error = EngineOOM(
                self.engine,
                "the engine ran out of memory; lower the batch size, the "
                "max model length or the KV cache space",
                text,
            )
        else:
            error = EngineUnavailable(
                self.engine,
                "an engine step failed and the engine stopped; close it and start a new one",
                text,
            )
        error.__cause__ = exc
        log.error("%s engine stopped: %s", self.engine, error)
        self.failure = error
        for _, future in self.in_flight.values():
            if not future.done():
                future.set_exception(error)
                future.add_done_callback(lambda done: done.exception())  # mark retrieved
        self.in_flight.clear()

    # ------------------------------------------------------------------ shutdown

    async def stop(self, version: int) -> None:
        """Stop the scheduler (letting the step in flight finish) and answer every request 'abort'."""
        self.is_closing = True
        self._is_running.set()
        self._wakeup.set()
        if self._scheduler is not None:
            try:
                await asyncio.wait_for(self._scheduler, self.step_timeout_s)
            except TimeoutError:
                log.warning(
                    "%s engine: the step in flight did not finish in %ss; stopping anyway",
                    self.engine,
                    self.step_timeout_s,
                )
        for progress, _ in list(self.in_flight.values()):
            self.resolve(progress, version, "abort")

    def shutdown(self) -> None:
        """Release the worker thread (after `stop` and any final `call`)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _thread_name(engine: str) -> str:
    return f"vcpo-{engine}-engine"
