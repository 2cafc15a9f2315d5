"""The HF engine on the default model (SmolLM2-135M): the engine contract of engine_spec.py, batching,
typed errors. Edge cases that need no real model use the tiny random model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rollout.engines import hf_batch
from rollout.engines.hf_engine import HFEngine
from rollout.errors import EngineOOM, EngineUnavailable, InvalidRequest, WeightLoadError
from rollout.settings import HFEngineSettings
from tests.rollout import engine_spec as spec

FP32_ATOL = 2e-4  # batched, left-padded decode vs one unpadded forward, both fp32
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.default_model]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(default_model_dir: Path) -> AsyncIterator[HFEngine]:
    async with HFEngine(default_model_dir, HFEngineSettings(max_model_len=1024)) as started:
        yield started


async def test_concurrent_logprobs_match_a_forward_pass(
    engine: HFEngine, reference_model: PreTrainedModel, chat_prompts: list[list[int]]
) -> None:
    steps_before = engine.stats["steps"]
    await spec.check_logprobs_match_forward(engine, reference_model, chat_prompts, atol=FP32_ATOL)
    # sent together → decoded together: 24 tokens each took ~24 steps, not 4 × 24
    assert engine.stats["peak_batch_size"] >= len(chat_prompts)
    assert engine.stats["steps"] - steps_before < 2 * 24


async def test_greedy_answer_ends_with_eos(
    engine: HFEngine, chat_prompts: list[list[int]], default_tokenizer: PreTrainedTokenizerBase
) -> None:
    result = await spec.bounded(
        engine.generate(spec.request(chat_prompts[0], temperature=0.0, max_new_tokens=64))
    )
    eos = default_tokenizer.eos_token_id
    assert (result.finish_reason, result.stop_reason, result.token_ids[-1]) == ("stop", eos, eos)
    assert "5" in default_tokenizer.decode(result.token_ids)


async def test_stop_string_ends_at_its_first_occurrence(
    engine: HFEngine, chat_prompts: list[list[int]], default_tokenizer: PreTrainedTokenizerBase
) -> None:
    await spec.check_stop_string_ends_at_first_occurrence(engine, chat_prompts[1], default_tokenizer.decode)


async def test_stop_token_ends_generation(engine: HFEngine, chat_prompts: list[list[int]]) -> None:
    await spec.check_stop_token_ends_generation(engine, chat_prompts[2])


async def test_abort_and_cancel_leave_others_running(engine: HFEngine, chat_prompts: list[list[int]]) -> None:
    await spec.check_abort_and_cancel_leave_others_running(engine, chat_prompts[3])


async def test_pause_holds_progress_until_resume(engine: HFEngine, chat_prompts: list[list[int]]) -> None:
    await spec.check_pause_holds_progress_until_resume(engine, chat_prompts[0])


async def test_same_seed_same_tokens(engine: HFEngine, chat_prompts: list[list[int]]) -> None:
    first, second = [
        await spec.bounded(engine.generate(spec.request(chat_prompts[1], seed=42, max_new_tokens=16)))
        for _ in range(2)
    ]
    assert first.token_ids == second.token_ids


async def test_invalid_requests_are_rejected_with_the_fix(
    engine: HFEngine, chat_prompts: list[list[int]]
) -> None:
    with pytest.raises(InvalidRequest, match="max_model_len is 1024"):
        await engine.generate(spec.request([1] * 1024))
    with pytest.raises(InvalidRequest, match=r"must lie in \[0, 49152\)"):
        await engine.generate(spec.request([49152]))
    running = spec.request(chat_prompts[0], max_new_tokens=500, use_eos=False)
    task = asyncio.create_task(engine.generate(running))
    await asyncio.sleep(0.2)
    with pytest.raises(InvalidRequest, match="already in flight"):
        await engine.generate(running)
    await engine.abort(running.request_id)
    assert (await spec.bounded(task)).finish_reason == "abort"


async def test_weight_load_takes_effect_mid_generation(
    default_model_dir: Path, reference_model: PreTrainedModel, chat_prompts: list[list[int]]
) -> None:
    async with HFEngine(default_model_dir) as fresh:
        await spec.check_weight_load_mid_generation(
            fresh, reference_model, spec.perturbed_copy(reference_model), chat_prompts[1], atol=FP32_ATOL
        )


async def test_bad_weight_names_load_nothing(tiny_model_dir: Path) -> None:
    async with HFEngine(tiny_model_dir) as tiny:
        embedding = torch.zeros(259, 64)
        with pytest.raises(WeightLoadError, match=r"unknown names \['model.no_such.weight'\]"):
            await tiny.load_weights(
                [("model.embed_tokens.weight", embedding), ("model.no_such.weight", torch.zeros(1))],
                version=1,
            )
        with pytest.raises(WeightLoadError, match="shape mismatches"):
            await tiny.load_weights([("model.embed_tokens.weight", torch.zeros(3, 3))], version=1)
        assert tiny.version == 0
        result = await spec.bounded(tiny.generate(spec.request([1, 2, 3], max_new_tokens=4, use_eos=False)))
        assert result.logprobs[0] > -20  # an all-zero embedding would give every token the same logprob
        with pytest.raises(InvalidRequest, match="versions must not decrease"):
            await tiny.load_weights([], version=-1)


async def test_one_token_prompts_and_the_context_limit(tiny_model_dir: Path) -> None:
    async with HFEngine(tiny_model_dir, HFEngineSettings(max_model_len=10)) as tiny:
        results = await spec.bounded(
            asyncio.gather(
                tiny.generate(spec.request([5], max_new_tokens=50, use_eos=False)),
                tiny.generate(spec.request([5, 6, 7, 8], max_new_tokens=50, use_eos=False)),
            )
        )
    assert [len(r.token_ids) for r in results] == [9, 6]  # prompt + generated stops at max_model_len=10
    assert all(r.finish_reason == "length" for r in results)


async def test_a_failing_step_surfaces_as_a_typed_error_without_hanging(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def out_of_memory(*args: object) -> None:
        raise torch.OutOfMemoryError("CPU out of memory: tried to allocate 1 TiB")

    async with HFEngine(tiny_model_dir) as tiny:
        monkeypatch.setattr(hf_batch.DecodeBatch, "step", out_of_memory)
        with pytest.raises(EngineOOM, match="tried to allocate 1 TiB"):
            await spec.bounded(tiny.generate(spec.request([1, 2], max_new_tokens=4)), 30)
        with pytest.raises(EngineUnavailable, match="stopped after an earlier failure"):
            await tiny.generate(spec.request([1, 2], max_new_tokens=4))
    with pytest.raises(EngineUnavailable):
        await tiny.generate(spec.request([1, 2]))
