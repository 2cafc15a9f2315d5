"""The fast per-trajectory path under activation recompute: the same norms and gradient as the
per-trajectory path, with nothing of a checkpointed layer kept between the forward and its backward."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from learner.forward.packing import TrajectoryTokens, pack_trajectories
from learner.traj_grads.hooks import PackedGradHooks
from learner.traj_grads.opob_grad import (
    OpobGradResult,
    accumulate_opob_grad_packed,
    accumulate_opob_grad_per_trajectory,
)
from tests.learner.conftest import optimal_baseline, tiny_model, vcpo_coefficients


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def _run(model: nn.Module, trajectories: list[TrajectoryTokens], packed: bool, max_tokens: int,
         **kwargs: object) -> tuple[OpobGradResult, dict[str, Tensor]]:
    a, s = vcpo_coefficients(len(trajectories), seed=3)
    model.zero_grad(set_to_none=True)
    path = accumulate_opob_grad_packed if packed else accumulate_opob_grad_per_trajectory
    batches = pack_trajectories(trajectories, max_tokens=max_tokens)
    result = path(model, batches, a, s, optimal_baseline(a, s), **kwargs)
    return result, _grads(model)


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("dense_cost_flops", [0.0, math.inf, None], ids=["dense", "gram", "default"])
def test_recomputed_layers_give_the_per_trajectory_paths_norms_and_gradient(
    kind: str, reentrant: bool, dense_cost_flops: float | None, trajectories: list[TrajectoryTokens]
) -> None:
    model = tiny_model(kind).train()
    want, want_grads = _run(model, trajectories, packed=False, max_tokens=50)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    # 50 tokens: groups span micro-batches, so open and closing groups meet in one micro-batch
    got, got_grads = _run(model, trajectories, packed=True, max_tokens=50, dense_cost_flops=dense_cost_flops)
    torch.testing.assert_close(got.sq_norms, want.sq_norms, rtol=1e-5, atol=0.0)
    assert got.baselines == pytest.approx(want.baselines, rel=1e-5)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-5 * float(grad.abs().max()),
                                   msg=name)


def test_a_recomputed_layer_keeps_no_input_between_the_forward_and_the_backward(
    trajectories: list[TrajectoryTokens], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tiny_model("llama_untied").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    seen: list[tuple[str, bool, bool]] = []
    enter = PackedGradHooks.__enter__

    def spy_enter(self: PackedGradHooks) -> PackedGradHooks:
        entered = enter(self)
        backward = self.backward

        def spy_backward(state, after_forward=None):
            def check(logprobs: Tensor) -> None:
                seen.extend((h.name, h.recomputed, h._x is not None) for _, h in self.hooked)
                if after_forward is not None:
                    after_forward(logprobs)
            backward(state, check)

        self.backward = spy_backward
        return entered

    monkeypatch.setattr(PackedGradHooks, "__enter__", spy_enter)
    _run(model, trajectories, packed=True, max_tokens=10_000)
    layers = [(name, kept) for name, recomputed, kept in seen if recomputed]
    assert layers and all(".layers." in name for name, _ in layers)
    assert not any(kept for _, kept in layers), "a recomputed layer held its input after the forward"
    outside = {name for name, recomputed, kept in seen if not recomputed and kept}
    assert outside == {"lm_head", "model.norm"}  # the layers outside the checkpoints keep theirs, as before


def test_a_learner_step_with_gradient_checkpointing_takes_the_fast_path_and_the_same_step(
        trajectories: list[TrajectoryTokens], monkeypatch: pytest.MonkeyPatch) -> None:
    from configs.schema import AlgoConfig, OptimConfig
    from learner.backends import torch_learner
    from learner.backends.torch_learner import StepInput, TorchLearner
    from tests.learner.backends.test_torch_learner import _as_trajectories

    fast_calls = []
    packed = torch_learner.accumulate_opob_grad_packed

    def spy(model: nn.Module, *args: object, **kwargs: object) -> OpobGradResult:
        fast_calls.append(model.is_gradient_checkpointing)
        return packed(model, *args, **kwargs)

    monkeypatch.setattr(torch_learner, "accumulate_opob_grad_packed", spy)
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo"}, "group_size": 3})
    steps, groups = _as_trajectories(trajectories)
    after = {}
    for recompute in (False, True):
        model = tiny_model("llama_tied").train()
        learner = TorchLearner(model, algo, OptimConfig(lr=1e-3), micro_batch_tokens=60)
        if recompute:
            learner.model.gradient_checkpointing_enable()
        learner.step(StepInput(steps, groups, [0] * len(steps), [True] * len(steps)))
        after[recompute] = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    assert fast_calls == [False, True]
    for name, value in after[False].items():
        torch.testing.assert_close(after[True][name], value, rtol=1e-5, atol=1e-6, msg=name)
