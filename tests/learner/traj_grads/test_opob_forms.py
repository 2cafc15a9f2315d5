"""Both OPOB forms end to end: the torch learner's VCPO gradient against a brute-force oracle written
here from the formulas alone — per-trajectory autograd, then the spec's or the authors' arithmetic —
on both norm paths, with groups spanning micro-batches, an all-equal group, and a sampling temperature.

The reference oracle follows the authors' `megatron_actor.update_policy_per_traj` step by step: the
backward of w̄_i · mean_t log π / B with advantage 1, its norm times |M_i| · B, ω = norm² · w_i²,
b = Σ ωR / (Σ ω + 1e-8), population σ applied where > 1e-8, `accum += R/σ g`, `score += g/σ`,
`accum −= b · score`.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from configs.schema import AlgoConfig, OptimConfig
from learner.backends.torch_learner import StepInput, TorchLearner
from learner.forward.packing import TrajectoryTokens
from learner.forward.varlen_attention import register_varlen_sdpa
from rollout.trajectory import Trajectory, TrajectoryVersions
from tests.learner.conftest import capture_grads, random_trajectories, tiny_model

REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
"""Three groups of three: mixed, all equal (degenerate), mixed."""
IS_CAP = 1.5


def _token_logprobs(model: torch.nn.Module, t: TrajectoryTokens, temperature: float) -> torch.Tensor:
    """log π(y_t) of the trajectory's trained tokens at temperature T (unpacked forward, differentiable)."""
    ids = torch.tensor(list(t.token_ids)).unsqueeze(0)
    logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature
    all_lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    return all_lp[torch.tensor(list(t.loss_mask[1:]))]


Batch = tuple[list[TrajectoryTokens], list[Trajectory], list[int]]


def _batch(model: torch.nn.Module, temperature: float, log_ratio_targets: dict[int, float] | None = None
           ) -> Batch:
    """Trajectories whose behaviour log-probs are the model's own ± 0.15 per token: sequence weights
    spread around 1, some above the cap. `log_ratio_targets` {i: L} shifts trajectory i's behaviour
    log-probs evenly so that its sequence log-ratio is L."""
    tokens = random_trajectories(num_groups=3, per_group=3, seed=4)
    rng = random.Random(7)
    trajectories, groups = [], []
    with torch.no_grad():
        for i, t in enumerate(tokens):
            own = iter(_token_logprobs(model, t, temperature).tolist())
            behavior = tuple(next(own) + rng.uniform(-0.15, 0.15) if m else 0.0 for m in t.loss_mask[1:])
            if log_ratio_targets and i in log_ratio_targets:
                own_lp = _token_logprobs(model, t, temperature)
                mask = t.loss_mask[1:]
                sampled = torch.tensor([b for b, m in zip(behavior, mask, strict=True) if m])
                shift = (log_ratio_targets[i] - float((own_lp - sampled).sum())) / own_lp.numel()
                behavior = tuple(b - shift if m else 0.0 for b, m in zip(behavior, mask, strict=True))
            behavior = (0.0, *behavior)  # position 0 is never sampled (a prompt token)
            trajectories.append(Trajectory(
                trajectory_id=f"t{i}", group_id=str(t.group_id), token_ids=tuple(t.token_ids),
                loss_mask=tuple(t.loss_mask), behavior_logprobs=behavior,
                versions=TrajectoryVersions(start=0, end=0), reward=REWARDS[i]))
            groups.append(t.group_id)
    return tokens, trajectories, groups


def _oracle(model: torch.nn.Module, tokens: list[TrajectoryTokens], trajectories: list[Trajectory],
            groups: list[int], form: str, temperature: float) -> dict[str, torch.Tensor]:
    """The ascent direction VCPO's step descends (−gradient), by brute force, per parameter name."""
    params = dict(model.named_parameters())
    size = len(tokens)
    grads, log_w, lengths = [], [], []
    for t, trajectory in zip(tokens, trajectories, strict=True):
        logprobs = _token_logprobs(model, t, temperature)
        behavior = torch.tensor([lp for lp, m in zip(trajectory.behavior_logprobs, t.loss_mask, strict=True)
                                 if m])
        log_w.append(float((logprobs.detach() - behavior).sum()))
        lengths.append(logprobs.numel())
        g = torch.autograd.grad(logprobs.mean(), list(params.values()), allow_unused=True)
        grads.append([torch.zeros_like(p) if x is None else x
                      for p, x in zip(params.values(), g, strict=True)])
    w = [math.exp(x) for x in log_w]
    w_bar = [min(x, IS_CAP) for x in w]
    rewards = [t.reward for t in trajectories]
    ascent = {name: torch.zeros_like(p) for name, p in params.items()}
    for group in sorted(set(groups)):
        members = [i for i, g in enumerate(groups) if g == group]
        r = torch.tensor([rewards[i] for i in members], dtype=torch.float64)
        sq = [sum(float((x.double() ** 2).sum()) for x in grads[i]) for i in members]
        if form == "reference":
            # grad of the loss w̄ · mean log π / B, rescaled by the length and by B: ‖w̄ ∇Σ log π‖
            unscaled = [math.sqrt(s) * w_bar[i] / size * lengths[i] * size
                        for s, i in zip(sq, members, strict=True)]
            omega = [u * u * w[i] ** 2 for u, i in zip(unscaled, members, strict=True)]
            b = sum(o * float(x) for o, x in zip(omega, r, strict=True)) / (sum(omega) + 1e-8)
            sigma = float(torch.std(r, unbiased=False))
            scale_reward = [float(x) / sigma for x in r] if sigma > 1e-8 else [float(x) for x in r]
            scale_baseline = 1.0 / sigma if sigma > 1e-8 else 1.0
            for k, i in enumerate(members):
                coef = w_bar[i] / size * (scale_reward[k] - b * scale_baseline)
                for name, x in zip(params, grads[i], strict=True):
                    ascent[name] += coef * x
        else:
            omega = [s * w[i] ** 2 for s, i in zip(sq, members, strict=True)]
            b = sum(o * float(x) for o, x in zip(omega, r, strict=True)) / sum(omega)
            sigma = float(torch.std(r, unbiased=True))
            if sigma == 0:
                continue  # spec: a degenerate group contributes exactly nothing
            for k, i in enumerate(members):
                coef = w_bar[i] / size * (float(r[k]) - b) / (sigma + 1e-6)
                for name, x in zip(params, grads[i], strict=True):
                    ascent[name] += coef * x
    return ascent


def _learner_gradient(model: torch.nn.Module, algo: AlgoConfig, trajectories: list[Trajectory],
                      groups: list[int], micro_batch_tokens: int,
                      temperature: float) -> dict[str, torch.Tensor]:
    learner = TorchLearner(model, algo, OptimConfig(lr=1e-3), micro_batch_tokens=micro_batch_tokens,
                           temperature=temperature)
    captured = capture_grads(learner)
    size = len(trajectories)
    learner.step(StepInput(trajectories, groups, [0] * size, [True] * size))
    return captured


def _algo(form: str, path: str) -> AlgoConfig:
    return AlgoConfig.model_validate({
        "objective": {"type": "vcpo", "is_cap": IS_CAP, "opob": {"form": form, "grad_norm_path": path}},
        "group_size": 3})


@pytest.mark.parametrize("form", ["spec", "reference"])
@pytest.mark.parametrize("path", ["fast", "per_trajectory"])
@pytest.mark.parametrize("micro_batch_tokens", [48, 4096])  # groups across micro-batches / all in one
def test_vcpo_gradient_matches_the_brute_force_oracle_of_its_form(form: str, path: str,
                                                                   micro_batch_tokens: int) -> None:
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa(), seed=3).train()
    tokens, trajectories, groups = _batch(model, 1.0)
    expected = _oracle(model, tokens, trajectories, groups, form, 1.0)
    got = _learner_gradient(model, _algo(form, path), trajectories, groups, micro_batch_tokens, 1.0)
    for name, ascent in expected.items():
        torch.testing.assert_close(got[name], -ascent, rtol=2e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("path", ["fast", "per_trajectory"])
def test_reference_gradient_with_sequence_log_ratios_beyond_the_clamp(path: str) -> None:
    """L = 25 and 22 in the first group, −25 in the last: the authors' ω and w̄ take e^L unclamped (the
    oracle's math.exp), where a ±20 clamp would make the first group's two weights equal."""
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa(), seed=3).train()
    tokens, trajectories, groups = _batch(model, 1.0, {0: 25.0, 1: 22.0, 6: -25.0})
    expected = _oracle(model, tokens, trajectories, groups, "reference", 1.0)
    got = _learner_gradient(model, _algo("reference", path), trajectories, groups, 48, 1.0)
    for name, ascent in expected.items():
        torch.testing.assert_close(got[name], -ascent, rtol=2e-4, atol=1e-7, msg=name)


def test_the_two_forms_give_different_gradients_on_the_same_batch() -> None:
    """A guard that the form switch reaches the learner: w̄² and the length² in ω move b."""
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa(), seed=3).train()
    _, trajectories, groups = _batch(model, 1.0)
    spec = _learner_gradient(model, _algo("spec", "fast"), trajectories, groups, 4096, 1.0)
    reference = _learner_gradient(model, _algo("reference", "fast"), trajectories, groups, 4096, 1.0)
    differences = [float((spec[n] - reference[n]).abs().max()) for n in spec]
    assert max(differences) > 1e-5


@pytest.mark.parametrize("form", ["spec", "reference"])
@pytest.mark.parametrize("path", ["fast", "per_trajectory"])
def test_the_vcpo_gradient_forwards_use_the_sampling_temperature(form: str, path: str) -> None:
    """At T = 0.7 the gradient forwards must divide the logits by T, as the proximal pass does: before
    the fix they ran at T = 1, so ℓ_i, its norms and the gradient belonged to another policy."""
    temperature = 0.7
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa(), seed=5).train()
    tokens, trajectories, groups = _batch(model, temperature)
    expected = _oracle(model, tokens, trajectories, groups, form, temperature)
    got = _learner_gradient(model, _algo(form, path), trajectories, groups, 48, temperature)
    for name, ascent in expected.items():
        torch.testing.assert_close(got[name], -ascent, rtol=2e-4, atol=1e-7, msg=name)
    wrong = _oracle(model, tokens, trajectories, groups, form, 1.0)
    assert max(float((got[n] + wrong[n]).abs().max()) for n in wrong) > 1e-4  # T = 1 is not what it computed
