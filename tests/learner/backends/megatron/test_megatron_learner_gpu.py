"""The megatron learner on CUDA (no shim): fp32 parity with the torch learner, bf16 close to fp32, and
sequence parallelism with TransformerEngine at TP = 2. Skipped with a reason without a GPU
(tests/conftest.py), without megatron-core/mbridge, and (sequence parallel) with fewer than 2 GPUs or
no transformer-engine.

GPU tolerances are looser than the CPU ones (different kernels, reduction orders): fp32 1e-4 relative on
metrics and norms, 1e-4 absolute on weights after one step; bf16 log-probs within 0.1 of fp32.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from configs.schema import MegatronConfig
from learner.forward.packing import build_microbatch, plan_microbatches
from tests.learner import megatron_parity
from tests.learner.conftest import random_trajectories, tiny_model

pytestmark = pytest.mark.gpu



@pytest.fixture(scope="module")
def cuda_world() -> Iterator[None]:
    """An NCCL world of one process with megatron's TP = 1 groups on GPU 0."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install vcpo[megatron])")
    pytest.importorskip("mbridge", reason="mbridge is not installed (pip install vcpo[megatron])")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from learner.backends.megatron.learner import init_model_parallel

    torch.cuda.set_device(0)
    init_model_parallel(MegatronConfig(), backend="nccl")
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _learner(hf_dir: Path, algo_name: str, dtype: torch.dtype = torch.float32) -> object:
    from learner.backends.megatron.learner import MegatronLearner

    return MegatronLearner(hf_dir, megatron_parity.algo(algo_name), megatron_parity.OPTIM, MegatronConfig(),
                           micro_batch_tokens=megatron_parity.MICRO_BATCH_TOKENS, dtype=dtype,
                           device=torch.device("cuda", 0))


@pytest.mark.parametrize("algo_name", ["grpo", "vcpo"])
def test_cuda_fp32_step_matches_the_torch_learner(cuda_world: None, tmp_path: Path, algo_name: str) -> None:
    hf_dir = megatron_parity.write_checkpoint("qwen2", tmp_path / "qwen2")
    batch = megatron_parity.parity_batch("qwen2")
    want = megatron_parity.run_step(megatron_parity.torch_learner("qwen2", algo_name), batch)
    got = megatron_parity.run_step(_learner(hf_dir, algo_name), batch)
    for key, value in want.metrics.items():
        assert got.metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    if want.sq_norms is not None:
        torch.testing.assert_close(got.sq_norms.cpu(), want.sq_norms, rtol=1e-4, atol=0)
    for name, weight in want.weights.items():
        torch.testing.assert_close(got.weights[name].cpu(), weight, rtol=0, atol=1e-4, msg=name)


def test_bf16_logprobs_stay_close_to_fp32_and_the_step_trains(cuda_world: None, tmp_path: Path) -> None:
    from learner.forward.logprobs import packed_target_logprobs

    hf_dir = megatron_parity.write_checkpoint("llama_tied", tmp_path / "llama")
    tokens = random_trajectories(num_groups=2, per_group=2)
    plan = plan_microbatches([len(t.token_ids) for t in tokens], [t.group_id for t in tokens], 4096)[0]
    batch = build_microbatch(tokens, plan, "mean")
    learner = _learner(hf_dir, "vcpo", dtype=torch.bfloat16)
    with torch.no_grad():
        got = packed_target_logprobs(learner.model, batch.to(learner.device)).cpu()
        want = packed_target_logprobs(tiny_model("llama_tied"), batch)
    assert (got - want).abs().max() < 0.1
    before = {name: weight.float().cpu().clone() for name, weight in learner.named_weights()}
    record = megatron_parity.run_step(learner, megatron_parity.parity_batch("llama_tied"))
    assert torch.isfinite(torch.tensor(record.metrics["grad/norm"]))
    assert any(not torch.equal(before[name], weight.float().cpu()) for name, weight in record.weights.items())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="sequence parallelism needs 2 GPUs (TP = 2)")
@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                    reason="sequence parallelism needs transformer-engine (megatron's local layers lack it)")
def test_sequence_parallel_tp2_with_transformer_engine_matches_the_torch_learner(tmp_path: Path) -> None:
    hf_dir = megatron_parity.write_checkpoint("qwen2", tmp_path / "qwen2")
    results = megatron_parity.run_tp_worker(
        [str(hf_dir), "qwen2", str(tmp_path / "sp.pt"), "--cuda-sequence-parallel"], timeout=600)
    batch = megatron_parity.parity_batch("qwen2")
    for name in ("grpo", "vcpo"):
        want = megatron_parity.run_step(megatron_parity.torch_learner("qwen2", name), batch)
        got = results[name]
        for key, value in want.metrics.items():
            assert got["metrics"][key] == pytest.approx(value, rel=1e-3, abs=1e-4), key
        if want.sq_norms is not None:
            torch.testing.assert_close(got["sq_norms"], want.sq_norms, rtol=1e-3, atol=0)
        for weight_name, weight in want.weights.items():
            torch.testing.assert_close(got["weights"][weight_name], weight, rtol=0, atol=1e-4,
                                       msg=weight_name)
