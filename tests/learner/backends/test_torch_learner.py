"""The torch learner's step: VCPO's packed exact-norm gradient equals autograd of the VCPO objective
with brute-force norms; every objective trains; filters and poisoned batches behave."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any

import pytest
import torch

from configs.schema import AlgoConfig, OptimConfig
from learner.backends.torch_learner import StepInput, TorchLearner, lr_at
from learner.forward.packing import TrajectoryTokens
from learner.forward.varlen_attention import register_varlen_sdpa
from learner.traj_grads.reference import trajectory_loglik
from rollout.trajectory import Trajectory, TrajectoryVersions
from tests.learner.conftest import capture_grads, random_trajectories, shared_prompt_trajectories, tiny_model
from vcpo.objectives import PolicyLossInputs


def _as_trajectories(tokens: list[TrajectoryTokens], seed: int = 0) -> tuple[list[Trajectory], list[int]]:
    rng = random.Random(seed)
    out, groups = [], []
    for i, t in enumerate(tokens):
        logprobs = tuple(-rng.uniform(0.5, 6.0) if m else 0.0 for m in t.loss_mask)
        out.append(Trajectory(trajectory_id=f"t{i}", group_id=str(t.group_id), token_ids=tuple(t.token_ids),
                              loss_mask=tuple(t.loss_mask), behavior_logprobs=logprobs,
                              versions=TrajectoryVersions(start=0, end=0), reward=float(rng.random() < 0.5)))
        groups.append(t.group_id)
    return out, groups


def _learner(algo: AlgoConfig, seed: int = 0, micro_batch_tokens: int = 64) -> TorchLearner:
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa(), seed=seed).train()
    return TorchLearner(model, algo, OptimConfig(lr=1e-3), micro_batch_tokens=micro_batch_tokens)


def _padded_logprobs(model: torch.nn.Module, tokens: list[TrajectoryTokens]) -> torch.Tensor:
    """(B, width) log π of each trajectory's sampled tokens, unpacked forward, in order."""
    rows = []
    for t in tokens:
        ids = torch.tensor(list(t.token_ids)).unsqueeze(0)
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        all_lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        rows.append(all_lp[torch.tensor(list(t.loss_mask[1:]))])
    width = max(r.numel() for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])


def _perturb_reference(learner: TorchLearner) -> None:
    """Move the frozen reference away from the policy: at the first step π_ref = π_θ, where every KL
    estimator has zero gradient and a missing KL term could not be told from a present one."""
    if learner.reference is None:
        return
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in learner.reference.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))


def _objective_grads(learner: TorchLearner, tokens: list[TrajectoryTokens], trajectories: list[Trajectory],
                     groups: list[int], trained: list[bool] | None = None
                     ) -> tuple[dict[str, torch.Tensor], PolicyLossInputs]:
    """Autograd of the learner's objective at its model's weights with brute-force ‖∇ℓ_i‖²: the gradient
    the learner's VCPO step must equal. An untrained member keeps its reward with an empty loss mask (and
    counts in the seq-mean's B, as the learner's every objective counts it)."""
    trained = trained or [True] * len(tokens)
    model = learner.model
    norms = []
    for t, is_trained in zip(tokens, trained, strict=True):
        if not is_trained:
            norms.append(0.0)
            continue
        loglik = trajectory_loglik(model, t, "mean")
        g = torch.autograd.grad(loglik, list(model.parameters()), allow_unused=True)
        norms.append(sum(float((x.float() ** 2).sum()) for x in g if x is not None))
    logprobs = _padded_logprobs(model, tokens)
    mask = torch.zeros_like(logprobs, dtype=torch.bool)
    behavior = torch.zeros_like(logprobs)
    for i, t in enumerate(trajectories):
        sampled = [lp for lp, m in zip(t.behavior_logprobs, t.loss_mask, strict=True) if m]
        mask[i, : len(sampled)] = trained[i]
        behavior[i, : len(sampled)] = torch.tensor(sampled)
    ref = None if learner.reference is None else _padded_logprobs(learner.reference, tokens).detach()
    inputs = PolicyLossInputs(logprobs=logprobs, old_logprobs=logprobs.detach(), behavior_logprobs=behavior,
                              loss_mask=mask, rewards=torch.tensor([t.reward for t in trajectories]),
                              group_ids=torch.tensor(groups), seq_sq_grad_norms=torch.tensor(norms),
                              ref_logprobs=ref, num_units=float(len(tokens)))  # the learner's: every member
    model.zero_grad(set_to_none=True)
    learner.objective(inputs).loss.backward(retain_graph=True)
    return {name: p.grad.clone() for name, p in model.named_parameters()}, inputs


@pytest.mark.parametrize("micro_batch_tokens", [64, 4096])  # groups over several micro-batches / one
@pytest.mark.parametrize(("grad_norm_path", "kl_coef"),
                         [("fast", 0.0), ("fast", 0.5), ("per_trajectory", 0.5)])
def test_vcpo_step_gradient_equals_autograd_of_the_objective_with_exact_norms(
    micro_batch_tokens: int, grad_norm_path: str, kl_coef: float,
) -> None:
    """Both norm paths, with and without the KL term: the learner's two-buffer gradient plus its KL pass
    equals autograd of the documented objective, −(1/B) Σ sg[w̄(R − b*)/σ] ℓ_i + kl_coef · agg(k3)."""
    tokens = random_trajectories(num_groups=3, per_group=3, seed=1)
    trajectories, groups = _as_trajectories(tokens)
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo", "is_cap": 2.0,
                                                    "opob": {"grad_norm_path": grad_norm_path}},
                                      "group_size": 3, "kl_coef": kl_coef})
    learner = _learner(algo, micro_batch_tokens=micro_batch_tokens)
    _perturb_reference(learner)
    grads = capture_grads(learner)
    lags = [0] * len(tokens)
    learner.step(StepInput(trajectories, groups, lags, [True] * len(tokens)))

    want, inputs = _objective_grads(learner, tokens, trajectories, groups)
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)
    if kl_coef > 0:  # the KL term is a real part of that gradient, not a rounding-sized one
        model = learner.model
        model.zero_grad(set_to_none=True)
        dataclasses.replace(learner.objective, kl_coef=0.0)(inputs).loss.backward()
        moved = max(float((want[name] - p.grad).abs().max()) for name, p in model.named_parameters())
        assert moved > 0.1 * max(float(g.abs().max()) for g in want.values())


@pytest.mark.parametrize("grad_norm_path", ["fast", "per_trajectory"])
def test_vcpo_with_an_entropy_bonus_is_refused_when_the_learner_is_built(grad_norm_path: str) -> None:
    objective = {"type": "vcpo", "opob": {"grad_norm_path": grad_norm_path}}
    algo = AlgoConfig.model_validate({"objective": objective, "group_size": 3, "entropy_coef": 0.01})
    with pytest.raises(ValueError, match=r"set algo\.entropy_coef=0"):
        _learner(algo)


ALL_OBJECTIVES = ["grpo", "dr_grpo", "rloo", "reinforce", "token_tis", "seq_tis", "mis", "m2po", "bapo",
                  "gspo", "cispo", "tba", "otb", "vcpo"]


def _noisy_step(noise: float = 0.3) -> StepInput:
    """3 groups × 3 trajectories with behaviour = the model's own log-probs + N(0, noise²) per token (M2PO
    masks tokens, BAPO's bounds move, IS weights vary), lags 0–2 and one task-filtered trajectory."""
    rng = random.Random(7)
    tokens = random_trajectories(num_groups=3, per_group=3, seed=1)
    model = tiny_model("llama_tied")
    trajectories = []
    for i, t in enumerate(tokens):
        ids = torch.tensor([t.token_ids])
        with torch.no_grad():
            own = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        own = own.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
        logprobs = tuple(own[j - 1] + rng.gauss(0.0, noise) if m else 0.0 for j, m in enumerate(t.loss_mask))
        trajectories.append(Trajectory(
            trajectory_id=f"t{i}", group_id=str(t.group_id), token_ids=tuple(t.token_ids),
            loss_mask=tuple(t.loss_mask), behavior_logprobs=logprobs,
            versions=TrajectoryVersions(start=0, end=0), reward=float(rng.random() < 0.5)))
    trained = [i != 4 for i in range(len(tokens))]
    return StepInput(trajectories, [t.group_id for t in tokens], [i % 3 for i in range(len(tokens))], trained)


SPLIT_CASES = [*((objective, {}) for objective in ALL_OBJECTIVES),
               ("dr_grpo", {"kl_coef": 0.5}),  # the KL term's constant N too
               ("grpo", {"kl_coef": 0.5, "loss_aggregation": "seq-mean-token-sum-norm"}),
               ("tba", {"kl_coef": 0.5}),
               ("vcpo", {"kl_coef": 0.5, "objective": {"type": "vcpo", "opob": {"form": "reference"}}}),
               # corrections run once on the whole minibatch, before it is split
               ("grpo", {"corrections": [{"type": "token_reject", "lower": 0.75, "upper": 1.35},
                                         {"type": "opsm", "delta": 0.01},
                                         {"type": "token_tis", "cap": 1.2}]}),
               ("vcpo", {"corrections": [{"type": "k3_reject", "threshold": 0.04},
                                         {"type": "token_reject", "lower": 0.75, "upper": 1.35}]})]


@pytest.mark.parametrize(("objective", "extra"), SPLIT_CASES,
                         ids=[f"{o}-{'-'.join(e) or 'default'}" for o, e in SPLIT_CASES])
def test_the_gradient_does_not_depend_on_how_the_minibatch_is_split_into_micro_batches(
    objective: str, extra: dict,
) -> None:
    """A budget of 8 tokens (one group per micro-batch; VCPO: one trajectory) gives the gradient and the
    metrics of a single micro-batch: every batch-wide statistic is the minibatch's."""
    from vcpo.registry import OBJECTIVES

    assert set(ALL_OBJECTIVES) == set(OBJECTIVES)  # every objective of the registry is covered
    step = _noisy_step()
    algo = AlgoConfig.model_validate({"objective": {"type": objective}, "group_size": 3, **extra})
    grads, metrics = {}, {}
    for budget in (8, 1_000_000):
        learner = _learner(algo, micro_batch_tokens=budget)
        _perturb_reference(learner)
        grads[budget] = capture_grads(learner)
        metrics[budget] = learner.step(step)
    split, whole = grads[8], grads[1_000_000]
    assert metrics[8]["train/micro_batches"] >= 3 and metrics[1_000_000]["train/micro_batches"] == 1
    scale = max(float(g.abs().max()) for g in whole.values())
    assert scale > 1e-3  # a real gradient
    for name, want in whole.items():  # fp32: only the summation order differs (measured ≤ 6e-7 · scale)
        torch.testing.assert_close(split[name], want, rtol=1e-4, atol=1e-5 * scale, msg=name)
    for key, value in metrics[1_000_000].items():
        if key != "train/micro_batches" and not key.startswith("time/"):  # time: wall clock
            assert metrics[8][key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), key


@pytest.mark.parametrize("objective", ALL_OBJECTIVES)
def test_every_supported_objective_takes_a_finite_step_that_changes_the_weights(objective: str) -> None:
    tokens = random_trajectories(num_groups=2, per_group=4, seed=2)
    trajectories, groups = _as_trajectories(tokens, seed=3)
    algo = AlgoConfig.model_validate({"objective": {"type": objective}, "group_size": 4})
    learner = _learner(algo)
    before = [p.detach().clone() for p in learner.model.parameters()]
    metrics = learner.step(StepInput(trajectories, groups, [1] * len(tokens), [True] * len(tokens)))
    assert math.isfinite(metrics["grad/norm"]) and metrics["grad/norm"] > 0
    assert metrics["staleness/mean"] == 1.0
    assert 0 < metrics["is/ess_ratio"] <= 1.0
    assert any(not torch.equal(b, p) for b, p in zip(before, learner.model.parameters(), strict=True))


def _on_policy_group(model: torch.nn.Module, good: list[int], bad: list[int], mask: list[bool]
                     ) -> list[Trajectory]:
    """Two rewarded and two unrewarded samples with the model's own log-probs as behaviour."""
    out = []
    for i, (ids, reward) in enumerate([(good, 1.0), (bad, 0.0), (bad, 0.0), (good, 1.0)]):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        behavior = tuple(float(lp[j - 1]) if m else 0.0 for j, m in enumerate(mask))
        out.append(Trajectory(trajectory_id=f"t{i}", group_id="0", token_ids=tuple(ids),
                              loss_mask=tuple(mask), behavior_logprobs=behavior,
                              versions=TrajectoryVersions(start=0, end=0), reward=reward))
    return out


@pytest.mark.parametrize(("objective", "autocast"), [*((o, None) for o in ALL_OBJECTIVES),
                                                     ("vcpo", torch.bfloat16), ("grpo", torch.bfloat16)])
def test_on_policy_steps_make_the_rewarded_answer_more_likely(objective: str, autocast: torch.dtype | None
                                                              ) -> None:
    # the sign test: whatever else an objective does, ascending it on on-policy samples must raise
    # the likelihood of the rewarded answer relative to the unrewarded one (also with bf16 autocast)
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa(), seed=0).train()
    algo = AlgoConfig.model_validate({"objective": {"type": objective}, "ess_lr": {"enabled": False},
                                      "group_size": 4})
    learner = TorchLearner(model, algo, OptimConfig(lr=1e-3), micro_batch_tokens=4096,
                           autocast_dtype=autocast)
    prompt, mask = [5, 6, 7, 8], [False] * 4 + [True] * 3
    good, bad = [*prompt, 10, 11, 12], [*prompt, 20, 21, 22]

    def margin() -> float:
        with torch.no_grad():
            return float(trajectory_loglik(model, TrajectoryTokens(good, mask, group_id=0), "sum")
                         - trajectory_loglik(model, TrajectoryTokens(bad, mask, group_id=0), "sum"))

    before = margin()
    for _ in range(3):
        learner.step(StepInput(_on_policy_group(model, good, bad, mask), [0] * 4, [0] * 4, [True] * 4))
    assert margin() > before + 0.1


@pytest.mark.parametrize("objective", ["vcpo", "grpo", "token_tis"])
def test_bf16_autocast_step_is_the_fp32_step_up_to_bf16_rounding(objective: str) -> None:
    """learner.autocast=bfloat16: gradients within bf16 rounding of the fp32 ones (and not equal to
    them: autocast was in effect), while the proximal pass stays fp32, so every IS statistic — hence
    the step size and VCPO's coefficients — is identical."""
    tokens = random_trajectories(num_groups=2, per_group=4, seed=2)
    trajectories, groups = _as_trajectories(tokens, seed=3)
    algo = AlgoConfig.model_validate({"objective": {"type": objective}, "group_size": 4})
    step = StepInput(trajectories, groups, [1] * len(tokens), [True] * len(tokens))
    exact, mixed = _learner(algo), _learner(algo)
    mixed.autocast_dtype = torch.bfloat16
    exact_grads, mixed_grads = capture_grads(exact), capture_grads(mixed)
    exact_metrics, mixed_metrics = exact.step(step), mixed.step(step)
    for key in ("is/ess_ratio", "is/w_max", "lr/scale", "is/log_w_mean"):
        assert mixed_metrics[key] == exact_metrics[key], key
    errors = {name: float((mixed_grads[name] - grad).norm() / grad.norm())
              for name, grad in exact_grads.items() if grad.norm() > 0}
    assert max(errors.values()) < 5e-2, errors
    assert max(errors.values()) > 1e-4
    assert all(g.dtype == torch.float32 for g in mixed_grads.values())


@pytest.mark.parametrize("autocast_proximal", [False, True])
def test_autocast_keeps_on_policy_ratios_exact_unless_the_proximal_pass_is_bf16_too(
    autocast_proximal: bool,
) -> None:
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa(), seed=0).train()
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo"}, "group_size": 4})
    learner = TorchLearner(model, algo, OptimConfig(lr=1e-3), micro_batch_tokens=4096,
                           autocast_dtype=torch.bfloat16, autocast_proximal=autocast_proximal)
    prompt, mask = [5, 6, 7, 8], [False] * 4 + [True] * 3
    group = _on_policy_group(model, [*prompt, 10, 11, 12], [*prompt, 20, 21, 22], mask)  # fp32 behaviour
    metrics = learner.step(StepInput(group, [0] * 4, [0] * 4, [True] * 4))
    if autocast_proximal:
        assert metrics["is/log_w_mean"] != 0.0 and metrics["is/ess_ratio"] < 1.0
    else:
        assert metrics["is/ess_ratio"] == pytest.approx(1.0, abs=1e-6)
        assert metrics["is/log_w_mean"] == pytest.approx(0.0, abs=1e-5)


def test_otb_statistics_match_a_full_softmax() -> None:
    from learner.forward.logprobs import packed_target_stats
    from learner.forward.packing import build_microbatch, plan_microbatches

    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa(), seed=1)
    tokens = random_trajectories(num_groups=2, per_group=2, seed=5)
    plan = plan_microbatches([len(t.token_ids) for t in tokens], [t.group_id for t in tokens], 10_000)
    mb = build_microbatch(tokens, plan[0], "mean")
    chosen, sum_sq = packed_target_stats(model, mb)
    expected_lp, expected_sq = [], []
    for t in (tokens[i] for i in mb.trajectory_indices.tolist()):
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=torch.tensor([list(t.token_ids)]), use_cache=False)
                                  .logits[0].float(), -1)
        for pos in range(1, len(t.token_ids)):
            if t.loss_mask[pos]:
                expected_lp.append(float(probs[pos - 1, t.token_ids[pos]].log()))
                expected_sq.append(float((probs[pos - 1] ** 2).sum()))
    torch.testing.assert_close(chosen, torch.tensor(expected_lp), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sum_sq, torch.tensor(expected_sq), rtol=1e-4, atol=1e-6)


def test_untrained_trajectories_contribute_no_gradient() -> None:
    tokens = random_trajectories(num_groups=2, per_group=3, seed=4)
    trajectories, groups = _as_trajectories(tokens)
    algo = AlgoConfig.model_validate({"objective": {"type": "grpo"}, "group_size": 3})
    learner = _learner(algo)
    grads = capture_grads(learner)
    learner.step(StepInput(trajectories, groups, [0] * 6, [False] * 6))
    assert all(float(g.abs().sum()) == 0.0 for g in grads.values())


def _with_rewards(step: StepInput, rewards: list[float]) -> StepInput:
    pairs = zip(step.trajectories, rewards, strict=True)
    trajectories = [t.model_copy(update={"reward": r}) for t, r in pairs]
    return dataclasses.replace(step, trajectories=trajectories)


def _assert_same_step(grads: dict[str, torch.Tensor], metrics: dict[str, Any],
                      want_grads: dict[str, torch.Tensor], want_metrics: dict[str, Any],
                      uncompared: tuple[str, ...] = ("train/skipped_groups", "train/micro_batches")) -> None:
    """The same gradient (fp32: packings may differ) and every metric but `uncompared` and the timings."""
    scale = max(float(g.abs().max()) for g in want_grads.values())
    assert scale > 1e-3  # a real gradient
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-5 * scale, msg=name)
    for key, value in want_metrics.items():
        if key not in uncompared and not key.startswith("time/"):
            assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6, nan_ok=True), key


@pytest.mark.parametrize("budget", [8, 1_000_000])  # one trajectory per micro-batch / all in one
def test_vcpo_leaves_degenerate_groups_out_of_the_gradient_pass_and_the_step_is_unchanged(
    budget: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Group 1 scores 0.1 three times (degenerate; not exact in float32, so σ_g is ~1e-8, not 0): its
    gradient is exactly 0, so the step leaves it out of the gradient pass. The gradient and every metric
    but the count equal those of a step that forwards and back-propagates it."""
    step = _with_rewards(_noisy_step(), [1.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.0, 1.0, 1.0])
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo"}, "group_size": 3})
    skipping = _learner(algo, micro_batch_tokens=budget)
    grads, metrics = capture_grads(skipping), skipping.step(step)
    assert metrics["train/skipped_groups"] == 1 and metrics["train/degenerate_groups"] == 1
    with monkeypatch.context() as patch:  # the same step with every group in the gradient pass
        patch.setattr(TorchLearner, "_silent_trajectories",
                      lambda self, tokens, *args: torch.zeros(len(tokens), dtype=torch.bool))
        forwarding = _learner(algo, micro_batch_tokens=budget)
        all_grads, all_metrics = capture_grads(forwarding), forwarding.step(step)
    assert all_metrics["train/skipped_groups"] == 0
    _assert_same_step(grads, metrics, all_grads, all_metrics)


@pytest.mark.parametrize("objective", ["vcpo", "grpo"])
def test_an_all_degenerate_step_runs_no_gradient_pass_and_steps_on_zero(objective: str) -> None:
    step = _with_rewards(_noisy_step(), [0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    algo = AlgoConfig.model_validate({"objective": {"type": objective}, "group_size": 3})
    learner = _learner(algo)
    grads = capture_grads(learner)
    metrics = learner.step(step)
    assert metrics["train/skipped_groups"] == 3 and metrics["train/degenerate_groups"] == 3
    assert 0 < metrics["is/ess_ratio"] < 1  # the proximal pass still ran: noisy behaviour, IS weights ≠ 1
    assert len(grads) == len(list(learner.model.parameters()))
    assert all(float(g.abs().sum()) == 0.0 for g in grads.values())  # exactly zero, present (AdamW steps)
    fresh = _learner(algo)  # AdamW steps every parameter (its moments decay) as on a computed zero gradient
    assert fresh.step(step)["grad/norm"] == 0.0
    parameters = list(fresh.model.parameters())
    assert all(float(fresh.optimizer.state[p]["step"]) == 1.0 for p in parameters)


def _reusing(algo: AlgoConfig, budget: int = 64, share_prompts: bool = False) -> TorchLearner:
    learner = _learner(algo, micro_batch_tokens=budget)
    learner.proximal, learner.share_prompts = "reuse", share_prompts
    assert learner.reuses_gradient_forward
    return learner


@pytest.mark.parametrize(("budget", "share_prompts"), [(8, False), (1_000_000, False), (1_000_000, True)])
def test_reuse_takes_a_degenerate_groups_pi_old_from_a_no_grad_forward_and_the_step_is_unchanged(
    budget: int, share_prompts: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """learner.proximal: reuse takes log π_old from the gradient forward — but a degenerate group has no
    gradient pass: it is packed apart and its log π_old comes from a no-grad forward in the gradient
    forward's dtype (fp32 here: the same values). The gradient and every metric but the count equal
    those of the reuse step that runs the group through the gradient pass, and of the separate pass."""
    step = _with_rewards(_noisy_step(), [1.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.0, 1.0, 1.0])
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo"}, "group_size": 3})
    skipping = _reusing(algo, budget, share_prompts)
    grads, metrics = capture_grads(skipping), skipping.step(step)
    assert metrics["train/skipped_groups"] == 1 and metrics["train/degenerate_groups"] == 1
    with monkeypatch.context() as patch:  # the same step with every group in the gradient pass
        patch.setattr(TorchLearner, "_silent_trajectories",
                      lambda self, tokens, *args: torch.zeros(len(tokens), dtype=torch.bool))
        forwarding = _reusing(algo, budget, share_prompts)
        all_grads, all_metrics = capture_grads(forwarding), forwarding.step(step)
    separate = _learner(algo, micro_batch_tokens=budget)
    separate_grads, separate_metrics = capture_grads(separate), separate.step(step)
    assert all_metrics["train/skipped_groups"] == 0
    # the degenerate group's no-grad forward takes the shared-prompt layout (the only one under reuse)
    assert (metrics["train/prompt_tokens_shared"] > 0) == share_prompts
    assert all_metrics["train/prompt_tokens_shared"] == 0
    uncompared = ("train/skipped_groups", "train/micro_batches", "train/prompt_tokens_shared")
    _assert_same_step(grads, metrics, all_grads, all_metrics, uncompared)
    _assert_same_step(grads, metrics, separate_grads, separate_metrics, uncompared)


@pytest.mark.parametrize("form", ["spec", "reference"])
def test_a_reuse_step_of_degenerate_groups_gets_its_importance_weights_from_the_no_grad_forward(
    form: str,
) -> None:
    """All three groups degenerate under reuse: in the spec form no gradient pass at all (exact zero
    gradients, AdamW steps), yet log π_old — and with it the IS weights, the ESS and the step size — is
    that of the separate proximal pass. The reference form (the authors' code) drops no group: its
    coefficients of an all-equal group are tiny, not 0, so every group goes through the gradient pass."""
    step = _with_rewards(_noisy_step(), [0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo", "opob": {"form": form}}, "group_size": 3})
    learner = _reusing(algo)
    grads, metrics = capture_grads(learner), learner.step(step)
    separate_metrics = _learner(algo).step(step)
    for key in ("is/ess_ratio", "is/w_max", "is/log_w_mean", "lr/scale"):
        assert metrics[key] == pytest.approx(separate_metrics[key], rel=1e-5, abs=1e-7), key
    assert 0 < metrics["is/ess_ratio"] < 1  # noisy behaviour: IS weights ≠ 1
    if form == "reference":
        assert metrics["train/skipped_groups"] == 0
        assert max(float(g.abs().max()) for g in grads.values()) > 0
        return
    assert metrics["train/skipped_groups"] == 3
    assert len(grads) == len(list(learner.model.parameters()))
    assert all(float(g.abs().sum()) == 0.0 for g in grads.values())
    fresh = _reusing(algo)  # AdamW steps every parameter, as on a computed zero gradient
    assert fresh.step(step)["grad/norm"] == 0.0
    assert all(float(fresh.optimizer.state[p]["step"]) == 1.0 for p in fresh.model.parameters())


def test_lr_schedule_warms_up_then_decays() -> None:
    optim = OptimConfig(lr=1.0, warmup_steps=2, schedule="linear", total_steps=6)
    # warm-up: (step+1)/2 → 0.5, 1.0; then 1 − (step−2)/4 → 1, .75, .5, .25
    assert [lr_at(optim, s) for s in range(6)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]


def test_the_fused_adamw_takes_torchs_default_step_and_stays_fused_after_a_resume() -> None:
    """The learner's AdamW is the fused one on CPU (half the optimizer phase); its update is the
    per-parameter loop's up to fp32 rounding, and a checkpoint written by a non-fused optimizer (runs
    before the change) resumes into the fused one with the same state."""
    tokens = random_trajectories(num_groups=2, per_group=3, seed=5)
    trajectories, groups = _as_trajectories(tokens, seed=6)
    batch = StepInput(trajectories, groups, [1] * 6, [True] * 6)
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo"}, "group_size": 3})
    fused, looped = _learner(algo), _learner(algo)
    assert all(group["fused"] for group in fused.optimizer.param_groups)
    optim = looped.optim_config
    looped.optimizer = torch.optim.AdamW(looped.model.parameters(), lr=optim.lr, betas=optim.betas,  # a loop
                                         eps=optim.eps, weight_decay=optim.weight_decay)
    for _ in range(3):
        fused.step(batch)
        looped.step(batch)
    for a, b in zip(fused.model.parameters(), looped.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    resumed = _learner(algo)
    resumed.load_state_dict(looped.state_dict())
    assert all(group["fused"] and not group["foreach"] for group in resumed.optimizer.param_groups)
    resumed.step(batch)
    looped.step(batch)
    for a, b in zip(resumed.model.parameters(), looped.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "autocast"), [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.float32, torch.bfloat16)])
def test_cuda_learner_takes_vcpo_and_grpo_steps(dtype: torch.dtype, autocast: torch.dtype | None) -> None:
    """GPU smoke test: the same steps on CUDA (fp32 weights, bf16 weights, fp32 weights under bf16
    autocast) give finite metrics and move the weights."""
    tokens = random_trajectories(num_groups=2, per_group=4, seed=5)
    trajectories, groups = _as_trajectories(tokens, seed=6)
    for objective in ("vcpo", "grpo"):
        algo = AlgoConfig.model_validate({"objective": {"type": objective}, "group_size": 4})
        model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa()).to("cuda", dtype).train()
        learner = TorchLearner(model, algo, OptimConfig(lr=1e-3), micro_batch_tokens=64,
                               autocast_dtype=autocast)
        before = [p.detach().clone() for p in model.parameters()]
        metrics = learner.step(StepInput(trajectories, groups, [1] * len(tokens), [True] * len(tokens)))
        assert math.isfinite(metrics["grad/norm"]) and metrics["grad/norm"] > 0
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def _reuse_pair(form: str = "spec", micro_batch_tokens: int = 64
                ) -> tuple[StepInput, TorchLearner, TorchLearner]:
    """A minibatch sampled near the policy (behaviour log-probs = the model's + noise, so IS weights
    are O(1) and the gradient is not ~0), rewards mixed within every group, lags 1; two learners."""
    tokens = random_trajectories(num_groups=3, per_group=4, seed=4)
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo", "opob": {"form": form}}, "group_size": 4})
    separate = _learner(algo, micro_batch_tokens=micro_batch_tokens)
    reuse = _learner(algo, micro_batch_tokens=micro_batch_tokens)
    reuse.proximal = "reuse"
    with torch.no_grad():
        own = _padded_logprobs(separate.model, tokens)
    generator = torch.Generator().manual_seed(6)
    trajectories, groups = [], []
    for i, t in enumerate(tokens):
        sampled = iter((own[i] + 0.05 * torch.randn(own.shape[1], generator=generator)).tolist())
        logprobs = tuple(min(next(sampled), -1e-3) if m else 0.0 for m in t.loss_mask)
        trajectories.append(Trajectory(
            trajectory_id=f"t{i}", group_id=str(t.group_id), token_ids=tuple(t.token_ids),
            loss_mask=tuple(t.loss_mask), behavior_logprobs=logprobs,
            versions=TrajectoryVersions(start=0, end=0),
            reward=float(i % 2)))
        groups.append(t.group_id)
    return StepInput(trajectories, groups, [1] * len(tokens), [True] * len(tokens)), separate, reuse


@pytest.mark.parametrize("form", ["spec", "reference"])
def test_reusing_the_fp32_gradient_forward_for_pi_old_changes_no_number_of_the_step(form: str) -> None:
    """proximal='reuse' (what 'auto' picks without autocast): log π_old comes from the gradient pass's
    own forward instead of a separate no-grad one. In fp32 that forward gives the same log-probs, so the
    IS statistics, the step size, the norms and the gradient are those of the separate pass — with
    groups spanning micro-batches, so coefficients are set micro-batch by micro-batch."""
    step, separate, reuse = _reuse_pair(form)
    assert not separate.reuses_gradient_forward and reuse.reuses_gradient_forward
    separate_grads, reuse_grads = capture_grads(separate), capture_grads(reuse)
    separate_metrics, reuse_metrics = separate.step(step), reuse.step(step)
    assert separate_metrics["train/micro_batches"] > 3
    assert 0.3 < separate_metrics["is/ess_ratio"] < 1.0  # weights of order 1, not all equal
    assert max(float(g.abs().max()) for g in separate_grads.values()) > 1e-3  # a real gradient
    for key in ("is/ess_ratio", "is/w_max", "is/log_w_mean", "lr/scale", "opob/baseline_mean"):
        assert reuse_metrics[key] == pytest.approx(separate_metrics[key], rel=1e-5, abs=1e-7), key
    assert reuse_metrics["time/learner_proximal"] < separate_metrics["time/learner_proximal"]
    for name, grad in separate_grads.items():
        torch.testing.assert_close(reuse_grads[name], grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max()))


def test_auto_reuses_the_gradient_forward_only_where_it_is_in_the_weights_dtype() -> None:
    _, learner, _ = _reuse_pair()
    learner.proximal = "auto"
    assert learner.reuses_gradient_forward  # fp32: the same log-probs as a separate forward
    learner.autocast_dtype = torch.bfloat16
    assert not learner.reuses_gradient_forward  # bf16 forward: keep the exact fp32 proximal pass
    learner.proximal = "reuse"
    assert learner.reuses_gradient_forward  # asked for: bf16 log π_old (the authors' choice)


def test_reuse_under_autocast_gives_bf16_importance_weights_and_a_close_step() -> None:
    step, separate, reuse = _reuse_pair()
    separate.autocast_dtype = reuse.autocast_dtype = torch.bfloat16
    separate_grads, reuse_grads = capture_grads(separate), capture_grads(reuse)
    separate_metrics, reuse_metrics = separate.step(step), reuse.step(step)
    assert reuse_metrics["is/log_w_mean"] != separate_metrics["is/log_w_mean"]  # bf16 log-probs
    assert reuse_metrics["is/log_w_mean"] == pytest.approx(separate_metrics["is/log_w_mean"], abs=0.05)
    errors = {name: float((reuse_grads[name] - grad).norm() / grad.norm())
              for name, grad in separate_grads.items() if grad.norm() > 0}
    assert max(errors.values()) < 0.1, errors


@pytest.mark.parametrize(("objective", "kl_coef", "micro_batch_tokens"),
                         [("vcpo", 0.0, 4096), ("vcpo", 0.3, 96), ("grpo", 0.0, 4096), ("otb", 0.0, 4096)])
def test_sharing_a_groups_prompt_changes_no_number_of_the_step(objective: str, kl_coef: float,
                                                               micro_batch_tokens: int) -> None:
    """learner.share_prompts: the proximal (and reference / OTB) forward, and the gradient forward of
    objectives without per-trajectory norms, compute each group's prompt once — the same IS statistics,
    step size and gradient as forwarding every trajectory's whole prompt."""
    tokens = shared_prompt_trajectories(num_groups=2, per_group=4, seed=4)
    trajectories, groups = _as_trajectories(tokens, seed=5)
    algo = AlgoConfig.model_validate({"objective": {"type": objective}, "group_size": 4, "kl_coef": kl_coef})
    step = StepInput(trajectories, groups, [1] * len(tokens), [True] * len(tokens))
    full, shared = (_learner(algo, micro_batch_tokens=micro_batch_tokens) for _ in range(2))
    shared.share_prompts = True
    _perturb_reference(full)
    _perturb_reference(shared)
    full_grads, shared_grads = capture_grads(full), capture_grads(shared)
    full_metrics, shared_metrics = full.step(step), shared.step(step)
    assert 0.05 < full_metrics["is/ess_ratio"] < 1.0
    assert full_metrics["train/prompt_tokens_shared"] == 0
    assert shared_metrics["train/prompt_tokens_shared"] >= 16 * (2 if micro_batch_tokens > 1000 else 1)
    for key in ("is/ess_ratio", "is/w_max", "is/log_w_mean", "lr/scale"):
        assert shared_metrics[key] == pytest.approx(full_metrics[key], rel=1e-5, abs=1e-6), key
    for name, grad in full_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()))


def test_shared_prompts_keep_on_policy_ratios_exact() -> None:
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa(), seed=0).train()
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo"}, "group_size": 4})
    learner = TorchLearner(model, algo, OptimConfig(lr=1e-3), micro_batch_tokens=4096, share_prompts=True)
    prompt = list(range(3, 23))  # 20 tokens: shared
    mask = [False] * 20 + [True] * 3
    group = _on_policy_group(model, [*prompt, 30, 31, 32], [*prompt, 40, 41, 42], mask)
    metrics = learner.step(StepInput(group, [0] * 4, [0] * 4, [True] * 4))
    assert metrics["is/ess_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["is/log_w_mean"] == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("objective", ["grpo", "seq_tis", "m2po", "rloo"])
def test_a_degenerate_group_leaves_the_gradient_pass_under_every_advantage_objective(
    objective: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As VCPO's: under an objective whose loss is linear in a group-relative advantage, a group that scored
    alike (exactly 0 advantage) is left out of the gradient pass, and the step is the one that forwards and
    back-propagates it."""
    step = _with_rewards(_noisy_step(), [1.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.0, 1.0, 1.0])
    algo = AlgoConfig.model_validate({"objective": {"type": objective}, "group_size": 3})
    skipping = _learner(algo, micro_batch_tokens=8)
    grads, metrics = capture_grads(skipping), skipping.step(step)
    assert metrics["train/skipped_groups"] == 1 and metrics["train/degenerate_groups"] == 1
    with monkeypatch.context() as patch:
        patch.setattr(TorchLearner, "_silent_trajectories", lambda self, *args: None)
        forwarding = _learner(algo, micro_batch_tokens=8)
        all_grads, all_metrics = capture_grads(forwarding), forwarding.step(step)
    assert all_metrics["train/skipped_groups"] == 0
    _assert_same_step(grads, metrics, all_grads, all_metrics)


@pytest.mark.parametrize(("objective", "params"),
                         [("grpo", {"kl_coef": 0.1}), ("reinforce", {}), ("tba", {})])
def test_a_degenerate_group_stays_in_the_gradient_pass_where_its_gradient_is_not_zero(
    objective: str, params: dict[str, Any]) -> None:
    """A KL term, REINFORCE's minibatch baseline or TBA's balance give an alike group a gradient: kept."""
    step = _with_rewards(_noisy_step(), [1.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.0, 1.0, 1.0])
    algo = AlgoConfig.model_validate({"objective": {"type": objective}, "group_size": 3, **params})
    learner = _learner(algo, micro_batch_tokens=8)
    if params.get("kl_coef"):
        _perturb_reference(learner)
    assert learner.step(step)["train/skipped_groups"] == 0


def test_a_group_alike_only_among_its_trained_members_keeps_its_gradient() -> None:
    """A member without trained tokens still counts in its group's statistics: group 1 scores 1, 0, 0 with
    the 1 untrained, so its trained members have advantage −1/3 (not a degenerate group) — kept."""
    step = _with_rewards(_noisy_step(), [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    step = dataclasses.replace(step, is_trained=[True, True, True, False, True, True, True, True, True])
    algo = AlgoConfig.model_validate({"objective": {"type": "grpo"}, "group_size": 3})
    assert _learner(algo, micro_batch_tokens=8).step(step)["train/skipped_groups"] == 0


@pytest.mark.parametrize("form", ["spec", "reference"])
def test_vcpo_counts_an_untrained_member_in_its_groups_statistics(form: str) -> None:
    """As the objective and the authors' group advantages do, σ_g and degeneracy count an untrained member:
    group 0 scores 1, 0, 0 with the 1 untrained (its trained members alike, yet not a degenerate group: the
    spec form gives them a gradient), group 1 scores 1, 0, 1 with a 1 untrained (σ_g over three, not two:
    both forms). The learner's step equals autograd of the objective with those members' masks empty."""
    tokens = random_trajectories(num_groups=3, per_group=3, seed=1)
    trajectories, groups = _as_trajectories(tokens)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    trajectories = [t.model_copy(update={"reward": r}) for t, r in zip(trajectories, rewards, strict=True)]
    trained = [i not in (0, 3) for i in range(len(tokens))]
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo", "is_cap": 2.0, "opob": {"form": form}},
                                      "group_size": 3})
    learner = _learner(algo)
    grads = capture_grads(learner)
    metrics = learner.step(StepInput(trajectories, groups, [0] * len(tokens), trained))
    assert metrics["train/skipped_groups"] == 0
    want, _ = _objective_grads(learner, tokens, trajectories, groups, trained)
    for name, grad in want.items():  # relative to each gradient's size: the spec form's are ~1e-7
        tolerance = 1e-4 * float(grad.abs().max())
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=tolerance, msg=name)
