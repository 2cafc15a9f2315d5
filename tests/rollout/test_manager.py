"""The rollout manager's lag bound, failure replacement and checkpoint state, on the scripted engine
(control logic only; the real-engine runs are in tests/run/train/test_train_e2e.py)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from rollout.fakes import ScriptedEngine
from rollout.manager import GroupTicket, RolloutFailed, RolloutManager
from rollout.sim_clock import ClockSettings, SimulatedClock
from rollout.trajectory import Trajectory, TrajectoryBuilder
from rollout.types import GenerationRequest, GenerationResult, SamplingParams

GROUP_SIZE = 2


def _group_runner(engine: ScriptedEngine, seed: int, fail_prompts: frozenset[int] = frozenset()):
    rng = random.Random(seed)

    async def run_group(ticket: GroupTicket) -> list[Trajectory]:
        await asyncio.sleep(rng.random() * 0.02)  # random start delay
        if ticket.prompt_position in fail_prompts:
            raise RuntimeError("poisoned sample")
        trajectories = []
        for member in range(GROUP_SIZE):
            request = GenerationRequest(request_id=f"{ticket.group_index}-{ticket.attempt}-{member}",
                                        prompt_token_ids=(5, 6),
                                        sampling=SamplingParams(max_new_tokens=rng.randint(1, 6)))
            builder = TrajectoryBuilder(request.prompt_token_ids)
            builder.add_generation(await engine.generate(request))
            trajectories.append(builder.build(request.request_id, f"g{ticket.group_index}",
                                              reward=float(ticket.prompt_position)))
        return trajectories

    return run_group


async def _train(manager: RolloutManager, engine: ScriptedEngine, steps: int) -> list[list[int]]:
    """Consume `steps` batches like the learner; returns each batch's lags (version − v_start)."""
    lags = []
    for step in range(steps):
        groups = await manager.next_batch()
        assert all(ticket.batch_index == step for ticket, _ in groups)
        lags.append([step - t.versions.start for _, trajectories in groups for t in trajectories])
        await asyncio.sleep(random.random() * 0.02)  # a learner step of random length
        await manager.sync_weights([("w", torch.zeros(1))], step + 1)
    return lags


@pytest.mark.parametrize("max_lag", [0, 1, 3])
async def test_lag_never_exceeds_the_bound_under_random_delays(max_lag: int) -> None:
    async with ScriptedEngine(token_delay_s=0.002) as engine:
        manager = RolloutManager(engine, _group_runner(engine, seed=max_lag), groups_per_batch=3,
                                 max_lag=max_lag, max_concurrent_groups=8)
        async with manager:
            lags = await _train(manager, engine, steps=8)
    flat = [lag for batch in lags for lag in batch]
    assert max(flat) <= max_lag
    assert min(flat) >= 0
    if max_lag == 0:
        assert set(flat) == {0}  # synchronous: batch b is generated entirely by version b
    else:
        assert max(flat) >= 1  # the pipeline actually overlapped generation with training


@pytest.mark.parametrize("max_lag", [0, 2, 5])
async def test_saturate_makes_every_lag_exactly_the_bound_even_with_a_slow_engine(max_lag: int) -> None:
    # a slow engine (10 ms per token) and a fast learner: without saturation lags stay near 0
    async with ScriptedEngine(token_delay_s=0.01) as engine:
        manager = RolloutManager(engine, _group_runner(engine, seed=max_lag), groups_per_batch=2,
                                 max_lag=max_lag, max_concurrent_groups=100, saturate=True,
                                 total_batches=8)
        async with manager:
            lags = await _train(manager, engine, steps=8)
            state = manager.state()
    assert [set(batch) for batch in lags] == [{min(max_lag, step)} for step in range(8)]
    assert state["next_group_index"] == 16  # total_batches: nothing admitted past the last slot


async def test_total_batches_stops_admission_after_the_last_slot() -> None:
    async with ScriptedEngine(token_delay_s=0.0) as engine:
        manager = RolloutManager(engine, _group_runner(engine, 0), groups_per_batch=2, max_lag=4,
                                 max_concurrent_groups=100, total_batches=3)
        async with manager:
            await asyncio.sleep(0.2)
            state = manager.state()
    assert state["next_group_index"] == 6


async def test_admitted_but_unconsumed_groups_never_exceed_the_buffer_bound() -> None:
    async with ScriptedEngine(token_delay_s=0.0) as engine:
        manager = RolloutManager(engine, _group_runner(engine, 0), groups_per_batch=2, max_lag=1,
                                 max_concurrent_groups=100)
        async with manager:
            await asyncio.sleep(0.2)  # the learner never consumes: admission must stop by itself
            state = manager.state()
    # (k + 1) batches of 2 groups: batch 0 and batch 1 at version 0
    assert state["next_group_index"] == 4


async def test_a_failing_group_is_replaced_in_its_slot_and_counted() -> None:
    async with ScriptedEngine() as engine:
        manager = RolloutManager(engine, _group_runner(engine, 1, fail_prompts=frozenset({1})),
                                 groups_per_batch=2, max_lag=0, max_concurrent_groups=4)
        async with manager:
            groups = await manager.next_batch()
    assert manager.counters.groups_failed == 1
    assert sorted(ticket.group_index for ticket, _ in groups) == [0, 1]
    assert 1 not in {ticket.prompt_position for ticket, _ in groups}  # the poisoned prompt is gone


async def test_a_slot_that_always_fails_stops_the_run_with_the_reason() -> None:
    async with ScriptedEngine() as engine:
        manager = RolloutManager(engine, _group_runner(engine, 2, fail_prompts=frozenset(range(100))),
                                 groups_per_batch=1, max_lag=0, max_concurrent_groups=1, max_attempts=3)
        async with manager:
            with pytest.raises(RolloutFailed, match="poisoned sample"):
                await manager.next_batch()


async def test_state_and_restore_lose_no_group_and_use_none_twice() -> None:
    async with ScriptedEngine(token_delay_s=0.003) as engine:
        first = RolloutManager(engine, _group_runner(engine, 3), groups_per_batch=2, max_lag=2,
                               max_concurrent_groups=3)
        async with first:
            consumed = [ticket.prompt_position for ticket, _ in await first.next_batch()]
            await first.sync_weights([("w", torch.zeros(1))], 1)
            await asyncio.sleep(0.01)
            state = first.state()  # some groups completed, some in flight
        assert state["pending"] or state["completed"]
        second = RolloutManager(engine, _group_runner(engine, 4), groups_per_batch=2, max_lag=2,
                                max_concurrent_groups=3)
        second.restore(state)
        async with second:
            for step in range(1, 5):
                groups = await second.next_batch()
                assert {ticket.batch_index for ticket, _ in groups} == {step}
                consumed += [ticket.prompt_position for ticket, _ in groups]
                lags = [step - t.versions.start for _, ts in groups for t in ts]
                assert max(lags) <= 2
                await second.sync_weights([("w", torch.zeros(1))], step + 1)
    assert sorted(consumed) == list(range(10))  # every prompt exactly once, none skipped


async def test_a_dead_engine_stops_the_run_at_once_instead_of_burning_prompts() -> None:
    from rollout.errors import EngineUnavailable

    async def dead(ticket: GroupTicket) -> list[Trajectory]:
        raise EngineUnavailable("scripted", "the engine stopped")

    async with ScriptedEngine() as engine:
        manager = RolloutManager(engine, dead, groups_per_batch=1, max_lag=0, max_concurrent_groups=1,
                                 max_attempts=10)
        async with manager:
            with pytest.raises(RolloutFailed, match="systemic"):
                await manager.next_batch()
    assert manager.counters.groups_failed == 1


async def test_an_abort_the_episode_did_not_ask_for_fails_its_group_instead_of_hanging_its_slot() -> None:
    """The engine (e.g. a server) aborts a request in flight: the agent loop raises GenerationAborted,
    the manager replaces the group like any failed one. (It used to raise CancelledError, which the
    manager took for its own cancellation: the slot never completed and next_batch hung.)"""
    from agent_env.loop import EpisodeSettings, run_episode
    from rollout.fakes import ScriptedReply

    async with ScriptedEngine(lambda request: ScriptedReply([7] * 50), token_delay_s=0.01) as engine:

        async def run_group(ticket: GroupTicket) -> list[Trajectory]:
            request_id = f"g{ticket.group_index}.{ticket.attempt}-t0-0"
            if ticket.attempt == 0:  # the engine aborts this group's request after a few tokens
                asyncio.get_running_loop().call_later(0.05, asyncio.ensure_future, engine.abort(request_id))
            settings = EpisodeSettings(max_new_tokens_per_turn=8)
            episode = await run_episode(engine, _Tokenizer(), [5, 6], settings,  # type: ignore[arg-type]
                                        lambda _text: _Score(), tool=None,
                                        trajectory_id=f"g{ticket.group_index}.{ticket.attempt}", group_id="g")
            return [episode.trajectory]

        manager = RolloutManager(engine, run_group, groups_per_batch=1, max_lag=0, max_concurrent_groups=1)
        async with manager:
            groups = await asyncio.wait_for(manager.next_batch(), 10)
    assert manager.counters.groups_failed == 1 and groups[0][0].attempt == 1


class _Score:
    score = 0.0


class _Tokenizer:
    """What run_episode needs of a tokenizer when there is no tool: decoding a turn's tokens."""

    eos_token_id = 0

    def decode(self, ids: object, skip_special_tokens: bool = False) -> str:
        return "x"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [1]


@pytest.mark.parametrize("max_lag", [0, 2])
async def test_dynamic_sampling_refills_rejected_groups_with_fresh_prompts_in_the_bound(max_lag: int) -> None:
    def accept(trajectories: list[Trajectory]) -> bool:
        return int(trajectories[0].reward) % 3 != 0  # prompts 0, 3, 6, ... carry "no signal"

    async with ScriptedEngine(token_delay_s=0.002) as engine:
        manager = RolloutManager(engine, _group_runner(engine, seed=5), groups_per_batch=2, max_lag=max_lag,
                                 max_concurrent_groups=6, accept=accept, max_refills=10)
        refills, consumed, lags = [], [], []
        async with manager:
            for step in range(6):
                groups = await manager.next_batch()
                refills.append(manager.last_batch_refills)
                dropped = manager.last_batch_dropped_rewards  # exactly the rejected groups' episodes
                assert len(dropped) == refills[-1] * GROUP_SIZE and all(int(r) % 3 == 0 for r in dropped)
                consumed += [ticket.prompt_position for ticket, _ in groups]
                lags += [step - t.versions.start for _, ts in groups for t in ts]
                assert sorted(ticket.group_index for ticket, _ in groups) == [2 * step, 2 * step + 1]
                await manager.sync_weights([("w", torch.zeros(1))], step + 1)
    assert all(position % 3 != 0 for position in consumed)  # every rejected group was replaced
    assert len(set(consumed)) == len(consumed) and max(lags) <= max_lag
    assert sum(refills) >= 4 and manager.counters.groups_refilled >= sum(refills)
    assert manager.counters.refill_tokens >= manager.counters.groups_refilled * GROUP_SIZE  # ≥ 1 token each
    assert manager.counters.groups_failed == 0


async def test_dynamic_sampling_stops_refilling_a_slot_at_its_cap_and_keeps_what_it_has() -> None:
    async with ScriptedEngine() as engine:
        manager = RolloutManager(engine, _group_runner(engine, seed=6), groups_per_batch=2, max_lag=0,
                                 max_concurrent_groups=2, accept=lambda _t: False, max_refills=3)
        async with manager:
            first = await manager.next_batch()
            assert manager.last_batch_refills == 3 and len(first) == 2
            await manager.sync_weights([("w", torch.zeros(1))], 1)
            second = await manager.next_batch()
            assert manager.last_batch_refills == 3 and len(second) == 2
            state = manager.state()
    refilled = [ticket.refill for ticket, _ in first + second]
    assert max(refilled) == 3 and manager.counters.groups_refilled == 6
    assert state["counters"]["groups_refilled"] == 6 and state["counters"]["refill_tokens"] > 0
    restored = RolloutManager(engine, _group_runner(engine, seed=6), groups_per_batch=2, max_lag=0,
                              max_concurrent_groups=2, accept=lambda _t: False, max_refills=3)
    restored.restore(state)
    assert restored.counters.groups_refilled == 6
    with pytest.raises(ValueError, match="max_refills"):
        RolloutManager(engine, _group_runner(engine, 0), groups_per_batch=1, max_lag=0,
                       max_concurrent_groups=1, max_refills=-1)


async def test_a_changing_bound_holds_for_every_group_under_the_bound_it_was_admitted_under() -> None:
    """The bound moves between steps (as `rollout.max_lag: auto` moves it): every group records the bound
    in force at its admission and lags at most that; a lowered bound admits nothing new until the version
    catches up."""
    bounds = [0, 1, 2, 3, 3, 1, 0, 0, 2, 2]
    consumed: list[tuple[int, int]] = []  # (lag, bound at admission)
    async with ScriptedEngine(token_delay_s=0.002) as engine:
        manager = RolloutManager(engine, _group_runner(engine, seed=11), groups_per_batch=2,
                                 max_lag=bounds[0], max_concurrent_groups=16, saturate=True,
                                 total_batches=len(bounds))
        async with manager:
            for step in range(len(bounds)):
                groups = await manager.next_batch()
                consumed += [(step - t.versions.start, ticket.lag_bound) for ticket, ts in groups for t in ts]
                if step + 1 < len(bounds):
                    await manager.set_max_lag(bounds[step + 1])
                await manager.sync_weights([("w", torch.zeros(1))], step + 1)
    assert all(bound is not None and lag <= bound for lag, bound in consumed)
    assert {bound for _, bound in consumed} == set(bounds)  # every bound admitted something
    assert max(lag for lag, _ in consumed) == 3  # saturated: the largest bound was reached


def test_a_replacement_waits_for_the_bound_in_force_and_a_new_group_is_stamped_with_it() -> None:
    manager = RolloutManager(None, None, groups_per_batch=1, max_lag=3, max_concurrent_groups=4)  # type: ignore[arg-type]
    manager._version = 5
    manager._next_group_index = 9  # slots 0..8 admitted; slot 9 is batch 9
    manager._retry = [GroupTicket(8, 8, -1, 1), GroupTicket(6, 6, -1, 1)]  # slots 8 and 6 failed
    assert manager._admissible_retry() == 0  # 8 − 3 ≤ 5
    manager.max_lag = 1  # lowered: slot 8 (8 − 1 > 5) waits, slot 6 (6 − 1 ≤ 5) goes first
    assert manager._admissible_retry() == 1
    manager._retry = [GroupTicket(8, 8, -1, 1)]
    assert manager._admissible_retry() is None and not manager._can_admit()  # batch 9 waits too
    manager._version = 7
    assert manager._admissible_retry() == 0 and manager._can_admit()


async def test_state_keeps_each_groups_bound_and_a_checkpoint_without_one_still_restores() -> None:
    async with ScriptedEngine(token_delay_s=0.001) as engine:
        first = RolloutManager(engine, _group_runner(engine, 5), groups_per_batch=2, max_lag=2,
                               max_concurrent_groups=6, saturate=True)
        async with first:
            await first.next_batch()
            state = first.state()
    assert state["completed"] and all(item["ticket"]["lag_bound"] == 2 for item in state["completed"])
    before = [{**item, "ticket": {k: v for k, v in item["ticket"].items() if k != "lag_bound"}}
              for item in state["completed"]]
    older = {**state, "completed": before}
    second = RolloutManager(None, None, groups_per_batch=2, max_lag=2, max_concurrent_groups=6)  # type: ignore[arg-type]
    second.restore(older)
    assert all(ticket.lag_bound is None for items in second._completed.values() for ticket, _ in items)


def _timeline(total_batches: int, seed: int = 5) -> SimulatedClock:
    return SimulatedClock(ClockSettings(episode_median_s=1.0, episode_sigma=0.9, learner_s=1.0,
                                        concurrent_groups=5, seed=seed),
                          groups_per_batch=2, group_size=GROUP_SIZE, total_batches=total_batches)


def _expected_lags(clock: SimulatedClock, steps: int) -> list[list[int]]:
    return [[step - clock.admission_version(g) for g in (2 * step, 2 * step + 1)  # type: ignore[operator]
             for _ in range(GROUP_SIZE)] for step in range(steps)]


@pytest.mark.parametrize("max_lag", [0, 1, 4])
async def test_a_simulated_clock_decides_every_groups_version_whatever_the_real_speeds(max_lag: int) -> None:
    # a slow real engine and a fast learner would give lags near 0; the timeline's are taken instead
    async with ScriptedEngine(token_delay_s=0.005) as engine:
        clock = _timeline(8)
        manager = RolloutManager(engine, _group_runner(engine, seed=max_lag), groups_per_batch=2,
                                 max_lag=max_lag, max_concurrent_groups=1, total_batches=8, clock=clock)
        async with manager:
            lags = await _train(manager, engine, steps=8)
    assert lags == _expected_lags(clock, 8)
    assert max(max(batch) for batch in lags) <= max_lag
    if max_lag:
        assert max(max(batch) for batch in lags) >= 1  # the timeline overlapped generation with learning


async def test_a_clocked_run_resumes_on_the_same_timeline() -> None:
    async with ScriptedEngine(token_delay_s=0.001) as engine:
        first = RolloutManager(engine, _group_runner(engine, 1), groups_per_batch=2, max_lag=3,
                               max_concurrent_groups=4, total_batches=8, clock=_timeline(8))
        async with first:
            lags = await _train(first, engine, steps=3)
            state = first.state()
        assert state["clock"]["bounds"] == [3, 3, 3, 3]
        clock = _timeline(8)
        second = RolloutManager(engine, _group_runner(engine, 2), groups_per_batch=2, max_lag=3,
                                max_concurrent_groups=4, total_batches=8, clock=clock)
        second.restore(state)
        async with second:
            for step in range(3, 8):
                groups = await second.next_batch()
                lags.append([step - t.versions.start for _, ts in groups for t in ts])
                await second.sync_weights([("w", torch.zeros(1))], step + 1)
    assert lags == _expected_lags(clock, 8)


async def test_a_bound_lowered_mid_run_holds_on_the_timeline() -> None:
    async with ScriptedEngine(token_delay_s=0.001) as engine:
        clock = _timeline(10, seed=9)
        manager = RolloutManager(engine, _group_runner(engine, 3), groups_per_batch=2, max_lag=4,
                                 max_concurrent_groups=4, total_batches=10, clock=clock)
        async with manager:
            for step in range(10):
                groups = await manager.next_batch()
                for ticket, trajectories in groups:
                    assert all(step - t.versions.start <= ticket.lag_bound for t in trajectories)
                    assert ticket.admitted_version == clock.admission_version(ticket.group_index)
                if step == 3:
                    await manager.set_max_lag(1)
                await manager.sync_weights([("w", torch.zeros(1))], step + 1)
    assert clock.state()["bounds"] == [4, 4, 4, 4, 1, 1, 1, 1, 1, 1, 1]


def _sampled(token_ids: tuple[int, ...], version: int) -> GenerationResult:
    return GenerationResult(request_id="r", token_ids=token_ids, logprobs=(-0.5,) * len(token_ids),
                            versions=(version,) * len(token_ids), finish_reason="stop",
                            version_start=version, version_end=version)


def test_a_member_that_never_reached_the_engine_lags_from_its_groups_admission() -> None:
    ticket = GroupTicket(group_index=3, batch_index=7, prompt_position=3, admitted_version=5)
    never_generated = TrajectoryBuilder([1, 2, 3]).build("t0", "g3", reward=0.0)  # prompt over the budget
    assert never_generated.num_sampled_tokens == 0 and never_generated.versions.start == 0
    assert ticket.lag_of(never_generated, 7) == 2  # not 7: it has no version of its own
    builder = TrajectoryBuilder([1, 2, 3])
    builder.add_generation(_sampled((10, 11), version=6))
    assert ticket.lag_of(builder.build("t1", "g3", reward=1.0), 7) == 1  # from its first generation
