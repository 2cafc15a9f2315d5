"""The reference OPOB form at the authors' two numerical edges, against a transcription of their code.

`authors_advantages` below restates, in plain Python floats, what mit-han-lab/vcpo computes for one
prompt group: σ_g from `compute_grad_info` (torch.std of the group's rewards as a float32 tensor,
unbiased=False), the sequence weight from `compute_is_info` (fp32 exp of the fp32 log-ratio sum,
unclamped), the per-trajectory norm of `_compute_grad_norms` (carrying the loss weight w̄ =
min(e^{clamp(L, ±20)}, C) of their `rollout_corr_helper.compute_rollout_correction_weights`), b from
`compute_opob_baseline` + `get_weighted_mean`, and the divisor rule of `_update_grad_buffers`.
"""

import math

import pytest
import torch

from tests.vcpo.helpers import leaf, simple_inputs, tensor
from vcpo.groups import group_std, index_groups, single_group
from vcpo.opob import reference_baseline_weights, reference_group_std, reference_mean_baseline
from vcpo.registry import make_objective

CAP = 8.0


def authors_loss_weight(log_ratio: float) -> float:
    """Their per-trajectory loss weight before the cap: `rollout_is="sequence"` takes exp of the fp32
    log-ratio sum clamped to ±SAFETY_BOUND (20), so a very stale trajectory still weighs e^-20."""
    clamped = torch.clamp(torch.tensor(log_ratio, dtype=torch.float32), min=-20.0, max=20.0)
    return float(torch.exp(clamped).item())


def authors_advantages(rewards: list[float], log_ratios: list[float], sq_norms: list[float]) -> list[float]:
    """(R_i − b) / d_i for one group of one-token trajectories (c_i = 1), as the authors' code does."""
    reward_std = float(torch.std(torch.tensor(rewards, dtype=torch.float32), unbiased=False).item())
    weights = []
    for log_ratio, sq in zip(log_ratios, sq_norms, strict=True):
        seq_is = float(torch.exp(torch.tensor(log_ratio, dtype=torch.float32)).item())
        loss_weight = min(authors_loss_weight(log_ratio), CAP)
        grad_norm_unscaled = loss_weight * math.sqrt(sq)
        weights.append(grad_norm_unscaled**2 * seq_is**2)
    baseline = sum(w * r for w, r in zip(weights, rewards, strict=True)) / (sum(weights) + 1e-8)
    divisor = reward_std if reward_std > 1e-8 else 1.0
    return [(r - baseline) / divisor for r in rewards]


def reference_advantages(rewards: list[float], log_ratios: list[float], sq_norms: list[float]) -> list[float]:
    """vcpo's reference form on the same group: behaviour log-probs chosen so that L_i = log_ratios[i]."""
    count = len(rewards)
    logprobs = leaf([[-1.0]] * count)
    behavior = torch.tensor([[-1.0 - lr] for lr in log_ratios], dtype=torch.float32)
    inputs = simple_inputs(logprobs, rewards, [0] * count, behavior_logprobs=behavior,
                           seq_sq_grad_norms=tensor(sq_norms))
    objective = make_objective("vcpo", form="reference", is_cap=CAP, max_log_ratio=20.0)
    return objective(inputs).advantages[:, 0].double().tolist()


@pytest.mark.parametrize("value", [0.1, 0.3, 1.0 / 3.0, 0.7])
def test_sixteen_equal_rewards_get_the_authors_divisor(value: float) -> None:
    rewards = [value] * 16
    generator = torch.Generator().manual_seed(int(value * 1000))
    log_ratios = (0.3 * torch.randn(16, generator=generator)).tolist()
    sq_norms = (0.5 + torch.rand(16, generator=generator)).tolist()
    # the residual R − b is ~1e-9; divided by ~1e-8 (σ rounding noise above the floor) it is O(0.1),
    # divided by 1 it stays ~1e-9: whichever the authors pick, vcpo picks the same
    assert reference_advantages(rewards, log_ratios, sq_norms) == pytest.approx(
        authors_advantages(rewards, log_ratios, sq_norms), rel=1e-5, abs=1e-12)


def test_group_std_is_the_authors_call_per_group_not_a_two_pass_reduction() -> None:
    rewards = torch.tensor([0.1] * 16 + [0.3] * 16 + [0.7] * 16 + [1.0, 0.0] * 8, dtype=torch.float32)
    groups = index_groups(torch.arange(64) // 16)
    valid = torch.ones(64, dtype=torch.bool)
    ours = reference_group_std(rewards, valid, groups)
    for g in range(4):
        members = rewards[16 * g:16 * (g + 1)].tolist()  # as the authors: Python floats → float32 tensor
        assert float(ours[g]) == float(torch.std(torch.tensor(members, dtype=torch.float32), unbiased=False))
    assert float(ours[3]) == 0.5
    # the two-pass population σ rounds otherwise on at least one of these groups: that is what moved
    # the reference form's divisor (1 vs ~1e-8) before σ was taken the authors' way
    two_pass = group_std(rewards, valid, groups, use_bessel_correction=False)
    assert not torch.equal(two_pass[:3].double(), ours[:3])
    # invalid members are left out; an empty group is 0
    valid[16:32] = False
    assert float(reference_group_std(rewards, valid, groups)[1]) == 0.0


def test_log_ratios_beyond_twenty_enter_omega_unclamped() -> None:
    # L = (25, 22), R = (1, 0), equal norms: ω ∝ w̄²w² = 64·e^50 vs 64·e^44 → b = e^6/(e^6 + 1) = 0.99753
    omega = reference_baseline_weights(tensor([1.0, 1.0]), tensor([25.0, 22.0]), CAP, tensor([1.0, 1.0]),
                                       single_group(2))
    b = reference_mean_baseline(tensor([1.0, 0.0]), omega, torch.ones(2, dtype=torch.bool), single_group(2))
    assert float(b.per_group[0]) == pytest.approx(math.exp(6) / (math.exp(6) + 1), rel=1e-6)
    assert float(b.per_group[0]) == pytest.approx(0.9975274, rel=1e-6)
    # the authors' own value on the same group (finite: fp32 e^25 squared is a fine fp64)
    advantages = reference_advantages([1.0, 0.0], [25.0, 22.0], [1.0, 1.0])
    assert advantages == pytest.approx(authors_advantages([1.0, 0.0], [25.0, 22.0], [1.0, 1.0]), rel=1e-6)
    # σ = 0.5: A = ((1 − b)/0.5, (0 − b)/0.5)
    assert advantages == pytest.approx([2 * (1 - 0.9975274), -2 * 0.9975274], rel=1e-5)
    # the loss weight w̄ is the authors' min(e^{clamp(L, ±20)}, C): e^-20 at L = -25 (their rollout_is_weights)
    weights, truncated = make_objective("vcpo", form="reference").sequence_weights(tensor([-25.0, 30.0]))
    assert float(truncated[0]) == pytest.approx(math.exp(-20), rel=1e-6) and float(truncated[1]) == CAP
    assert float(truncated[0]) == pytest.approx(min(authors_loss_weight(-25.0), CAP), rel=1e-7)
    # ... while ω's w stays their unclamped fp32 exp(L)
    assert float(weights[0]) == pytest.approx(math.exp(-25), rel=1e-6)
    assert float(weights[1]) == pytest.approx(math.exp(30), rel=1e-6)
    assert float(make_objective("vcpo").sequence_weights(tensor([-25.0]))[1][0]) == pytest.approx(
        math.exp(-20), rel=1e-6)  # the spec form keeps its clamp


def test_below_minus_twenty_the_loss_weight_in_omega_is_the_authors_clamped_one() -> None:
    # L = (-25, 0), equal norms: the authors' ω_0 = w̄_0² w_0² = (e^-20)² (e^-25)² = e^-90, ω_1 = 1
    omega = reference_baseline_weights(tensor([1.0, 1.0]), tensor([-25.0, 0.0]), CAP, tensor([1.0, 1.0]),
                                       single_group(2))
    assert float(omega[0]) == pytest.approx(math.exp(-90), rel=1e-5) and float(omega[1]) == 1.0
    assert float(omega[0]) == pytest.approx(
        (min(authors_loss_weight(-25.0), CAP) * math.exp(-25)) ** 2, rel=1e-5)


def test_beyond_fp32_overflow_the_authors_are_nan_and_vcpo_is_their_limit() -> None:
    rewards, norms = [1.0, 0.0, 0.5], [1.0, 4.0, 1.0]
    authors = authors_advantages(rewards, [100.0, 95.0, 0.0], norms)
    assert all(math.isnan(a) for a in authors)  # e^100 = inf in fp32: b = inf/inf
    ours = reference_advantages(rewards, [100.0, 95.0, 0.0], norms)
    # log space, divided by the largest: ω = [1, 4·e^-10, e^-200] → b = (1 + 0.5·e^-200) / (1 + 4·e^-10
    # + e^-200 + 1e-8), the authors' 1e-8 now relative to the largest weight
    b = 1.0 / (1.0 + 4.0 * math.exp(-10) + 1e-8)
    sigma = float(torch.std(torch.tensor(rewards, dtype=torch.float32), unbiased=False))
    assert ours == pytest.approx([(r - b) / sigma for r in rewards], rel=1e-6)
    # the rescaling is per group: a second, finite group keeps the authors' values exactly
    omega = reference_baseline_weights(tensor([1.0, 4.0, 1.0, 1.0]), tensor([100.0, 95.0, 1.0, 2.0]), CAP,
                                       tensor([1.0] * 4), index_groups(torch.tensor([0, 0, 1, 1])))
    assert omega[0].item() == 1.0 and omega[1].item() == pytest.approx(4 * math.exp(-10), rel=1e-9)
    w = torch.tensor([1.0, 2.0]).exp().double()  # fp32 exp, then fp64 products: theirs, bit for bit
    assert omega[2:].tolist() == ((w * w) * (w * w)).tolist()
    # a group whose weights all underflow to 0 stays 0 (b = 0/(0 + 1e-8) = 0, as theirs)
    zero = reference_baseline_weights(tensor([1.0, 1.0]), tensor([-120.0, -130.0]), CAP, tensor([1.0, 1.0]),
                                      single_group(2))
    assert zero.tolist() == [0.0, 0.0]


def test_random_groups_match_the_authors_wherever_theirs_is_finite() -> None:
    generator = torch.Generator().manual_seed(7)
    for trial in range(200):
        size = int(torch.randint(2, 17, (1,), generator=generator))
        spread = [0.5, 5.0, 30.0, 80.0][trial % 4]
        log_ratios = (spread * torch.randn(size, generator=generator)).clamp(-85, 85).tolist()
        rewards = torch.randint(0, 3, (size,), generator=generator).mul(0.5).tolist()
        sq_norms = (0.1 + torch.rand(size, generator=generator)).tolist()
        expected = authors_advantages(rewards, log_ratios, sq_norms)
        ours = reference_advantages(rewards, log_ratios, sq_norms)
        assert ours == pytest.approx(expected, rel=1e-5, abs=1e-6)
