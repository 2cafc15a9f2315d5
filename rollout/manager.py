"""The asynchronous rollout manager: groups of episodes in flight with a guaranteed lag bound `k`.

Semantics (docs/architecture.md, PipelineRL-style). Groups are admitted in order; group `i` gets a
*batch slot* `b = i // groups_per_batch` and is consumed by learner step `b`, which runs at policy
version `b` (version = optimizer steps done). Group `i` is admitted only once the published version
`v ≥ b − k`. Its first token is sampled at a version `v_start ≥ v` (versions never decrease), so its
lag at consumption, `b − v_start`, is at most `k` — a guarantee, not a target. `k = 0` is
synchronous on-policy RL: batch `b` is generated entirely by version `b` while the learner waits.
At most `groups_per_batch · (k + 1)` groups are admitted and not yet consumed (the buffer bound),
and at most `max_concurrent_groups` run at once (admission control / backpressure).

The bound may change during a run (`set_max_lag`, driven by `rollout/lag_control.py` under
`rollout.max_lag: auto`): each group records the bound it was admitted under (`GroupTicket.lag_bound`)
and lags at most that; a lowered bound holds back new admissions and replacements alike (a replacement
is admitted under the bound in force then), while groups already admitted keep their own bound.

Partial rollouts: weights are published with `sync_weights`, which pauses the engine at a step
boundary, loads them with the new version and resumes; generations in flight continue with the new
weights and their per-token versions/logprobs stay exact (the engine protocol guarantees it).

Failures: a group whose episode raises is dropped, counted, and *replaced* by a fresh prompt in the
same batch slot (admitted now, so its lag bound still holds); `max_attempts` consecutive failures of
one slot raise `RolloutFailed` (something systemic is wrong).

Dynamic sampling (DAPO's, as slime and veRL offer it): with `accept`, a finished group it rejects —
e.g. every episode scored alike, so it carries no group-relative signal — is dropped and its slot
refilled the same way, by a fresh prompt admitted at the current version (inside the lag bound), at most
`max_refills` times per batch slot; past that the slot takes what it gets. Refills and the tokens the
dropped groups sampled are counted (`RolloutCounters`). Nothing is lost or used twice across
checkpoint/resume: `state()` records the data position, the completed groups not yet consumed and
the slots still in flight, which `restore()` re-admits first.

Concurrency: everything runs on one asyncio loop; `run_group` coroutines run concurrently; the
learner awaits `next_batch()` (blocks until its slot is complete) and calls `sync_weights`. `close()`
cancels what is in flight (the engine aborts those requests) and waits for it to unwind.

`total_batches` stops admission after the last slot the learner will consume (no generation is
wasted at the end of a run). `saturate=True` is the stress-test mode of `vcpo bench staleness`:
`next_batch()` first waits until every group the bound admits at the current version has been
generated, so the engine is always the full `k` batches ahead and each batch's lag is exactly
`min(k, b)` whatever the relative speed of engine and learner (otherwise the realised lag depends
on which side is faster, and a fast learner never sees a large lag).

`clock` (a `SimulatedClock`, rollout/sim_clock.py) puts the run on a simulated timeline: group g is
admitted only once the published version reaches the one the timeline admits it under, and, as in
saturate mode, `next_batch()` first waits until everything the timeline admits at the current version has
been generated — so each group is generated with exactly the version the timeline gives it, and the lags
are the ones that timing would produce. Version v's stretch of the timeline is simulated when v is
published, under the bound then in force (`set_max_lag` before `publish_version`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from rollout.errors import EngineUnavailable
from rollout.sim_clock import SimulatedClock
from rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupTicket:
    """One admitted group: where it sits in the run and which prompt it samples."""

    group_index: int
    """Admission order of its batch slot (stable across replacements)."""
    batch_index: int
    """The learner step (= policy version) that consumes it."""
    prompt_position: int
    """Position in the data order (the data source maps it to a sample)."""
    attempt: int = 0
    """0 for the first try of a slot, n for its n-th replacement."""
    admitted_version: int = 0
    """Published version at admission (≤ every token's version)."""
    refill: int = 0
    """0, or n for the n-th group of this slot's batch that replaced one dynamic sampling dropped."""
    lag_bound: int | None = None
    """The lag bound in force at admission: the group's lag is at most this (None: not admitted yet, or
    restored from a checkpoint written before the bound was recorded)."""

    def lag_of(self, trajectory: Trajectory, version: int) -> int:
        """A member's lag when the learner at `version` consumes it: from the version its first generation
        started with, or — for a member that never reached the engine (no sampled token: a prompt already
        over the token budget), whose trajectory has no version of its own — from its group's admission."""
        start = trajectory.versions.start if trajectory.num_sampled_tokens > 0 else self.admitted_version
        return version - start


RunGroup = Callable[[GroupTicket], Awaitable[Sequence[Trajectory]]]
"""Runs the G episodes of one group and returns their trajectories (raises on failure)."""


class WeightTarget(Protocol):
    """Where `sync_weights` publishes: an `InferenceEngine`, or a pool of remote ones (the Ray launcher)."""

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None: ...


class RolloutFailed(RuntimeError):
    """A batch slot failed `max_attempts` times in a row."""


@dataclass
class RolloutCounters:
    """Counts for metrics."""

    groups_completed: int = 0
    groups_failed: int = 0
    groups_refilled: int = 0
    """Finished groups `accept` rejected and replaced (dynamic sampling): a running total."""
    refill_tokens: int = 0
    """Tokens the rejected groups sampled: the generation dynamic sampling cost, a running total."""
    trajectories: int = 0
    last_errors: list[str] = field(default_factory=list)


class RolloutManager:
    """Bounded-lag producer of trajectory groups (see the module docstring)."""

    def __init__(
        self,
        engine: WeightTarget,
        run_group: RunGroup,
        *,
        groups_per_batch: int,
        max_lag: int,
        max_concurrent_groups: int,
        max_attempts: int = 3,
        fatal_errors: tuple[type[BaseException], ...] = (EngineUnavailable,),
        total_batches: int | None = None,
        saturate: bool = False,
        accept: Callable[[Sequence[Trajectory]], bool] | None = None,
        max_refills: int = 0,
        clock: SimulatedClock | None = None,
    ) -> None:
        if groups_per_batch < 1 or max_lag < 0 or max_concurrent_groups < 1 or max_refills < 0:
            raise ValueError(
                f"groups_per_batch={groups_per_batch} (≥1), max_lag={max_lag} (≥0), max_concurrent_groups="
                f"{max_concurrent_groups} (≥1), max_refills={max_refills} (≥0) out of range"
            )
        self.engine = engine
        self._run_group = run_group
        self.groups_per_batch = groups_per_batch
        self.max_lag = max_lag
        self.max_concurrent_groups = max_concurrent_groups
        self.max_attempts = max_attempts
        self.total_batches = total_batches
        """Batch slots the learner will consume; None = unbounded (admit forever)."""
        self.saturate = saturate
        """Stress mode: next_batch waits until everything admissible at this version is generated."""
        self.fatal_errors = fatal_errors
        """Errors that stop the run at once (a dead engine or sandbox), not retried with new prompts."""
        self.accept = accept
        """Dynamic sampling: a finished group this rejects is replaced (None = every group is kept)."""
        self.max_refills = max_refills
        """Rejected groups replaced per batch slot at most; past that they are kept."""
        self.clock = clock
        """The simulated timeline the admissions follow (None = real time)."""
        self._refills: dict[int, int] = {}
        self._last_batch_refills = 0
        self._dropped_rewards: dict[int, list[float]] = {}
        self._last_batch_dropped_rewards: list[float] = []
        self.counters = RolloutCounters()
        self._version = 0
        self._next_group_index = 0
        self._next_prompt_position = 0
        self._next_batch_index = 0
        self._completed: dict[int, list[tuple[GroupTicket, list[Trajectory]]]] = {}
        self._in_flight: dict[int, tuple[GroupTicket, asyncio.Task[None]]] = {}
        self._retry: list[GroupTicket] = []
        self._changed = asyncio.Condition()
        self._admitter: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None
        self._busy_s = 0.0
        self._busy_since: float | None = None

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start admitting groups (call once, after `restore` when resuming)."""
        self._open_clock()
        self._admitter = asyncio.create_task(self._admit_forever(), name="rollout-admission")

    async def close(self) -> None:
        """Stop admitting, cancel every group in flight and wait for them to unwind."""
        tasks = [task for _, task in self._in_flight.values()]
        if self._admitter is not None:
            tasks.append(self._admitter)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._in_flight.clear()
        self._admitter = None

    async def __aenter__(self) -> RolloutManager:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- the learner side ------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    async def next_batch(self) -> list[tuple[GroupTicket, list[Trajectory]]]:
        """The groups of the next batch slot, ordered by group index (waits until all are done)."""
        batch = self._next_batch_index
        async with self._changed:
            if self.saturate or self.clock is not None:  # nothing in flight, nothing more admissible
                await self._changed.wait_for(
                    lambda: self._failure is not None or (not self._in_flight and not self._can_admit()))
            await self._changed.wait_for(
                lambda: self._failure is not None
                or len(self._completed.get(batch, ())) >= self.groups_per_batch
            )
            if self._failure is not None:
                raise self._failure
            groups = sorted(self._completed.pop(batch), key=lambda item: item[0].group_index)
            self._next_batch_index += 1
            self._last_batch_refills = self._refills.get(batch, 0)
            self._refills = {b: n for b, n in self._refills.items() if b > batch}
            self._last_batch_dropped_rewards = self._dropped_rewards.pop(batch, [])
            self._changed.notify_all()
        return groups

    async def sync_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Publish new weights: pause at a step boundary, load with `version`, resume, admit more."""
        await self.engine.pause()
        try:
            await self.engine.load_weights(named_tensors, version)
        finally:
            await self.engine.resume()
        await self.publish_version(version)

    async def set_max_lag(self, bound: int) -> None:
        """Change the lag bound k for every admission from now on (groups admitted before keep theirs)."""
        if bound < 0:
            raise ValueError(f"max_lag={bound} must be ≥ 0")
        async with self._changed:
            self.max_lag = bound
            self._changed.notify_all()

    async def publish_version(self, version: int) -> None:
        """Record that the engine now serves `version` (when weights were loaded elsewhere)."""
        async with self._changed:
            self._version = version
            self._open_clock()
            self._changed.notify_all()

    def busy_seconds(self) -> float:
        """Wall seconds so far during which at least one group was generating (idle = wall − this)."""
        now = time.perf_counter()
        return self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)

    def _track_busy(self) -> None:
        now = time.perf_counter()
        if self._in_flight and self._busy_since is None:
            self._busy_since = now
        elif not self._in_flight and self._busy_since is not None:
            self._busy_s += now - self._busy_since
            self._busy_since = None

    # --- admission -------------------------------------------------------------------------------

    def _open_clock(self) -> None:
        """Simulate the timeline up to the published version, under the bound in force."""
        if self.clock is not None:
            while self.clock.opened <= self._version:
                self.clock.open_version(self.clock.opened, self.max_lag)

    def _in_bound(self, batch: int) -> bool:
        return batch - self.max_lag <= self._version  # lag bound: b − v_start ≤ b − v ≤ k

    def _admissible_retry(self) -> int | None:
        """Index in `_retry` of the first replacement the bound in force admits now (a replacement's slot
        was admitted under an earlier bound, which may have been lowered since)."""
        return next((i for i, ticket in enumerate(self._retry) if self._in_bound(ticket.batch_index)), None)

    def _can_admit(self) -> bool:
        if self.clock is not None:  # the timeline decides when (its engine's capacity included)
            if self._admissible_retry() is not None:
                return True
            admitted = self.clock.admission_version(self._next_group_index)
            return admitted is not None and admitted <= self._version
        if len(self._in_flight) >= self.max_concurrent_groups:
            return False
        if self._admissible_retry() is not None:
            return True
        batch = self._next_group_index // self.groups_per_batch
        if self.total_batches is not None and batch >= self.total_batches:
            return False  # past the last slot the learner consumes
        return self._in_bound(batch)

    async def _admit_forever(self) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(self._can_admit)
                retry = self._admissible_retry()
                if retry is not None:
                    ticket = self._retry.pop(retry)
                    if ticket.prompt_position < 0:  # a replacement: a fresh prompt, admitted now
                        ticket = GroupTicket(ticket.group_index, ticket.batch_index, self._take_prompt(),
                                             ticket.attempt, self._version, ticket.refill)
                    ticket = replace(ticket, lag_bound=self.max_lag)
                else:
                    index = self._next_group_index
                    ticket = GroupTicket(index, index // self.groups_per_batch, self._take_prompt(), 0,
                                         self._version, lag_bound=self.max_lag)
                    self._next_group_index += 1
                task = asyncio.create_task(self._run(ticket), name=f"group-{ticket.group_index}")
                self._in_flight[ticket.group_index] = (ticket, task)
                self._track_busy()

    def _take_prompt(self) -> int:
        position = self._next_prompt_position
        self._next_prompt_position += 1
        return position

    async def _run(self, ticket: GroupTicket) -> None:
        try:
            trajectories = list(await self._run_group(ticket))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one bad group never ends the run: replace it, count it
            await self._on_failure(ticket, exc)
            return
        async with self._changed:
            self._in_flight.pop(ticket.group_index, None)
            self._track_busy()
            if self._refill(ticket, trajectories):
                self._changed.notify_all()
                return
            self._completed.setdefault(ticket.batch_index, []).append((ticket, trajectories))
            self.counters.groups_completed += 1
            self.counters.trajectories += len(trajectories)
            self._changed.notify_all()

    def _refill(self, ticket: GroupTicket, trajectories: list[Trajectory]) -> bool:
        """Dynamic sampling (under the lock): whether the finished group is dropped and its slot queued
        for a fresh prompt."""
        if self.accept is None or self._refills.get(ticket.batch_index, 0) >= self.max_refills:
            return False
        if self.accept(trajectories):
            return False
        self._refills[ticket.batch_index] = self._refills.get(ticket.batch_index, 0) + 1
        self.counters.groups_refilled += 1
        self.counters.refill_tokens += sum(t.num_sampled_tokens for t in trajectories)
        self._dropped_rewards.setdefault(ticket.batch_index, []).extend(t.reward for t in trajectories)
        self._retry.append(GroupTicket(ticket.group_index, ticket.batch_index, -1, 0,
                                       refill=self._refills[ticket.batch_index]))
        return True

    @property
    def last_batch_refills(self) -> int:
        """Groups dynamic sampling dropped and replaced in the batch `next_batch` returned last."""
        return self._last_batch_refills

    @property
    def last_batch_dropped_rewards(self) -> list[float]:
        """The rewards of the episodes dynamic sampling dropped from the batch `next_batch` returned last:
        with the batch's own, every episode generated for that step (the trained ones alone are tilted
        towards groups that scored unalike)."""
        return list(self._last_batch_dropped_rewards)

    async def _on_failure(self, ticket: GroupTicket, exc: Exception) -> None:
        root: BaseException = exc
        while isinstance(root, BaseExceptionGroup) and root.exceptions:  # a group's first failed episode
            root = root.exceptions[0]
        where = f"group {ticket.group_index} (prompt {ticket.prompt_position})"
        message = f"{where}: {type(root).__name__}: {root}"
        log.warning("rollout: %s; replacing it with a new prompt", message)
        async with self._changed:
            self._in_flight.pop(ticket.group_index, None)
            self._track_busy()
            self.counters.groups_failed += 1
            self.counters.last_errors = [*self.counters.last_errors[-4:], message]
            if isinstance(root, self.fatal_errors):
                self._failure = RolloutFailed(f"a systemic error stops the run: {message}")
            elif ticket.attempt + 1 >= self.max_attempts:
                self._failure = RolloutFailed(
                    f"batch slot {ticket.batch_index} failed {self.max_attempts} times in a row; "
                    f"last: {message}")
            else:
                retry = GroupTicket(ticket.group_index, ticket.batch_index, -1, ticket.attempt + 1,
                                    refill=ticket.refill)
                self._retry.append(retry)
            self._changed.notify_all()

    # --- checkpoint ------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a checkpoint needs: data position, completed-unconsumed groups, slots in flight."""
        return {
            "version": self._version,
            "next_group_index": self._next_group_index,
            "next_prompt_position": self._next_prompt_position,
            "next_batch_index": self._next_batch_index,
            "completed": [
                {"ticket": vars(ticket), "trajectories": [t.to_msgpack() for t in trajectories]}
                for items in self._completed.values() for ticket, trajectories in items
            ],
            "pending": [vars(ticket) for ticket, _ in self._in_flight.values()]
            + [vars(ticket) for ticket in self._retry],
            "counters": {"groups_completed": self.counters.groups_completed,
                         "groups_failed": self.counters.groups_failed,
                         "groups_refilled": self.counters.groups_refilled,
                         "refill_tokens": self.counters.refill_tokens,
                         "trajectories": self.counters.trajectories},
            "refills": {str(b): n for b, n in self._refills.items()},
            "dropped_rewards": {str(b): rewards for b, rewards in self._dropped_rewards.items()},
            **({"clock": self.clock.state()} if self.clock is not None else {}),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Resume from `state()` (before `start`): completed groups come back, pending slots re-run
        with their original prompts (a fresh generation at the current version, same batch slot)."""
        if self._admitter is not None:
            raise RuntimeError("restore() must be called before start()")
        self._version = state["version"]
        self._next_group_index = state["next_group_index"]
        self._next_prompt_position = state["next_prompt_position"]
        self._next_batch_index = state["next_batch_index"]
        for item in state["completed"]:
            ticket = GroupTicket(**item["ticket"])
            trajectories = [Trajectory.from_msgpack(data) for data in item["trajectories"]]
            self._completed.setdefault(ticket.batch_index, []).append((ticket, trajectories))
        # a re-run keeps its prompt (attempt 0 reuses prompt_position) so no prompt is lost or doubled
        self._retry = [GroupTicket(**{**t, "attempt": 0, "admitted_version": self._version})
                       if t["prompt_position"] >= 0 else GroupTicket(**t) for t in state["pending"]]
        counters = state.get("counters", {})
        self.counters.groups_completed = counters.get("groups_completed", 0)
        self.counters.groups_failed = counters.get("groups_failed", 0)
        self.counters.groups_refilled = counters.get("groups_refilled", 0)
        self.counters.refill_tokens = counters.get("refill_tokens", 0)
        self.counters.trajectories = counters.get("trajectories", 0)
        self._refills = {int(b): n for b, n in state.get("refills", {}).items()}
        self._dropped_rewards = {int(b): list(r) for b, r in state.get("dropped_rewards", {}).items()}
        if self.clock is not None and "clock" in state:  # the same timeline: replayed from its bounds
            self.clock.restore(state["clock"])
