"""LoRA on the torch learner (`learner.lora`, peft): only the adapters train and hold optimizer state, the
base stays frozen in its dtype; VCPO's per-trajectory norms on the fast path are over the adapters alone and
equal the per-trajectory path's (also under activation recompute); the engines get the merged policy under
the base model's names; a checkpoint round-trips the adapters and their optimizer; the export is a merged HF
directory plus peft's adapter, both loadable (the adapter through `resolve_model`); bad settings are refused
naming the field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from configs.schema import AlgoConfig, LoraSettings, OptimConfig, RunConfig
from learner.backends.lora import ADAPTER_DIR, adapter_parameters, attach, merged_weights
from learner.backends.torch_learner import StepInput, TorchLearner
from learner.forward.packing import pack_trajectories
from learner.forward.varlen_attention import register_varlen_sdpa
from learner.traj_grads.opob_grad import accumulate_opob_grad_packed, accumulate_opob_grad_per_trajectory
from learner.traj_grads.reference import trajectory_loglik
from rollout.models import resolve_model
from tests.learner.backends.test_torch_learner import _as_trajectories, _noisy_step
from tests.learner.conftest import (
    capture_grads,
    optimal_baseline,
    random_trajectories,
    tiny_model,
    vcpo_coefficients,
)

SETTINGS = LoraSettings(rank=4, alpha=8.0)


def _moved_adapters(model: nn.Module, seed: int = 5) -> None:
    """B starts at zero (the adapted policy is the base), where A's gradient is zero too: move B so a
    wrong adapter gradient cannot hide."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))


def _lora_model(kind: str = "llama_tied", **settings: object) -> tuple[nn.Module, object]:
    model = tiny_model(kind, attn_implementation=register_varlen_sdpa()).train()
    wrapped = attach(model, LoraSettings(**{**SETTINGS.model_dump(), **settings}), seed=1)
    _moved_adapters(model)
    return model, wrapped


def _adapter_grads(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_vcpo_norms_under_lora_are_the_adapters_alone_and_equal_the_per_trajectory_path(
        kind: str, recompute: bool) -> None:
    trajectories = random_trajectories(num_groups=3, per_group=3)
    model, _ = _lora_model(kind)
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    a, s = vcpo_coefficients(len(trajectories), seed=3)
    batches = pack_trajectories(trajectories, max_tokens=50)  # groups span micro-batches
    want = accumulate_opob_grad_per_trajectory(model, batches, a, s, optimal_baseline(a, s))
    want_grads = _adapter_grads(model)
    model.zero_grad(set_to_none=True)
    if recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    got = accumulate_opob_grad_packed(model, batches, a, s, optimal_baseline(a, s))
    torch.testing.assert_close(got.sq_norms, want.sq_norms, rtol=1e-5, atol=0.0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-5,
                                   atol=1e-5 * float(grad.abs().max()), msg=name)
    # by hand: ‖∇ℓ_i‖² over the adapters alone — the optimised vector — not over the frozen base
    model.gradient_checkpointing_disable()
    for i, t in enumerate(trajectories[:4]):
        grads = torch.autograd.grad(trajectory_loglik(model, t, "mean"), adapter_parameters(model))
        assert float(sum((g.double() ** 2).sum() for g in grads)) == pytest.approx(float(want.sq_norms[i]),
                                                                                   rel=1e-5)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert all(torch.equal(model.get_parameter(n), v) for n, v in frozen.items())


def _learner(algo: AlgoConfig, lora: LoraSettings | None = SETTINGS, seed: int = 0,
             dtype: torch.dtype = torch.float32, **kwargs: object) -> TorchLearner:
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa(), seed=seed).to(dtype).train()
    return TorchLearner(model, algo, OptimConfig(lr=1e-2), micro_batch_tokens=64, lora=lora, lora_seed=1,
                        **kwargs)


VCPO = AlgoConfig.model_validate({"objective": {"type": "vcpo", "is_cap": 2.0}, "group_size": 3})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lora_step_moves_only_the_adapters_and_keeps_the_base_frozen_in_its_dtype(
        dtype: torch.dtype) -> None:
    learner = _learner(VCPO, dtype=dtype)
    base = {n: p.detach().clone() for n, p in learner.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in learner.model.named_parameters() if p.requires_grad}
    assert base and adapters and all(".lora_" in n for n in adapters)
    assert all(v.dtype == dtype for v in base.values())
    for _ in range(2):  # the second step: B ≠ 0, so A moves too
        metrics = learner.step(_noisy_step())
        assert torch.isfinite(torch.tensor(metrics["grad/norm"]))
    for name, value in base.items():
        assert torch.equal(learner.model.get_parameter(name), value), name
    moved = {n for n, v in adapters.items() if not torch.equal(learner.model.get_parameter(n), v)}
    assert moved == set(adapters)
    state = learner.optimizer.state_dict()["state"]
    assert len(state) == len(adapters)  # optimizer state for the adapters alone
    assert sum(p.numel() for p in learner.trained_parameters) == sum(v.numel() for v in adapters.values())


def test_the_learners_vcpo_gradient_is_the_same_on_both_norm_paths_under_lora() -> None:
    grads = {}
    for path in ("fast", "per_trajectory"):
        algo = AlgoConfig.model_validate({"objective": {"type": "vcpo", "is_cap": 2.0,
                                                        "opob": {"grad_norm_path": path}}, "group_size": 3})
        learner = _learner(algo)
        _moved_adapters(learner.model)
        captured = capture_grads(learner)
        learner.step(_noisy_step())
        grads[path] = {n: g for n, g in captured.items() if ".lora_" in n}
        assert all(float(g.abs().max()) == 0 for n, g in captured.items() if ".lora_" not in n)
    for name, grad in grads["per_trajectory"].items():
        torch.testing.assert_close(grads["fast"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_the_engine_gets_the_merged_policy_under_the_base_models_names() -> None:
    learner = _learner(VCPO)
    learner.step(_noisy_step())
    learner.step(_noisy_step())
    plain = tiny_model("llama_tied")
    pushed = dict(learner.named_weights())
    assert list(pushed) == [n for n, _ in plain.named_parameters()]
    assert dict(merged_weights(learner.model)).keys() == pushed.keys()
    # peft's own merge gives the same tensors
    reference = {n: p.detach().clone() for n, p in learner.peft.merge_and_unload().named_parameters()}
    for name, tensor in pushed.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-7, msg=name)


def test_reading_the_merged_weights_leaves_the_callers_grad_mode_alone() -> None:
    """Two pushes read side by side (as a comparison does) and a partly read one: grad mode stays on."""
    first, second = _learner(VCPO), _learner(VCPO)
    for (name, _), (other, _) in zip(first.named_weights(), second.named_weights(), strict=True):
        assert name == other and torch.is_grad_enabled()
    partial = first.named_weights()
    next(partial)
    assert torch.is_grad_enabled()
    del partial
    assert torch.is_grad_enabled()


def test_the_merged_weights_sample_what_the_learner_trains() -> None:
    """k = 0 with LoRA: an engine holding the pushed weights gives the learner's own log-probs (fp32)."""
    learner = _learner(VCPO)
    _moved_adapters(learner.model)
    plain = tiny_model("llama_tied").eval()
    with torch.no_grad():
        for name, tensor in learner.named_weights():
            plain.get_parameter(name).copy_(tensor)
    ids = torch.tensor([t.token_ids for t in random_trajectories(1, 1, seed=4)])
    with torch.no_grad():
        engine = torch.log_softmax(plain(input_ids=ids).logits.float(), -1)
        own = torch.log_softmax(learner.model.eval()(input_ids=ids).logits.float(), -1)
    torch.testing.assert_close(engine, own, rtol=0, atol=1e-5)


def test_a_checkpoint_round_trips_the_adapters_and_their_optimizer() -> None:
    first = _learner(VCPO)
    first.step(_noisy_step())
    state = copy.deepcopy(first.state_dict())  # as torch.save/load would: no tensor shared with `first`
    assert "adapter" in state and "model" not in state
    assert all(".lora_" in k for k in state["adapter"])
    second = _learner(VCPO)  # the same base; its adapters moved away before the load
    with torch.no_grad():
        for p in adapter_parameters(second.model):
            p.add_(1.0)
    second.load_state_dict(state)
    assert second.step_count == first.step_count
    for (n1, t1), (n2, t2) in zip(first.named_weights(), second.named_weights(), strict=True):
        assert n1 == n2 and torch.equal(t1, t2), n1
    step = _noisy_step()
    first.step(step)
    second.step(step)
    for (n1, t1), (_, t2) in zip(first.named_weights(), second.named_weights(), strict=True):
        torch.testing.assert_close(t1, t2, rtol=1e-6, atol=1e-8, msg=n1)  # the optimizer resumed too
    full = _learner(VCPO, lora=None)
    with pytest.raises(ValueError, match=r"resume it with the learner\.lora settings"):
        full.load_state_dict(state)
    with pytest.raises(ValueError, match=r"learner\.lora=null"):
        first.load_state_dict(full.state_dict())
    other = _learner(VCPO, lora=LoraSettings(rank=2, alpha=4.0))
    with pytest.raises((ValueError, RuntimeError)):
        other.load_state_dict(state)


def test_the_export_is_a_merged_directory_and_an_adapter_and_both_load(tmp_path: Path,
                                                                        tiny_model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.set_attn_implementation(register_varlen_sdpa())
    learner = TorchLearner(model.train(), VCPO, OptimConfig(lr=1e-2), micro_batch_tokens=64, lora=SETTINGS)
    _moved_adapters(learner.model)
    export = tmp_path / "export"
    learner.save_pretrained(export)
    assert (export / "model.safetensors").is_file()
    assert (export / ADAPTER_DIR / "adapter_config.json").is_file()
    ids = torch.tensor([[1, 5, 9, 17, 33, 65, 129]])
    with torch.no_grad():
        want = learner.model.eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(export)(input_ids=ids).logits
    torch.testing.assert_close(merged, want, rtol=0, atol=1e-5)
    resolved = resolve_model(str(export / ADAPTER_DIR), tmp_path / "cache")  # what `vcpo eval --model` takes
    merged_dir = Path(resolved.name_or_path)
    assert resolved.is_local and tmp_path / "cache" / "merged_adapters" in merged_dir.parents
    with torch.no_grad():
        from_adapter = AutoModelForCausalLM.from_pretrained(merged_dir)(input_ids=ids).logits
    torch.testing.assert_close(from_adapter, want, rtol=0, atol=1e-5)
    written = (merged_dir / "model.safetensors").stat().st_mtime_ns
    again = resolve_model(str(export / ADAPTER_DIR), tmp_path / "cache")  # merged once, then reused
    assert again == resolved and (merged_dir / "model.safetensors").stat().st_mtime_ns == written


def test_the_no_grad_passes_run_without_the_adapters_dropout() -> None:
    learner = _learner(VCPO, lora=LoraSettings(rank=4, alpha=8.0, dropout=0.5), proximal="auto")
    _moved_adapters(learner.model)
    assert not learner.reuses_gradient_forward  # a random forward cannot stand for log π_old
    tokens = random_trajectories(1, 2, seed=2)
    mb = learner._pack(tokens)[0]
    with torch.no_grad():
        first, second = learner._logprobs(learner.model, mb), learner._logprobs(learner.model, mb)
        noisy = learner._logprobs(learner.model, mb, proximal=False)
    assert torch.equal(first, second) and not torch.equal(first, noisy)
    assert learner.model.training  # restored after
    with pytest.raises(ValueError, match=r"learner\.lora\.dropout"):
        _learner(VCPO, lora=LoraSettings(rank=4, dropout=0.1), proximal="reuse")


def test_with_lora_the_reference_policy_is_the_base() -> None:
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo", "is_cap": 2.0}, "group_size": 3,
                                      "kl_coef": 0.5})
    learner = _learner(algo)
    assert learner.reference is learner.model  # no copy of the base: the adapters are switched off
    _moved_adapters(learner.model)
    mb = learner._pack(random_trajectories(1, 2, seed=2))[0]
    plain = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa()).train()
    with torch.no_grad(), learner._reference_policy():
        ref = learner._logprobs(learner.reference, mb)
    with torch.no_grad():
        adapted = learner._logprobs(learner.model, mb)
        want = TorchLearner(plain, algo, OptimConfig(), micro_batch_tokens=64)._logprobs(plain, mb)
    torch.testing.assert_close(ref, want, rtol=0, atol=1e-6)
    assert not torch.allclose(adapted, want)


def _run_config(**learner: object) -> dict[str, object]:
    return {"model": {"path": "default"}, "task": "configs/tasks/countdown.yaml", "learner": learner}


@pytest.mark.parametrize(("learner", "field"), [
    ({"backend": "megatron", "lora": {"rank": 8}}, "learner.lora trains adapters on the torch learner"),
    ({"proximal": "reuse", "lora": {"dropout": 0.1}}, "learner.lora.dropout"),
    ({"lora": {"target_modules": ["q_proj", "lm_head"]}}, "learner.lora.target_modules"),
    ({"lora": {"target_modules": []}}, "learner.lora.target_modules is empty"),
    ({"lora": {"rank": 0}}, "rank"),
])
def test_bad_lora_settings_are_refused_naming_the_field(learner: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        RunConfig.model_validate(_run_config(**learner))


def test_the_default_lora_settings_adapt_every_projection_and_train_a_step() -> None:
    learner = _learner(VCPO, lora=LoraSettings())
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in learner.model.named_parameters()
               if ".lora_A." in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    trajectories, groups = _as_trajectories(random_trajectories(3, 3, seed=1))
    learner.step(StepInput(trajectories, groups, [0] * len(trajectories), [True] * len(trajectories)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_a_lora_step_moves_only_the_adapters_with_exact_norms(dtype: torch.dtype) -> None:
    """learner.lora on CUDA (fp32 and bf16 bases): the fast norms equal the per-trajectory path's (fp32),
    the step moves only the adapters and the base keeps its dtype."""
    trajectories = random_trajectories(num_groups=3, per_group=3)
    model, _ = _lora_model()
    model = model.to("cuda")
    a, s = vcpo_coefficients(len(trajectories), seed=3)
    batches = pack_trajectories(trajectories, max_tokens=50)
    want = accumulate_opob_grad_per_trajectory(model, batches, a, s, optimal_baseline(a, s))
    model.zero_grad(set_to_none=True)
    got = accumulate_opob_grad_packed(model, batches, a, s, optimal_baseline(a, s))
    torch.testing.assert_close(got.sq_norms, want.sq_norms, rtol=1e-5, atol=0.0)
    learner = TorchLearner(tiny_model("llama_tied", attn_implementation=register_varlen_sdpa())
                           .to("cuda", dtype).train(), VCPO, OptimConfig(lr=1e-2), micro_batch_tokens=64,
                           lora=SETTINGS)
    base = {n: p.detach().clone() for n, p in learner.model.named_parameters() if not p.requires_grad}
    learner.step(_noisy_step())
    learner.step(_noisy_step())
    assert all(torch.equal(learner.model.get_parameter(n), v) and v.dtype == dtype for n, v in base.items())
    assert all(".lora_" in n for n, p in learner.model.named_parameters() if p.requires_grad)
