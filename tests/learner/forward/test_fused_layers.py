"""learner.fused_elementwise: the compiled RMSNorm / rotary / SiLU·up give HF's numbers (bit for bit where
the module docstring says so), on the modules they claim, and leave the model as it was afterwards.

Those that run the kernels compile small graphs with inductor (C++ on CPU: skipped, with the reason, where
no compiler is installed); the first of them in a session pays a few seconds."""

from __future__ import annotations

import random

import pytest
import torch

from configs.schema import AlgoConfig, OptimConfig
from learner.backends.torch_learner import StepInput, TorchLearner
from learner.forward.fused_layers import FusedElementwise, compiler_problem
from learner.forward.logprobs import autocast, packed_target_logprobs
from learner.forward.packing import PackedMicroBatch, build_microbatch, plan_microbatches
from learner.forward.varlen_attention import register_varlen_sdpa
from rollout.trajectory import Trajectory, TrajectoryVersions
from tests.learner.conftest import capture_grads, random_trajectories, tiny_model

needs_compiler = pytest.mark.skipif(compiler_problem(torch.device("cpu")) is not None,
                                    reason=f"{compiler_problem(torch.device('cpu'))}")


def _microbatch(seed: int = 3) -> PackedMicroBatch:
    tokens = random_trajectories(num_groups=2, per_group=3, seed=seed)
    plan = plan_microbatches([len(t.token_ids) for t in tokens], [t.group_id for t in tokens], 10_000)
    return build_microbatch(tokens, plan[0], "mean")


def _logprobs_and_grads(model: torch.nn.Module, dtype: torch.dtype | None, parts: tuple[str, ...] | None
                        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A packed forward and backward of Σ log π (the gradient pass's shape), optionally fused."""
    model.zero_grad(set_to_none=True)
    batch = _microbatch()
    fused = FusedElementwise(model, parts) if parts is not None else None
    with fused if fused is not None else torch.enable_grad(), autocast(torch.device("cpu"), dtype):
        logprobs = packed_target_logprobs(model, batch)
        logprobs.sum().backward()
    if fused is not None:
        assert sum(fused.installed.values()) > 0
    return logprobs.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@needs_compiler
@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_rotary_and_silu_mul_are_bit_identical_to_hf(kind: str, dtype: torch.dtype | None) -> None:
    """Forward bit for bit; the backward too under bf16 autocast (eager's roundings emulated, the GQA key
    heads' gradients summed in fp32), in fp32 within rounding (inductor's SiLU derivative)."""
    model = tiny_model(kind, attn_implementation=register_varlen_sdpa(), seed=1).train()
    eager_lp, eager_grads = _logprobs_and_grads(model, dtype, None)
    fused_lp, fused_grads = _logprobs_and_grads(model, dtype, ("rotary", "mlp"))
    assert torch.equal(fused_lp, eager_lp)
    for name, grad in eager_grads.items():
        if dtype is None:
            assert float((fused_grads[name] - grad).norm() / grad.norm()) < 1e-6, name
        else:
            assert torch.equal(fused_grads[name], grad), name


@needs_compiler
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_fused_rms_norm_is_hf_up_to_fp32_summation_order(dtype: torch.dtype | None) -> None:
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa(), seed=2).train()
    eager_lp, eager_grads = _logprobs_and_grads(model, dtype, None)
    fused_lp, fused_grads = _logprobs_and_grads(model, dtype, ("rms_norm", "rotary", "mlp"))
    # fp32: rounding-level; under autocast a rare flipped bf16 rounding of a norm's output can move a
    # log-prob by bf16 noise, never more
    tolerance = 1e-5 if dtype is None else 2e-2
    torch.testing.assert_close(fused_lp, eager_lp, rtol=tolerance, atol=tolerance)
    for name, grad in eager_grads.items():
        error = float((fused_grads[name] - grad).norm() / grad.norm().clamp_min(1e-12))
        assert error < (1e-4 if dtype is None else 2e-2), (name, error)


def test_installs_on_the_supported_modules_only_and_restores_them() -> None:
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa(), layers=2)
    fused = FusedElementwise(model)
    with fused:
        assert fused.installed == {"LlamaRMSNorm": 5, "LlamaMLP": 2, "LlamaAttention": 2}
        with fused:  # nested (a gradient forward inside the gradient section): nothing changes
            assert "forward" in model.model.norm.__dict__
        assert "forward" in model.model.norm.__dict__
    assert not any("forward" in m.__dict__ for m in model.modules())
    with pytest.raises(RuntimeError, match="boom"), fused:
        raise RuntimeError("boom")
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_other_activations_and_attention_implementations_keep_their_forward() -> None:
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa())
    for layer in model.model.layers:  # a GELU MLP is not SiLU·up: must not be fused
        layer.mlp.act_fn = torch.nn.GELU()
    with FusedElementwise(model) as fused:
        assert "LlamaMLP" not in fused.installed
        assert fused.installed["LlamaRMSNorm"] == 5
    with pytest.raises(ValueError, match="unknown fused parts"):
        FusedElementwise(model, ("rms_norm", "layer_norm"))


def test_the_attention_refuses_a_kv_cache_forward() -> None:
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa())
    attention = model.model.layers[0].self_attn
    with FusedElementwise(model, ("rotary",)), pytest.raises(ValueError, match="training forwards only"):
        attention(torch.zeros(1, 3, 48), position_embeddings=None)


def test_a_missing_cpp_compiler_is_reported_with_the_fix() -> None:
    from torch._inductor import config as inductor_config

    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa())
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo"}, "group_size": 3})
    with inductor_config.patch({"cpp.cxx": (None, "no-such-compiler-vcpo")}):
        problem = compiler_problem(torch.device("cpu"))
        assert problem is not None and "no-such-compiler-vcpo" in problem
        assert "fused_elementwise: false" in problem
        with pytest.raises(ValueError, match=r"learner\.fused_elementwise"):
            TorchLearner(model, algo, OptimConfig(lr=1e-3), micro_batch_tokens=256, fused_elementwise=True)


def test_a_cuda_torch_without_triton_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.utils._triton as triton_probe

    monkeypatch.setattr(triton_probe, "has_triton", lambda: False)
    problem = compiler_problem(torch.device("cuda"))  # no GPU needed: only the toolchain is asked about
    assert problem is not None and "Triton" in problem
    monkeypatch.setattr(triton_probe, "has_triton", lambda: True)
    assert compiler_problem(torch.device("cuda")) is None


def _step_input(seed: int = 4) -> StepInput:
    tokens = random_trajectories(num_groups=2, per_group=3, seed=seed)
    rng = random.Random(seed)
    trajectories = [
        Trajectory(trajectory_id=f"t{i}", group_id=str(t.group_id), token_ids=tuple(t.token_ids),
                   loss_mask=tuple(t.loss_mask),
                   behavior_logprobs=tuple(-rng.uniform(0.5, 6.0) if m else 0.0 for m in t.loss_mask),
                   versions=TrajectoryVersions(start=0, end=0), reward=float(i % 2))
        for i, t in enumerate(tokens)]
    size = len(trajectories)
    return StepInput(trajectories, [t.group_id for t in tokens], [1] * size, [True] * size)


@needs_compiler
@pytest.mark.parametrize(("objective", "proximal"),
                         [("vcpo", "separate"), ("vcpo", "reuse"), ("grpo", "separate")])
def test_learner_step_with_fused_kernels(objective: str, proximal: str) -> None:
    """The fused gradient pass gives the eager one's gradient within bf16 noise (VCPO's hooked pass and
    GRPO's autograd one, whose RMSNorm weight gradients come from the compiled backward); with a
    separate proximal pass every IS statistic is bit-identical (that pass never uses the fused kernels),
    and the model has its own forwards back after the step."""
    algo = AlgoConfig.model_validate({"objective": {"type": objective}, "group_size": 3})
    varlen = register_varlen_sdpa()
    learners = [TorchLearner(tiny_model("llama_tied", attn_implementation=varlen, seed=5).train(),
                             algo, OptimConfig(lr=1e-3), micro_batch_tokens=64, autocast_dtype=torch.bfloat16,
                             proximal=proximal, fused_elementwise=fused)
                for fused in (False, True)]
    grads = [capture_grads(learner) for learner in learners]
    metrics = [learner.step(_step_input()) for learner in learners]
    assert learners[1].fused is not None and learners[1].fused.installed["LlamaAttention"] == 2
    assert not any("forward" in m.__dict__ for m in learners[1].model.modules())
    if proximal == "separate":
        for key in ("is/ess_ratio", "is/w_max", "is/log_w_mean", "lr/scale"):
            assert metrics[1][key] == metrics[0][key], key
    else:
        assert metrics[1]["is/log_w_mean"] == pytest.approx(metrics[0]["is/log_w_mean"], abs=1e-2)
    for name, grad in grads[0].items():
        if grad.norm() > 0:
            error = float((grads[1][name] - grad).norm() / grad.norm())
            assert error < 3e-2, (name, error)


def test_auto_turns_the_kernels_on_only_where_they_can_be_built(caplog: pytest.LogCaptureFixture) -> None:
    """`learner.fused_elementwise: auto` (the default run's): on with a C++ compiler, off with a logged
    reason without one; true/false as written; anything else is refused by the config."""
    from pydantic import ValidationError
    from torch._inductor import config as inductor_config

    from configs.schema import RunConfig
    from run.train.learner_setup import learner_fused_elementwise

    cpu = torch.device("cpu")
    auto = RunConfig.model_validate({"learner": {"fused_elementwise": "auto"}})
    for setting in (True, False):
        written = RunConfig.model_validate({"learner": {"fused_elementwise": setting}})
        assert learner_fused_elementwise(written, cpu) is setting
    with inductor_config.patch({"cpp.cxx": (None, "no-such-compiler-vcpo")}):
        assert learner_fused_elementwise(auto, cpu) is False
    assert "no-such-compiler-vcpo" in caplog.text
    if compiler_problem(cpu) is None:
        assert learner_fused_elementwise(auto, cpu) is True
    with pytest.raises(ValidationError, match="fused_elementwise"):
        RunConfig.model_validate({"learner": {"fused_elementwise": "sometimes"}})
