"""The output head in chunks of target rows: the same log-probs and gradients as one pass, on the plain
autograd path and on VCPO's per-trajectory fast path (short trajectories grouped in a chunk, long ones
split over several), with and without activation recompute."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from learner.forward.chunked_head import chunk_rows, head_chunks
from learner.forward.logprobs import autocast, chunkable_head, head_chunk_plan, packed_target_logprobs
from learner.forward.packing import TrajectoryTokens, pack_trajectories
from learner.traj_grads.opob_grad import (
    OpobGradResult,
    accumulate_opob_grad_packed,
    accumulate_opob_grad_per_trajectory,
)
from tests.learner.conftest import optimal_baseline, tiny_model, vcpo_coefficients

SMALLEST = 1e-9
"""A chunk budget that gives the smallest chunks (16 rows): every micro-batch here is chunked."""


def test_chunks_hold_whole_short_trajectories_and_split_long_ones() -> None:
    assert head_chunks([3, 4, 0, 5, 20, 2, 2], rows=8) == [(0, 7), (7, 12), (12, 20), (20, 28), (28, 32),
                                                           (32, 36)]
    assert head_chunks([8, 8], rows=8) == [(0, 8), (8, 16)]
    assert head_chunks([], rows=8) == []
    assert chunk_rows(49152, 512) == 2730 and chunk_rows(151936, 1e-9) == 16


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_gradients_equal_one_pass(kind: str, dtype: torch.dtype | None,
                                                      temperature: float,
                                                      trajectories: list[TrajectoryTokens]) -> None:
    model = tiny_model(kind)
    batch = pack_trajectories(trajectories, max_tokens=10_000)[0]
    chunks = head_chunk_plan(model, batch, SMALLEST)
    assert chunks is not None and len(chunks) > 3
    weights = torch.rand(batch.target_positions.numel(), generator=torch.Generator().manual_seed(0))
    results = []
    for plan in (None, chunks):
        model.zero_grad(set_to_none=True)
        with autocast(torch.device("cpu"), dtype):
            logprobs = packed_target_logprobs(model, batch, temperature=temperature, chunks=plan)
        (logprobs * weights).sum().backward()
        results.append((logprobs.detach(), _grads(model)))
    (one, one_grads), (chunked, chunked_grads) = results
    tolerance = 1e-5 if dtype is None else 1e-2  # bf16: the weight gradient's chunks round separately
    torch.testing.assert_close(chunked, one, rtol=1e-6 if dtype is None else 1e-3, atol=1e-6)
    assert one_grads.keys() == chunked_grads.keys()
    for name, grad in one_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=tolerance,
                                   atol=tolerance * float(grad.abs().max()), msg=name)


def test_one_pass_where_the_logits_fit_and_never_for_a_head_that_is_not_plain() -> None:
    model = tiny_model("llama_untied")
    batch = pack_trajectories([TrajectoryTokens([1, 2, 3, 4], [False, True, True, True], 0)], 100)[0]
    assert head_chunk_plan(model, batch, 512.0) is None and head_chunk_plan(model, batch, None) is None
    model.config.final_logit_softcapping = 30.0
    assert chunkable_head(model) is None


def _opob(model: nn.Module, trajectories: list[TrajectoryTokens], packed: bool, **kwargs: object
          ) -> tuple[OpobGradResult, dict[str, Tensor]]:
    a, s = vcpo_coefficients(len(trajectories), seed=5)
    model.zero_grad(set_to_none=True)
    batches = pack_trajectories(trajectories, max_tokens=120)
    path = accumulate_opob_grad_packed if packed else accumulate_opob_grad_per_trajectory
    return path(model, batches, a, s, optimal_baseline(a, s), **kwargs), _grads(model)


@pytest.mark.parametrize("kind", ["llama_tied", "llama_untied"])
@pytest.mark.parametrize("dense_cost_flops", [0.0, math.inf, None], ids=["dense", "gram", "default"])
@pytest.mark.parametrize("recompute", [False, True])
def test_the_fast_paths_chunked_head_gives_the_per_trajectory_norms_and_gradient(
        kind: str, dense_cost_flops: float | None, recompute: bool,
        trajectories: list[TrajectoryTokens]) -> None:
    model = tiny_model(kind).train()
    want, want_grads = _opob(model, trajectories, packed=False)  # one pass, plain autograd
    if recompute:
        model.gradient_checkpointing_enable()
    lengths = [sum(t.loss_mask) for t in trajectories]
    assert max(lengths) > 16 and min(lengths) < 8  # long ones split over chunks, short ones share one
    got, got_grads = _opob(model, trajectories, packed=True, dense_cost_flops=dense_cost_flops,
                           logits_chunk_mib=SMALLEST)
    torch.testing.assert_close(got.sq_norms, want.sq_norms, rtol=1e-5, atol=0.0)
    assert got.baselines == pytest.approx(want.baselines, rel=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()),
                                   msg=name)


def test_the_per_trajectory_path_chunks_its_head_too(trajectories: list[TrajectoryTokens]) -> None:
    model = tiny_model("qwen2")
    want, want_grads = _opob(model, trajectories, packed=False)
    got, got_grads = _opob(model, trajectories, packed=False, logits_chunk_mib=SMALLEST)
    torch.testing.assert_close(got.sq_norms, want.sq_norms, rtol=1e-5, atol=0.0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6 * float(grad.abs().max()),
                                   msg=name)


@pytest.mark.parametrize("proximal", ["reuse", "separate"])
def test_a_learner_step_with_a_chunked_head_is_the_one_pass_step(
        proximal: str, trajectories: list[TrajectoryTokens], monkeypatch: pytest.MonkeyPatch) -> None:
    """TorchLearner with `logits_chunk_mib`: the proximal pass and VCPO's fast gradient pass (log π_old from
    its own forward with 'reuse') chunk the head; the weights after one step are the one-pass step's."""
    from configs.schema import AlgoConfig, OptimConfig
    from learner.backends.torch_learner import StepInput, TorchLearner
    from learner.forward import logprobs as logprobs_module
    from tests.learner.backends.test_torch_learner import _as_trajectories

    chunked_calls: list[bool] = []  # grad mode of each chunked head pass
    original = logprobs_module.chunked_target_logprobs

    def spy(*args: object, **kwargs: object) -> Tensor:
        chunked_calls.append(torch.is_grad_enabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(logprobs_module, "chunked_target_logprobs", spy)
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo"}, "group_size": 3})
    steps, groups = _as_trajectories(trajectories)
    after = []
    for chunk in (None, SMALLEST):
        learner = TorchLearner(tiny_model("llama_tied").train(), algo, OptimConfig(lr=1e-3),
                               micro_batch_tokens=120, proximal=proximal, logits_chunk_mib=chunk)
        metrics = learner.step(StepInput(steps, groups, [0] * len(steps), [True] * len(steps)))
        after.append(({n: p.detach().clone() for n, p in learner.model.named_parameters()}, metrics))
    assert True in chunked_calls  # the gradient pass chunked its head (as the no-grad passes did)
    (one, one_metrics), (chunked, chunked_metrics) = after
    assert chunked_metrics["is/ess_ratio"] == pytest.approx(one_metrics["is/ess_ratio"], rel=1e-6)
    for name, value in one.items():
        torch.testing.assert_close(chunked[name], value, rtol=1e-5, atol=1e-6, msg=name)
