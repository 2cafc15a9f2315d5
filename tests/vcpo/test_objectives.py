"""Each objective on a small hand-computed case, plus gradient checks."""

import dataclasses
import math

import pytest
import torch

from tests.vcpo.helpers import leaf, simple_inputs, tensor
from vcpo import metrics as m
from vcpo.groups import single_group
from vcpo.objectives import PolicyLossInputs
from vcpo.opob import opob_baseline_weights, weighted_mean_baseline
from vcpo.registry import make_objective

MASK = torch.tensor([[True, True], [True, False]])
A = 0.5 / (math.sqrt(0.5) + 1e-6)  # GRPO advantage of rewards [1, 0]: (1 − 0.5)/(σ + ε), σ = 0.707107


def _grad(output, logprobs):
    (grad,) = torch.autograd.grad(output.loss, logprobs)
    return grad


def test_grpo_token_mean_with_one_clipped_token():
    logprobs = leaf([[-1.0, -1.0 + math.log(1.5)], [-1.0, -1.0]])
    inputs = simple_inputs(
        logprobs, [1.0, 0.0], [0, 0], old_logprobs=torch.full((2, 2), -1.0), loss_mask=MASK
    )
    out = make_objective("grpo")(inputs)
    # A = ±0.707106; r = [1, 1.5 → clipped to 1.28] for A > 0, r = 1 for A < 0
    # token-mean: (−0.707106 − 0.707106·1.28 + 0.707106) / 3 = −0.301702
    torch.testing.assert_close(out.loss, tensor(-A * 1.28 / 3))
    # gradient −A r / 3 on unclipped tokens, 0 on the clipped one and off the mask
    torch.testing.assert_close(_grad(out, logprobs), tensor([[-A / 3, 0.0], [A / 3, 0.0]]))
    assert out.counts.clipped_tokens.item() == 1
    torch.testing.assert_close(out.metrics[m.PG_CLIP_FRAC], tensor(1 / 3))
    torch.testing.assert_close(out.advantages, tensor([[A, A], [-A, 0.0]]))


def test_dr_grpo_centres_only_and_divides_token_sums_by_a_constant():
    logprobs = leaf([[-1.0, -1.0 + math.log(1.5)], [-1.0, -1.0]])
    inputs = simple_inputs(
        logprobs, [1.0, 0.0], [0, 0], old_logprobs=torch.full((2, 2), -1.0), loss_mask=MASK
    )
    out = make_objective("dr_grpo")(inputs)
    # A = ±0.5; sums: traj 0 −0.5 − 0.5·1.28 = −1.14, traj 1 +0.5 → (−1.14 + 0.5)/2 sequences / N = 2 → −0.16
    torch.testing.assert_close(out.loss, tensor(-0.16))


def test_rloo_and_reinforce_weight_mean_log_likelihoods():
    logprobs = leaf([[-1.0, -2.0], [-3.0, -9.0]])
    inputs = simple_inputs(logprobs, [1.0, 0.0], [0, 0], loss_mask=MASK)
    # ℓ = [mean(−1, −2), −3] = [−1.5, −3]; RLOO A = [1, −1]: −(1/2)(1·(−1.5) − 1·(−3)) = −0.75
    rloo = make_objective("rloo")(inputs)
    torch.testing.assert_close(rloo.loss, tensor(-0.75))
    # gradient −A/(B|M_i|): [−1/4, −1/4], [+1/2, 0]
    torch.testing.assert_close(_grad(rloo, logprobs), tensor([[-0.25, -0.25], [0.5, 0.0]]))
    # REINFORCE batch mean 0.5 → A = ±0.5: −(1/2)(0.5·(−1.5) − 0.5·(−3)) = −0.375
    torch.testing.assert_close(make_objective("reinforce")(inputs).loss, tensor(-0.375))


def test_token_tis_multiplies_by_the_truncated_old_to_behavior_ratio():
    logprobs = leaf([[-1.0], [-1.0]])
    behavior = torch.log(tensor([[1 / 4], [2.0]])) - 1.0  # π_old/μ = [4 → capped 2, 0.5]
    inputs = simple_inputs(logprobs, [1.0, 0.0], [0, 0], behavior_logprobs=behavior)
    out = make_objective("token_tis", token_is_cap=2.0)(inputs)
    # token-mean of −A·r·ρ: (−0.707106·2 + 0.707106·0.5)/2 = −0.530330
    torch.testing.assert_close(out.loss, tensor((-A * 2 + A * 0.5) / 2))


def test_mis_drops_tokens_outside_the_range():
    logprobs = leaf([[-1.0], [-1.0]])
    behavior = torch.log(tensor([[1 / 4], [2.0]])) - 1.0  # π_old/μ = [4 dropped, 0.5 kept]
    out = make_objective("mis", is_cap=2.0)(
        simple_inputs(logprobs, [1.0, 0.0], [0, 0], behavior_logprobs=behavior)
    )
    # (0 + 0.707106·0.5)/2 = 0.176777; one of two tokens masked
    torch.testing.assert_close(out.loss, tensor(A * 0.5 / 2))
    torch.testing.assert_close(out.metrics[m.PG_MASKED_FRAC], tensor(0.5))
    assert _grad(out, logprobs)[0, 0].item() == 0.0
    # sequence level with C = 8: L = [log 4, −log 2] both inside [1/8, 8] → weights 4 and 0.5
    seq = make_objective("mis", is_cap=8.0, level="sequence")(
        simple_inputs(leaf([[-1.0], [-1.0]]), [1.0, 0.0], [0, 0], behavior_logprobs=behavior)
    )
    # (−0.707106·4 + 0.707106·0.5)/2 = −1.237437
    torch.testing.assert_close(seq.loss, tensor((-A * 4 + A * 0.5) / 2))


def test_seq_tis_weights_each_trajectory_by_truncated_w():
    logprobs = leaf([[-1.0, -1.0], [-1.0, -1.0]])
    behavior = tensor([[-1.0 - math.log(16.0), -1.0], [-1.0 + math.log(2.0), -1.0]])  # w = [16 → 8, 0.5]
    out = make_objective("seq_tis")(simple_inputs(logprobs, [1.0, 0.0], [0, 0], behavior_logprobs=behavior))
    # −(1/2)(8·0.707106·(−1) + 0.5·(−0.707106)·(−1)) = −(1/2)(−5.656854 + 0.353553) = 2.651650
    torch.testing.assert_close(out.loss, tensor(-(8 * A * -1 + 0.5 * -A * -1) / 2))


def test_vcpo_hand_computed():
    logprobs = leaf([[-1.0, -2.0], [-3.0, -9.0]])
    behavior = logprobs.detach() - tensor([[math.log(2.0), 0.0], [0.0, 0.0]])  # w = [2, 1]
    inputs = simple_inputs(
        logprobs,
        [1.0, 0.0],
        [0, 0],
        behavior_logprobs=behavior,
        loss_mask=MASK,
        seq_sq_grad_norms=tensor([1.0, 1.0]),
    )
    out = make_objective("vcpo")(inputs)
    # ω = w²‖∇ℓ‖² = [4, 1] → b* = 4/5 = 0.8; σ = 0.707107 → A = [0.2, −0.8]/σ = [0.282843, −1.131371]
    # c = w̄A = [0.565685, −1.131371]; ℓ = [−1.5, −3] → loss = −(1/2)(−0.848528 + 3.394113) = −1.272792
    sigma = math.sqrt(0.5) + 1e-6
    torch.testing.assert_close(out.advantages[:, 0], tensor([0.2 / sigma, -0.8 / sigma]))
    torch.testing.assert_close(out.loss, tensor(-(2 * 0.2 / sigma * -1.5 + -0.8 / sigma * -3) / 2))
    torch.testing.assert_close(out.metrics[m.OPOB_BASELINE_MEAN], tensor(0.8))
    torch.testing.assert_close(out.metrics[m.OPOB_GAP_TO_GROUP_MEAN], tensor(0.3))


def _linear_policy_case(seed: int = 0):
    """log π_{i,t} = x_{i,t}·θ: ∇ℓ_i = mean_{t∈M_i} x_{i,t} is known in closed form."""
    generator = torch.Generator().manual_seed(seed)
    batch, length, dim = 6, 4, 5
    features = torch.randn(batch, length, dim, generator=generator, dtype=torch.float64)
    theta = torch.randn(dim, generator=generator, dtype=torch.float64).requires_grad_(True)
    mask = torch.rand(batch, length, generator=generator) > 0.3
    mask[:, 0] = True
    logprobs = features @ theta
    behavior = logprobs.detach() - 0.7 * torch.randn(batch, length, generator=generator, dtype=torch.float64)
    lengths = mask.sum(dim=1, keepdim=True).double()
    seq_grads = (features * mask[..., None]).sum(dim=1) / lengths  # ∇ℓ_i, unweighted
    rewards = tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    inputs = PolicyLossInputs(
        logprobs,
        logprobs.detach(),
        behavior,
        mask,
        rewards,
        torch.tensor([0, 0, 0, 1, 1, 1]),
        seq_sq_grad_norms=(seq_grads * seq_grads).sum(dim=1),
    )
    return inputs, theta, seq_grads


def test_vcpo_gradient_carries_the_is_factor_once():
    inputs, theta, seq_grads = _linear_policy_case()
    out = make_objective("vcpo")(inputs)
    (grad,) = torch.autograd.grad(out.loss, theta)
    log_w = ((inputs.old_logprobs - inputs.behavior_logprobs) * inputs.loss_mask).sum(dim=1)
    w = log_w.exp()
    w_bar = w.clamp(max=8.0)
    rewards = inputs.rewards.double()
    b_star = torch.zeros(6, dtype=torch.float64)
    for group in (slice(0, 3), slice(3, 6)):  # b* = Σ w² ‖∇ℓ‖² R / Σ w² ‖∇ℓ‖², unweighted norms
        omega = w[group] ** 2 * (seq_grads[group] ** 2).sum(dim=1)
        b_star[group] = (omega * rewards[group]).sum() / omega.sum()
    sigma = torch.tensor([rewards[:3].std().item()] * 3 + [rewards[3:].std().item()] * 3, dtype=torch.float64)
    advantages = (rewards - b_star) / (sigma + 1e-6)
    # ĝ = (1/B) Σ w̄ A ∇ℓ  (w̄ once); the loss is −objective, so its gradient is −ĝ
    expected = -((w_bar * advantages)[:, None] * seq_grads).sum(dim=0) / 6
    torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-6)
    # the trap (norms of w̄∇ℓ with w² again) gives another baseline, hence another gradient
    trap_norms = (w_bar**2) * inputs.seq_sq_grad_norms
    trap = make_objective("vcpo")(dataclasses.replace(inputs, seq_sq_grad_norms=trap_norms))
    assert (trap.advantages - out.advantages).abs().max().item() > 1e-3


def test_opob_only_and_ess_lr_only_differ_by_exactly_one_factor():
    # with the IS weights off in b* and equal norms, b* is the group mean: vcpo ≡ seq_tis
    inputs, theta, _ = _linear_policy_case(seed=3)
    equal_norms = dataclasses.replace(inputs, seq_sq_grad_norms=torch.ones(6, dtype=torch.float64))
    vcpo = make_objective("vcpo", use_is_weights=False)(equal_norms)
    seq_tis = make_objective("seq_tis")(equal_norms)
    torch.testing.assert_close(vcpo.loss, seq_tis.loss)
    (vcpo_grad,) = torch.autograd.grad(vcpo.loss, theta, retain_graph=True)  # both losses share log π's graph
    torch.testing.assert_close(vcpo_grad, torch.autograd.grad(seq_tis.loss, theta)[0])


def test_vcpo_baseline_matches_the_opob_module():
    inputs, _, _ = _linear_policy_case(seed=1)
    out = make_objective("vcpo", scope="minibatch", divide_by_std=False)(inputs)
    w = ((inputs.old_logprobs - inputs.behavior_logprobs) * inputs.loss_mask).sum(dim=1).exp()
    baseline = weighted_mean_baseline(
        inputs.rewards,
        opob_baseline_weights(inputs.seq_sq_grad_norms, w),
        torch.ones(6, dtype=torch.bool),
        single_group(6),
    ).per_group
    # minibatch scope, no std: A_i = R_i − b* with one b* for all six trajectories
    torch.testing.assert_close(out.advantages[:, 0], (inputs.rewards.double() - baseline).float())


def test_minibatch_scope_without_std_keeps_signal_of_all_equal_groups():
    logprobs = leaf([[-1.0], [-1.0], [-1.0], [-1.0]])
    inputs = simple_inputs(logprobs, [1.0, 1.0, 1.0, 0.0], [0, 0, 1, 1], seq_sq_grad_norms=torch.ones(4))
    out = make_objective("vcpo", scope="minibatch", divide_by_std=False)(inputs)
    # one b* for the minibatch: w = 1, ω = 1 → b* = 3/4; group 0 is all-equal yet R − b* = 0.25 is a signal
    torch.testing.assert_close(out.advantages[:, 0], tensor([0.25, 0.25, 0.25, -0.75]))
    # dividing by σ_g (0 for group 0) instead zeroes group 0 exactly
    assert make_objective("vcpo", scope="minibatch")(inputs).advantages[:2].abs().sum().item() == 0.0


def test_otb_uses_token_baselines_from_forward_probabilities():
    mask = torch.tensor([[True, True], [True, True]])
    old = torch.log(tensor([[0.5, 0.5], [0.9, 0.25]]))
    logprobs = old.clone().requires_grad_(True)
    inputs = simple_inputs(
        logprobs,
        [1.0, 0.0],
        [0, 0],
        old_logprobs=old,
        behavior_logprobs=old,
        loss_mask=mask,
        sum_probs_squared=tensor([[0.5, 0.5], [0.82, 0.25]]),
    )
    out = make_objective("otb", use_is_weights=False)(inputs)
    # as in test_otb: A = [[0.038462, 0.435028], [−0.961538, −0.564972]]
    expected = tensor([[0.038462, 0.435028], [-0.961538, -0.564972]])
    torch.testing.assert_close(out.advantages, expected, rtol=1e-4, atol=1e-5)
    # seq-mean-token-mean: gradient −A/(B|M_i|) = −A/4
    torch.testing.assert_close(_grad(out, logprobs), -expected / 4, rtol=1e-4, atol=1e-5)


def test_m2po_masks_outlier_tokens_and_bapo_reports_its_bounds():
    logprobs = leaf([[-1.0, -1.0], [-1.0, -1.0]])
    behavior = tensor([[-1.1, -1.0], [-1.0, -3.0]])  # log r = [0.1, 0, 0, 2]: (log r)² = [0.01, 0, 0, 4]
    inputs = simple_inputs(logprobs, [1.0, 0.0], [0, 0], behavior_logprobs=behavior)
    out = make_objective("m2po")(inputs)
    # prefix means 0, 0, 0.0033, 1.0025 → keep 3, mask the log r = 2 token
    torch.testing.assert_close(out.metrics[m.PG_MASKED_FRAC], tensor(0.25))
    assert _grad(out, logprobs)[1, 1].item() == 0.0
    bapo = make_objective("bapo")(inputs)
    assert 0.6 <= bapo.metrics["bapo/clip_low"].item() <= 0.9
    assert 1.2 <= bapo.metrics["bapo/clip_high"].item() <= 3.0
    # the A < 0 token with r = e² = 7.39 is not clipped (no upper bound for negative advantages)
    assert _grad(bapo, logprobs)[1, 1].item() > 0


def test_tba_hand_computed():
    logprobs = leaf([[-1.0, 0.0], [-2.0, 0.0]])
    mask = torch.tensor([[True, False], [True, False]])
    inputs = simple_inputs(
        logprobs, [1.0, 0.0], [0, 0], loss_mask=mask, ref_logprobs=tensor([[-1.5, 0.0], [-1.5, 0.0]])
    )
    out = make_objective("tba", beta=0.5)(inputs)
    # as in test_policy_losses: residuals [−0.5, 0.5] → loss (0.25 + 0.25)/2 = 0.25
    torch.testing.assert_close(out.loss, tensor(0.25))


def test_kl_and_entropy_terms_are_added_with_their_coefficients():
    logprobs = leaf([[-1.0], [-1.0]])
    base = simple_inputs(logprobs, [1.0, 1.0], [0, 0])  # degenerate group: policy loss exactly 0
    with_terms = simple_inputs(
        logprobs, [1.0, 1.0], [0, 0], ref_logprobs=tensor([[-1.5], [-1.5]]), entropy=torch.ones(2, 1)
    )
    assert make_objective("grpo")(base).loss.item() == 0.0
    out = make_objective("grpo", kl_coef=0.1, kl_estimator="k1", entropy_coef=0.2)(with_terms)
    # + 0.1 · mean(k1 = −1 + 1.5 = 0.5) − 0.2 · mean(entropy 1) = 0.05 − 0.2 = −0.15
    torch.testing.assert_close(out.loss, tensor(-0.15))
    torch.testing.assert_close(out.metrics["loss/kl"], tensor(0.5))


@pytest.mark.parametrize("name", ["grpo", "seq_tis", "vcpo"])
def test_is_and_staleness_metrics_are_reported(name):
    logprobs = leaf([[-1.0], [-1.0]])
    inputs = simple_inputs(
        logprobs,
        [1.0, 0.0],
        [0, 0],
        behavior_logprobs=tensor([[-1.0], [-1.0 - math.log(3.0)]]),
        lags=torch.tensor([0, 3]),
        seq_sq_grad_norms=tensor([1.0, 1.0]),
    )
    out = make_objective(name)(inputs)
    # w = [1, 3]: ESS = 16/10 = 1.6 → ρ = 0.8; lags mean 1.5, max 3
    torch.testing.assert_close(out.metrics[m.IS_ESS_RATIO], tensor(0.8))
    assert out.metrics[m.STALENESS_MEAN].item() == 1.5 and out.metrics[m.STALENESS_MAX].item() == 3.0
    torch.testing.assert_close(out.log_is_weights, tensor([0.0, math.log(3.0)]))
