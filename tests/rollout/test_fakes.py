"""The scripted engine honours the protocol's control semantics (for control-logic tests elsewhere)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rollout.errors import EngineUnavailable, InvalidRequest
from rollout.fakes import ScriptedEngine, ScriptedReply
from rollout.types import GenerationRequest, SamplingParams


def _request(request_id: str, max_new_tokens: int = 5, **sampling: object) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        prompt_token_ids=[10],
        sampling=SamplingParams(max_new_tokens=max_new_tokens, **sampling),
    )


async def test_counts_up_from_the_prompt_until_max_new_tokens() -> None:
    async with ScriptedEngine() as engine:
        result = await engine.generate(_request("a", max_new_tokens=3))
    assert (result.token_ids, result.finish_reason, result.logprobs) == ((11, 12, 13), "length", (-1.0,) * 3)


async def test_stop_token_and_eos_end_the_generation_and_are_included() -> None:
    async with ScriptedEngine(lambda _: ScriptedReply([5, 2, 7])) as engine:
        eos = await engine.generate(_request("eos"))
        through = await engine.generate(_request("through", use_eos=False, stop_token_ids=(7,)))
    assert (eos.token_ids, eos.stop_reason) == ((5, 2), 2)
    assert (through.token_ids, through.stop_reason) == ((5, 2, 7), 7)


async def test_weight_load_mid_generation_splits_per_token_versions() -> None:
    async with ScriptedEngine(token_delay_s=0.01) as engine:
        task = asyncio.create_task(engine.generate(_request("a", max_new_tokens=20)))
        await asyncio.sleep(0.05)
        await engine.load_weights([("w", torch.zeros(1))], version=1)
        result = await task
    assert result.versions[0] == 0 and result.versions[-1] == 1
    assert (result.version_start, result.version_end) == (0, 1)
    assert [(load.names, load.version) for load in engine.weight_loads] == [(("w",), 1)]


async def test_pause_holds_tokens_and_abort_answers_even_while_paused() -> None:
    async with ScriptedEngine(token_delay_s=0.005) as engine:
        task = asyncio.create_task(engine.generate(_request("a", max_new_tokens=1000)))
        await asyncio.sleep(0.03)
        await engine.pause()
        await asyncio.sleep(0.01)
        await engine.abort("a")
        result = await asyncio.wait_for(task, 1.0)
    assert result.finish_reason == "abort" and 0 < len(result.token_ids) < 1000


async def test_misuse_raises_typed_errors() -> None:
    engine = ScriptedEngine(token_delay_s=0.01)
    with pytest.raises(EngineUnavailable, match="not started"):
        await engine.generate(_request("a"))
    async with engine:
        task = asyncio.create_task(engine.generate(_request("a", max_new_tokens=100)))
        await asyncio.sleep(0.01)
        with pytest.raises(InvalidRequest, match="already in flight"):
            await engine.generate(_request("a"))
        await engine.abort("a")
        assert (await task).finish_reason == "abort"
