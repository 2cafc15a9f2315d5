"""The OPOB gradient: packed fast path == per-trajectory path == brute-force autograd reference."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from learner.forward.packing import TrajectoryTokens, build_microbatch, pack_trajectories
from learner.forward.varlen_attention import register_varlen_sdpa
from learner.traj_grads import handlers
from learner.traj_grads.handlers import _gram_is_cheaper
from learner.traj_grads.hooks import UnsupportedParameterError
from learner.traj_grads.opob_grad import (
    DENSE_COST_FLOPS,
    BaselineFn,
    OpobGradResult,
    accumulate_opob_grad_packed,
    accumulate_opob_grad_per_trajectory,
    default_dense_cost_flops,
)
from learner.traj_grads.reference import reference_opob_gradient
from tests.learner.conftest import tiny_model

PATHS = {"packed": accumulate_opob_grad_packed, "per_trajectory": accumulate_opob_grad_per_trajectory}


def _coefs(count: int) -> tuple[Tensor, Tensor]:
    """VCPO-shaped coefficients: a_i = w̄_i R_i / (σ B), s_i = w̄_i / (σ B) with σ = 1."""
    generator = torch.Generator().manual_seed(1)
    weights = torch.rand(count, generator=generator) * 2.0
    rewards = torch.randint(0, 2, (count,), generator=generator).float()
    return weights * rewards / count, weights / count


def _optimal_baseline(rewards: Tensor, weights: Tensor) -> BaselineFn:
    """The real per-group b* = Σ w²‖g‖²R / Σ w²‖g‖²."""

    def baseline(group: int, members: Tensor, sq_norms: Tensor) -> float:
        importance = weights[members] ** 2 * sq_norms
        return float((importance * rewards[members]).sum() / importance.sum())

    return baseline


def _run(
    path: str, model: nn.Module, trajectories: list[TrajectoryTokens], max_tokens: int, **kwargs
) -> OpobGradResult:
    a, s = _coefs(len(trajectories))
    model.zero_grad(set_to_none=True)
    batches = pack_trajectories(trajectories, max_tokens=max_tokens)
    return PATHS[path](model, batches, a, s, _optimal_baseline(a / s, s), **kwargs)


def _assert_matches_reference(
    model: nn.Module, result: OpobGradResult, trajectories: list[TrajectoryTokens]
) -> None:
    a, s = _coefs(len(trajectories))
    reference = reference_opob_gradient(model, trajectories, a, s, _optimal_baseline(a / s, s))
    torch.testing.assert_close(result.sq_norms, reference.sq_norms, rtol=1e-4, atol=0.0)
    assert result.baselines == pytest.approx(reference.baselines, rel=1e-4)
    for name, param in model.named_parameters():
        expected = reference.param_grads[name]
        torch.testing.assert_close(
            param.grad, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()), msg=name
        )


@pytest.mark.parametrize("kind", ["llama_tied", "llama_untied", "qwen2"])
@pytest.mark.parametrize("path", ["packed", "per_trajectory"])
def test_paths_match_brute_force_with_groups_spanning_micro_batches(
    kind: str, path: str, trajectories: list[TrajectoryTokens]
) -> None:
    model = tiny_model(kind)
    # 50-token budget: every group (about 60–90 tokens) is split over micro-batches.
    result = _run(path, model, trajectories, max_tokens=50)
    assert len(pack_trajectories(trajectories, max_tokens=50)) > 3
    _assert_matches_reference(model, result, trajectories)


@pytest.mark.parametrize(
    ("dense_cost_flops", "buffers_needed"), [(0.0, 3), (math.inf, 0)], ids=["all_dense", "all_gram"]
)
def test_packed_path_is_exact_for_both_weight_norm_methods(
    dense_cost_flops: float, buffers_needed: int, trajectories: list[TrajectoryTokens]
) -> None:
    model = tiny_model("llama_tied")
    # One micro-batch holds all three groups. The dense route adds a_i G_i to .grad during the
    # backward, before b* is known, so each group needs its S_g; the Gram route defers the
    # weight gradient until b* is known and needs none.
    result = _run("packed", model, trajectories, max_tokens=10_000, dense_cost_flops=dense_cost_flops)
    assert result.max_open_groups == buffers_needed
    _assert_matches_reference(model, result, trajectories)


def test_open_groups_price_the_gram_route_s_extra_gemm() -> None:
    # An MLP projection (576 → 1536) at T = 300 under the CPU bf16 price: Gram for a closing group
    # (0.38 of the dense price); for a group still open, the S_g product (2·T·in·out) tips it to the
    # dense route (1.006 of it).
    assert _gram_is_cheaper(300, 576, 1536, 1024.0, open_group=False)
    assert not _gram_is_cheaper(300, 576, 1536, 1024.0, open_group=True)
    assert _gram_is_cheaper(240, 576, 1536, math.inf, open_group=True)
    assert not _gram_is_cheaper(1, 576, 1536, 0.0, open_group=False)


def test_default_dense_price_follows_the_compute_dtype() -> None:
    cpu = torch.device("cpu")
    assert default_dense_cost_flops(cpu, None) == DENSE_COST_FLOPS[("cpu", None)]
    assert default_dense_cost_flops(cpu, torch.bfloat16) > default_dense_cost_flops(cpu, None)
    assert default_dense_cost_flops(cpu, torch.float16) == DENSE_COST_FLOPS[("cpu", None)]
    assert default_dense_cost_flops(torch.device("meta"), None) == 2048.0


def test_mixed_routes_with_open_and_closing_groups_are_exact(
    trajectories: list[TrajectoryTokens], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups split over 50-token micro-batches at a price where open-group trajectories go dense and
    closing ones Gram, in the same micro-batches and layers: still the reference gradient."""
    decisions = []

    def spy(length: int, in_features: int, out_features: int, cost: float, open_group: bool = False) -> bool:
        cheap = _gram_is_cheaper(length, in_features, out_features, cost, open_group)
        decisions.append((open_group, cheap))
        return cheap

    monkeypatch.setattr(handlers, "_gram_is_cheaper", spy)
    model = tiny_model("llama_tied")
    result = _run("packed", model, trajectories, max_tokens=50, dense_cost_flops=48.0)
    assert (True, False) in decisions and (False, True) in decisions  # both routes were taken
    _assert_matches_reference(model, result, trajectories)


@pytest.mark.parametrize("attention", ["eager", "varlen"])
def test_packed_path_with_other_attention_kernels(
    attention: str, trajectories: list[TrajectoryTokens]
) -> None:
    model = tiny_model("qwen2", register_varlen_sdpa() if attention == "varlen" else attention)
    _assert_matches_reference(model, _run("packed", model, trajectories, max_tokens=80), trajectories)


def test_interleaved_groups_keep_one_buffer_per_open_group(trajectories: list[TrajectoryTokens]) -> None:
    # Micro-batches [0, 3], [1, 4], [2, 5]: groups 100 and 101 are both open until the last one.
    model = tiny_model("llama_untied")
    a, s = _coefs(6)
    batches = [build_microbatch(trajectories, [i, i + 3]) for i in range(3)]
    result = accumulate_opob_grad_packed(model, batches, a, s, _optimal_baseline(a / s, s))
    assert result.max_open_groups == 2
    _assert_matches_reference(model, result, trajectories[:6])


def test_baseline_callback_sees_each_group_once_with_its_exact_norms(
    trajectories: list[TrajectoryTokens],
) -> None:
    model = tiny_model("llama_tied")
    calls = []

    def record(group: int, members: Tensor, sq_norms: Tensor) -> float:
        calls.append((group, members.tolist(), sq_norms.clone()))
        return 0.0

    a, s = _coefs(len(trajectories))
    accumulate_opob_grad_packed(model, pack_trajectories(trajectories, max_tokens=50), a, s, record)
    reference = reference_opob_gradient(model, trajectories, a, s, lambda *_: 0.0)
    assert [(g, m) for g, m, _ in calls] == [(100, [0, 1, 2]), (101, [3, 4, 5]), (102, [6, 7, 8])]
    for _, members, norms in calls:
        torch.testing.assert_close(norms, reference.sq_norms[members], rtol=1e-4, atol=0.0)


@pytest.mark.parametrize("path", ["packed", "per_trajectory"])
def test_returned_constant_baseline_is_used(path: str, trajectories: list[TrajectoryTokens]) -> None:
    # Two trajectories of one group, a = (1, 2), s = (1, 1), b* = 0.5:
    # grad = −((1 − 0.5)·g0 + (2 − 0.5)·g1) = −(0.5 g0 + 1.5 g1).
    model = tiny_model("qwen2")
    pair = [trajectories[0], trajectories[1]]
    a, s = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])
    result = PATHS[path](model, pack_trajectories(pair, max_tokens=1000), a, s, lambda *_: 0.5)
    assert result.baselines == {100: 0.5}
    g = reference_opob_gradient(model, pair, a, s, lambda *_: 0.5).flat_grads
    expected = -(0.5 * g[0] + 1.5 * g[1])
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


@pytest.mark.parametrize("path", ["packed", "per_trajectory"])
def test_gradient_accumulates_into_existing_grad(path: str, trajectories: list[TrajectoryTokens]) -> None:
    model = tiny_model("llama_untied")
    a, s = _coefs(3)
    batches = pack_trajectories(trajectories[:3], max_tokens=1000)
    PATHS[path](model, batches, a, s, lambda *_: 0.25)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    PATHS[path](model, batches, a, s, lambda *_: 0.25)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, 2.0 * once[name])


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._backward_hooks) for m in model.modules())


def test_unsupported_trainable_parameter_is_named_in_the_error(trajectories: list[TrajectoryTokens]) -> None:
    model = tiny_model("llama_untied")
    model.model.norm = nn.LayerNorm(48)  # LayerNorm has no per-trajectory handler
    a, s = _coefs(3)
    batches = pack_trajectories(trajectories[:3], max_tokens=1000)
    with pytest.raises(UnsupportedParameterError, match=r"model\.norm\.weight.*model\.norm\.bias") as error:
        accumulate_opob_grad_packed(model, batches, a, s, lambda *_: 0.0)
    assert "accumulate_opob_grad_per_trajectory" in str(error.value)
    assert _hook_count(model) == 0
    # Frozen, it is simply skipped (and the reference skips it too).
    model.model.norm.requires_grad_(False)
    result = accumulate_opob_grad_packed(model, batches, a, s, lambda *_: 0.0)
    assert model.model.norm.weight.grad is None
    reference = reference_opob_gradient(model, trajectories[:3], a, s, lambda *_: 0.0)
    torch.testing.assert_close(result.sq_norms, reference.sq_norms, rtol=1e-4, atol=0.0)


def test_hooks_removed_and_requires_grad_restored_even_after_an_error(
    trajectories: list[TrajectoryTokens],
) -> None:
    model = tiny_model("llama_tied")
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    a, s = _coefs(len(trajectories))
    batches = pack_trajectories(trajectories, max_tokens=50)

    def failing(group: int, members: Tensor, sq_norms: Tensor) -> float:
        raise RuntimeError("baseline exploded")

    with pytest.raises(RuntimeError, match="baseline exploded"):
        accumulate_opob_grad_packed(model, batches, a, s, failing)
    assert _hook_count(model) == 0
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    model.zero_grad(set_to_none=True)
    accumulate_opob_grad_packed(model, batches, a, s, lambda *_: 0.0)
    assert _hook_count(model) == 0
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert model.model.layers[0].mlp.up_proj.weight.grad is None


def test_coefficients_must_cover_every_packed_trajectory(trajectories: list[TrajectoryTokens]) -> None:
    model = tiny_model("llama_tied")
    a, s = _coefs(4)  # 3 trajectories packed, 4 coefficients
    with pytest.raises(ValueError, match=r"\[3\].*no micro-batch"):
        accumulate_opob_grad_packed(model, pack_trajectories(trajectories[:3], 1000), a, s, lambda *_: 0.0)


@pytest.mark.parametrize(
    ("kind", "path", "dense_cost_flops"),
    [("llama_tied", "packed", 0.0), ("llama_tied", "packed", math.inf), ("qwen2", "packed", None),
     ("llama_tied", "per_trajectory", None)],
    ids=["tied-all_dense", "tied-all_gram", "qwen2-packed", "tied-per_trajectory"],
)
def test_bf16_autocast_matches_the_fp32_reference_to_bf16_precision(
    kind: str, path: str, dense_cost_flops: float | None, trajectories: list[TrajectoryTokens]
) -> None:
    """Autocast (bf16 matmuls over fp32 weights): the module inputs the hooks saved are fp32 while the
    output gradients are bf16; every route must still give fp32 grads and norms equal to the exact fp32
    ones up to bf16 rounding — and differ from them (else autocast was not in effect)."""
    model = tiny_model(kind)
    kwargs = {} if dense_cost_flops is None else {"dense_cost_flops": dense_cost_flops}
    result = _run(path, model, trajectories, max_tokens=50, autocast_dtype=torch.bfloat16, **kwargs)
    a, s = _coefs(len(trajectories))
    reference = reference_opob_gradient(model, trajectories, a, s, _optimal_baseline(a / s, s))
    torch.testing.assert_close(result.sq_norms, reference.sq_norms, rtol=3e-2, atol=0.0)
    assert result.baselines == pytest.approx(reference.baselines, rel=3e-2)
    largest_error = 0.0
    for name, param in model.named_parameters():
        assert param.grad.dtype == torch.float32, name
        expected = reference.param_grads[name]
        error = float((param.grad - expected).norm() / expected.norm())
        assert error < 3e-2, (name, error)
        largest_error = max(largest_error, error)
    assert largest_error > 1e-4  # fp32 throughout would agree to ~1e-6


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
def test_casting_weights_once_per_pass_changes_no_bit_and_restores_the_masters(
    kind: str, trajectories: list[TrajectoryTokens], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under autocast the packed pass gives each linear a bf16 copy of its weight once, instead of
    autocast casting it at every use: the same rounding, so the same gradient and norms bit for bit;
    afterwards the model holds its fp32 master parameters again (a tied lm_head is the embedding)."""
    from learner.traj_grads.hooks import PackedGradHooks

    model = tiny_model(kind)
    masters = {name: param for name, param in model.named_parameters()}
    once = _run("packed", model, trajectories, max_tokens=50, autocast_dtype=torch.bfloat16)
    grads_once = {name: param.grad.clone() for name, param in model.named_parameters()}
    assert dict(model.named_parameters()) == masters
    assert all(p.dtype == torch.float32 for p in masters.values())
    if kind == "llama_tied":
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    monkeypatch.setattr(PackedGradHooks, "_cast_linear_weights", lambda self: None)  # autocast per use
    per_use = _run("packed", model, trajectories, max_tokens=50, autocast_dtype=torch.bfloat16)
    assert torch.equal(once.sq_norms, per_use.sq_norms)
    for name, param in model.named_parameters():
        assert torch.equal(grads_once[name], param.grad), name


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
def test_the_shared_forward_cast_is_autocasts_own_bit_for_bit(
    kind: str, trajectories: list[TrajectoryTokens], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pre-hooks hand q/k/v and gate/up one bf16 cast of their fp32 input instead of letting autocast
    cast it per layer: gradients and norms equal autocast's own bit for bit (each reader's gradient is cast
    back to fp32 before they are summed, as after separate casts), and the layers did get bf16 inputs."""
    model = tiny_model(kind)
    seen: list[torch.dtype] = []
    handle = model.model.layers[0].self_attn.k_proj.register_forward_hook(
        lambda module, args, output: seen.append(args[0].dtype))
    shared = _run("packed", model, trajectories, max_tokens=50, autocast_dtype=torch.bfloat16)
    handle.remove()
    grads_shared = {name: param.grad.clone() for name, param in model.named_parameters()}
    assert seen and set(seen) == {torch.bfloat16}
    monkeypatch.setattr(handlers.LinearHandler, "forward_pre_hook", lambda self, module, args: None)
    per_layer = _run("packed", model, trajectories, max_tokens=50, autocast_dtype=torch.bfloat16)
    assert torch.equal(shared.sq_norms, per_layer.sq_norms)
    for name, param in model.named_parameters():
        assert torch.equal(grads_shared[name], param.grad), name


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
def test_layers_reading_one_input_share_its_cast_and_change_no_bit(
    kind: str, trajectories: list[TrajectoryTokens], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under autocast, q/k/v (and gate/up) read one fp32 tensor: the hooks cast it to bf16 once for the
    three of them, not once per layer — the same rounding, so the same gradient and norms bit for bit."""
    model = tiny_model(kind)
    casts: list[Tensor] = []
    shared_cast = handlers.MicroBatchState.cast_input

    def spy(self: handlers.MicroBatchState, source: Tensor, dtype: torch.dtype) -> Tensor:
        casts.append(shared_cast(self, source, dtype))
        return casts[-1]

    monkeypatch.setattr(handlers.MicroBatchState, "cast_input", spy)
    shared = _run("packed", model, trajectories, max_tokens=50, autocast_dtype=torch.bfloat16)
    grads_shared = {name: param.grad.clone() for name, param in model.named_parameters()}
    layers, micro_batches = model.config.num_hidden_layers, len(pack_trajectories(trajectories, 50))
    # per layer q/k/v share one cast and gate/up another; the head reads the final norm's output
    assert len(casts) == micro_batches * (5 * layers + 1)
    assert len({id(cast) for cast in casts}) == micro_batches * (2 * layers + 1)
    assert all(cast.dtype == torch.bfloat16 for cast in casts)
    monkeypatch.setattr(handlers.MicroBatchState, "cast_input", lambda self, source, dtype: source.to(dtype))
    per_layer = _run("packed", model, trajectories, max_tokens=50, autocast_dtype=torch.bfloat16)
    assert torch.equal(shared.sq_norms, per_layer.sq_norms)
    for name, param in model.named_parameters():
        assert torch.equal(grads_shared[name], param.grad), name
