"""`algo.corrections` in the torch learner's step: the step's gradient and metrics are those of the
objective on the corrected minibatch (`vcpo.corrections.correct_inputs`) — for VCPO with ‖∇ℓ_i‖² of the
log-likelihood of the kept tokens — and the step refuses to take log π_old from its own gradient pass."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from configs.schema import AlgoConfig, OptimConfig
from learner.backends.algorithm_from_config import build_corrections
from learner.backends.torch_learner import StepInput, TorchLearner
from learner.forward.packing import TrajectoryTokens
from learner.forward.varlen_attention import register_varlen_sdpa
from learner.traj_grads.reference import trajectory_loglik
from tests.learner.backends.test_torch_learner import _noisy_step, _padded_logprobs
from tests.learner.conftest import capture_grads, tiny_model
from vcpo.corrections import correct_inputs
from vcpo.objectives import PolicyLossInputs

TOKEN_BAND = {"type": "token_reject", "lower": 0.75, "upper": 1.35}
REJECTIONS = [TOKEN_BAND, {"type": "opsm", "delta": 0.01}]
CASES = [
    ("grpo", [*REJECTIONS, {"type": "token_tis", "cap": 1.2}]),
    ("reinforce", [*REJECTIONS, {"type": "seq_tis", "cap": 1.5}]),
    ("gspo", [{"type": "geo_reject", "lower": 0.9, "upper": 1.1}, {"type": "token_tis", "cap": 1.2}]),
    ("m2po", [{"type": "k3_reject", "threshold": 0.04}, TOKEN_BAND]),
    ("vcpo", REJECTIONS),
    ("vcpo", [{"type": "k3_reject", "threshold": 0.04}, TOKEN_BAND]),
]


def _learner(algo: AlgoConfig, micro_batch_tokens: int = 64, proximal: str = "separate") -> TorchLearner:
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa()).train()
    return TorchLearner(model, algo, OptimConfig(lr=1e-3), micro_batch_tokens=micro_batch_tokens,
                        proximal=proximal)  # type: ignore[arg-type]


def _algo(objective: str, corrections: list[dict[str, Any]]) -> AlgoConfig:
    spec: dict[str, Any] = {"type": objective}
    if objective == "gspo":
        spec["ratio_to"] = "proximal"  # a ratio to μ would be a behaviour weight of its own
    return AlgoConfig.model_validate({"objective": spec, "group_size": 3, "corrections": corrections})


def _trained_tokens(step: StepInput) -> list[TrajectoryTokens]:
    return [TrajectoryTokens(t.token_ids, t.loss_mask if trained else (False,) * len(t.loss_mask),
                             group_id=int(g))
            for t, g, trained in zip(step.trajectories, step.group_ids, step.is_trained, strict=True)]


@pytest.mark.parametrize(("objective", "corrections"), CASES,
                         ids=[f"{o}-{'+'.join(c['type'] for c in cs)}" for o, cs in CASES])
def test_a_corrected_step_is_autograd_of_the_objective_on_the_corrected_minibatch(
    objective: str, corrections: list[dict[str, Any]],
) -> None:
    step = _noisy_step()
    algo = _algo(objective, corrections)
    learner = _learner(algo)
    grads = capture_grads(learner)
    metrics = learner.step(step)

    model, tokens = learner.model, _trained_tokens(step)
    logprobs = _padded_logprobs(model, tokens)
    mask = torch.zeros_like(logprobs, dtype=torch.bool)
    behavior = torch.zeros_like(logprobs)
    for i, (t, tok) in enumerate(zip(step.trajectories, tokens, strict=True)):
        sampled = [lp for lp, m in zip(t.behavior_logprobs, tok.loss_mask, strict=True) if m]
        mask[i, : len(sampled)] = True
        behavior[i, : len(sampled)] = torch.tensor(sampled)
    inputs = PolicyLossInputs(logprobs=logprobs, old_logprobs=logprobs.detach(), behavior_logprobs=behavior,
                              loss_mask=mask, rewards=torch.tensor([t.reward for t in step.trajectories]),
                              group_ids=torch.tensor(list(step.group_ids)),
                              lags=torch.tensor(list(step.lags)))
    corrected, correction = correct_inputs(build_corrections(algo), inputs)
    removed = float(correction.metrics["correction/rejected_tokens"])
    assert 0.05 < removed < 0.8, f"the stages should remove some tokens and keep most, removed {removed:.2f}"
    token_mean = learner.objective.loss_aggregation == "token-mean"
    num_units = corrected.loss_mask.sum() if token_mean else len(tokens)  # the learner's global denominator
    norms = None
    if learner.objective.needs_grad_norms:  # brute force: ‖∇ℓ_i‖² of the kept tokens' mean log-likelihood
        norms = []
        for i, t in enumerate(tokens):
            kept = iter(corrected.loss_mask[i].tolist())
            kept_mask = [bool(m) and next(kept) for m in t.loss_mask]
            if not any(kept_mask):
                norms.append(0.0)
                continue
            loglik = trajectory_loglik(model, TrajectoryTokens(t.token_ids, kept_mask, t.group_id), "mean")
            g = torch.autograd.grad(loglik, list(model.parameters()), allow_unused=True)
            norms.append(sum(float((x.float() ** 2).sum()) for x in g if x is not None))
        norms = torch.tensor(norms)
    corrected = dataclasses.replace(corrected, num_units=num_units, seq_sq_grad_norms=norms)
    model.zero_grad(set_to_none=True)
    output = learner.objective(corrected)  # a member with no kept token still counts in its group's σ_g
    output.loss.backward()
    scale = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    assert scale > 1e-4
    for name, p in model.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-5 * scale, msg=name)
    assert metrics["is/ess_ratio"] == pytest.approx(float(output.metrics["is/ess_ratio"]), rel=1e-5)
    assert metrics["tokens/trained"] == int(corrected.loss_mask.sum())
    for key, value in correction.metrics.items():
        assert metrics[key] == pytest.approx(value.tolist(), rel=1e-6, nan_ok=True), key


def test_a_rejected_trajectory_leaves_the_vcpo_gradient_pass_and_weighs_zero_in_the_step_size() -> None:
    """OPSM drops whole negative trajectories: their norms are 0 (no kept token) and the lr rule's ρ counts
    them as w = 0 — below the ρ of the same batch without the stage."""
    step = _noisy_step()
    plain = _learner(_algo("vcpo", []))
    capture_grads(plain)
    corrected = _learner(_algo("vcpo", [{"type": "opsm", "delta": 0.0}]))
    capture_grads(corrected)
    without, with_opsm = plain.step(step), corrected.step(step)
    assert with_opsm["correction/rejected_trajectories"] > 0
    assert with_opsm["lr/ess_ratio"] < without["lr/ess_ratio"]
    assert with_opsm["tokens/trained"] < without["tokens/trained"]


def test_corrections_keep_the_separate_proximal_pass() -> None:
    algo = _algo("vcpo", REJECTIONS)
    assert not _learner(algo, proximal="auto").reuses_gradient_forward
    with pytest.raises(ValueError, match=r"learner\.proximal"):
        _learner(algo, proximal="reuse")
