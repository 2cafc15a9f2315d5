"""`rollout.max_lag: auto` in the training loop (run/train/trainer.py), on the scripted engine and a
stand-in learner whose ESS ratio falls with the lag: the bound moves by the control law, every group lags at
most the bound it was admitted under, the moves are logged, and a resume continues from the checkpointed
bound and counts."""

from __future__ import annotations

import asyncio
import itertools
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from configs.schema import RunConfig
from rollout.fakes import ScriptedEngine
from rollout.manager import GroupTicket
from rollout.trajectory import Trajectory, TrajectoryBuilder
from rollout.types import GenerationRequest, SamplingParams
from run.observability.metrics_log import read_metrics
from run.train.checkpointing import latest_checkpoint, load_checkpoint
from run.train.trainer import train

GROUP_SIZE = 2


class _Runtime:
    """The rollout side: groups of two short scripted episodes; rewards alternate so groups have signal."""

    def __init__(self, engine: ScriptedEngine) -> None:
        self._engine = engine
        self.task = SimpleNamespace(filters=SimpleNamespace(mask_void_turns=False, remove_truncated=False))
        self.tokenizer = SimpleNamespace(save_pretrained=lambda path: None)
        self.bounds: dict[int, int | None] = {}
        """group index → the bound it was admitted under (the last admission of the slot)."""

    @property
    def engine(self) -> ScriptedEngine:
        return self._engine

    def group_runner(self, group_size: int, seed: int):
        rng = random.Random(seed)

        async def run_group(ticket: GroupTicket) -> list[Trajectory]:
            self.bounds[ticket.group_index] = ticket.lag_bound
            await asyncio.sleep(rng.random() * 0.01)
            out = []
            for member in range(group_size):
                request = GenerationRequest(request_id=f"{ticket.group_index}-{ticket.attempt}-{member}",
                                            prompt_token_ids=(5, 6),
                                            sampling=SamplingParams(max_new_tokens=3))
                builder = TrajectoryBuilder(request.prompt_token_ids)
                builder.add_generation(await self._engine.generate(request))
                out.append(builder.build(request.request_id, f"g{ticket.group_index}", reward=float(member)))
            return out

        return run_group

    def counters(self) -> dict[str, float]:
        return {}

    def live_counts(self) -> None:
        return None


class _Learner:
    """Takes 20 ms a step (the engine is faster: the learner waits little once the pipeline is full, so
    `min_idle_fraction: 0` below) and reports ρ = 1 − 0.2 · (the batch's largest lag): ρ ≥ 0.5 up to lag 2."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.steps = 0
        self.lags: list[tuple[int, int]] = []
        """(group index, lag) of every trained trajectory."""

    def step(self, batch: Any) -> dict[str, Any]:
        import time

        time.sleep(0.02)
        self.steps += 1
        self.lags += list(zip(batch.group_ids, batch.lags, strict=True))
        return {"is/ess_ratio": 1.0 - 0.2 * max(batch.lags), "reward/mean": 0.5}

    def named_weights(self):
        return iter([("w", torch.zeros(1))])

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = state["steps"]

    def save_pretrained(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)


def _config(run_dir: Path, steps: int) -> RunConfig:
    return RunConfig.model_validate({
        "run_dir": str(run_dir),
        "algo": {"group_size": GROUP_SIZE},
        "rollout": {"max_lag": "auto", "groups_per_step": 2, "saturate_lag": True,
                    "auto_lag": {"min_lag": 0, "max_lag": 4, "target_ess_ratio": 0.5, "patience": 1,
                                 "min_idle_fraction": 0.0}},
        "trainer": {"total_steps": steps, "checkpoint_every": 1, "use_tensorboard": False,
                    "save_trajectories": False},
    })


async def _run(run_dir: Path, steps: int, stop_after: int | None = None) -> tuple[_Runtime, _Learner]:
    async with ScriptedEngine(token_delay_s=0.001) as engine:
        runtime, learner = _Runtime(engine), _Learner()
        await train(_config(run_dir, steps), runtime, learner, run_dir, progress=False,  # type: ignore[arg-type]
                    stop_after_step=stop_after)
    return runtime, learner


async def test_the_bound_follows_the_ess_and_a_resume_continues_from_the_checkpointed_bound(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    first_runtime, first = await _run(run_dir, steps=16, stop_after=5)
    checkpoint = latest_checkpoint(run_dir)
    state, meta = load_checkpoint(checkpoint)
    assert meta["step"] == 5
    records = read_metrics(run_dir)
    assert records[-1]["rollout/max_lag"] == state["lag_control"]["bound"]
    raises_before = records[-1]["rollout/lag_raises"]
    assert raises_before >= 2  # the bound climbed from 0 while ρ stayed ≥ 0.5

    second_runtime, second = await _run(run_dir, steps=16)
    records = read_metrics(run_dir)
    assert [r["trainer_step"] for r in records] == list(range(1, 17))
    bounds = [r["rollout/max_lag"] for r in records]
    raises = [r["rollout/lag_raises"] for r in records]
    lowers = [r["rollout/lag_lowers"] for r in records]
    assert raises == sorted(raises) and lowers == sorted(lowers)  # counts continue across the resume
    assert raises[5] >= raises_before
    # the realised lag trails the bound (a group admitted under k starts once the engine gets to it), so
    # the probe reaches the ceiling; the first batch admitted under it that lags 3 (ρ = 0.4) lowers it
    assert max(bounds) == 4 and lowers[-1] >= 1
    assert all(0 <= b <= 4 for b in bounds)
    judged = [r for r in records if r["rollout/lag_judged"] == 1.0]
    assert all((r["rollout/lag_move"] < 0) == (r["is/ess_ratio"] < 0.5) for r in judged)
    for record in records:  # the move logged is the step between consecutive bounds
        assert record["rollout/lag_move"] in (-1.0, 0.0, 1.0)
    for before, after in itertools.pairwise(records):
        assert after["rollout/max_lag"] - before["rollout/max_lag"] == after["rollout/lag_move"]
    # every trained trajectory lags at most the bound its group was admitted under (before the kill, for a
    # group the checkpoint kept), which is ≤ 4; the consumed lags reach 4
    admitted = {**first_runtime.bounds, **second_runtime.bounds}
    trained = first.lags + second.lags
    assert all(lag <= admitted[group] <= 4 for group, lag in trained)
    assert max(lag for _, lag in trained) == 4


def test_the_schema_sections_carry_their_owners_settings_field_for_field() -> None:
    """`rollout.auto_lag` and `rollout.simulated_clock` document and validate rollout's settings and convert
    whole (run/train/trainer.py): same names, same defaults — a field added to one side only fails here."""
    import dataclasses

    from configs.schema import AutoLagConfig, SimulatedClockConfig
    from rollout.lag_control import LagControlSettings
    from rollout.sim_clock import ClockSettings

    assert set(AutoLagConfig.model_fields) == {f.name for f in dataclasses.fields(LagControlSettings)}
    assert LagControlSettings(**AutoLagConfig().model_dump()) == LagControlSettings()
    assert set(SimulatedClockConfig.model_fields) == {f.name for f in dataclasses.fields(ClockSettings)}
