"""What the progress line shows between step lines: the phase the current step is in, ticking every
`tick_s` (`LiveActivity`), and the ticker run for the duration of a block (`ticking`). The counts come
from the rollout side (`agent_env.runtime.LiveCounts`); the formatting is `progress.format_activity`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from run.observability.progress import ProgressLine, format_activity, format_elapsed

if TYPE_CHECKING:
    from agent_env.runtime import LiveCounts, RolloutRuntime


class LiveActivity:
    """Between step lines, the progress line shows what the current step is doing (`activity` ticks
    every `tick_s`): waiting for rollouts — episodes finished and running, tokens sampled since the
    phase began — or the learner step, or the weight push. A step of a long-horizon task can take
    many minutes on a CPU, and a display that moves only when a step ends looks hung."""

    def __init__(self, display: ProgressLine, runtime: RolloutRuntime, episodes_per_step: int,
                 tick_s: float = 1.0) -> None:
        self.display, self.runtime, self.tick_s = display, runtime, tick_s
        self.episodes_per_step = episodes_per_step
        self.step, self.phase = 0, "starting"
        self._since = time.monotonic()
        self._start_counts: LiveCounts | None = self._counts()

    def _counts(self) -> LiveCounts | None:
        return self.runtime.live_counts()

    def begin(self, step: int, phase: str) -> None:
        self.step, self.phase, self._since = step, phase, time.monotonic()
        self._start_counts = self._counts()

    def text(self) -> str:
        since = time.monotonic() - self._since
        now, start = self._counts(), self._start_counts
        if self.phase != "rollouts" or now is None or start is None:
            return format_activity(self.step, phase=self.phase, since_s=since)
        return format_activity(self.step, phase="rollouts", since_s=since,
                               episodes_done=now.episodes_finished - start.episodes_finished,
                               episodes_total=self.episodes_per_step, episodes_running=now.episodes_running,
                               tokens=now.tokens_sampled - start.tokens_sampled)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            self.display.activity(self.text())



@contextlib.asynccontextmanager
async def ticking(live: LiveActivity | None) -> Any:
    """Run `live`'s ticker for the duration of the block (nothing when there is no display)."""
    if live is None:
        yield
        return
    task = asyncio.create_task(live.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task



HEARTBEAT_S = 30.0
"""Most seconds between two of vcpo's lines in any phase (the README's promise)."""


@contextlib.contextmanager
def heartbeat(report: Callable[[str], None], what: str, every_s: float | None = None) -> Iterator[None]:
    """While the block runs, `report` "  ... {what}, 0:00:30" every `every_s` — for phases with no progress of
    their own to show, such as an engine compiling its graphs or a learner loading its model. A thread, not
    a task: those phases block the event loop."""
    stop = threading.Event()
    started = time.monotonic()
    interval = HEARTBEAT_S if every_s is None else every_s

    def beat() -> None:
        while not stop.wait(interval):
            report(f"  ... {what}, {format_elapsed(time.monotonic() - started)}")

    thread = threading.Thread(target=beat, name="vcpo-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
