"""The correction stages (vcpo/corrections.py): each stage by hand, its metrics, the order of a list, the
inputs objectives then see (ESS with rejected trajectories), and veRL's `rollout_corr_helper.py` and
SkyRL's `off_policy_correction_utils.py` on random inputs, re-implemented below from their formulas.

Conventions compared (docs/algorithm.md "Corrections"): veRL's K1 options take the band on k1 = log μ/π,
so its `token_k1` "a_b" keeps μ/π ∈ [a, b], i.e. π/μ ∈ [1/b, 1/a] — `TokenRejection(1/b, 1/a)`; veRL judges
every option on the sampled tokens and ANDs them, vcpo judges a sequence stage on the tokens the token
stages kept (as SkyRL does), so the two agree on any one stage and on lists of one level only."""

from __future__ import annotations

import math

import pytest
import torch

from tests.vcpo.helpers import leaf, simple_inputs, tensor
from vcpo.corrections import (
    CORRECTION_REJECTED_BY_LAG,
    CORRECTION_REJECTED_TOKENS,
    CORRECTION_REJECTED_TRAJECTORIES,
    CorrectionView,
    GeometricRejection,
    K3Rejection,
    OffPolicySequenceMasking,
    SequenceRejection,
    SequenceTruncation,
    TokenRejection,
    TokenTruncation,
    apply_corrections,
    check_stages,
    correct_inputs,
    stage_metric,
)
from vcpo.objectives import PolicyLossInputs
from vcpo.registry import make_objective
from vcpo.step_size import EssLr, StepSizeInputs

LOG = math.log


def _run(stages, log_ratios, mask=None, rewards=None, groups=None, lags=None):
    """apply_corrections on log π_old − log μ = `log_ratios` (μ = 0 log-probs)."""
    old = tensor(log_ratios)
    mask = torch.ones(old.shape, dtype=torch.bool) if mask is None else torch.tensor(mask)
    rewards = tensor(rewards if rewards is not None else [1.0] * old.shape[0])
    groups = torch.tensor(groups if groups is not None else list(range(old.shape[0])))
    lags = None if lags is None else torch.tensor(lags)
    return apply_corrections(stages, old, torch.zeros_like(old), mask, rewards, groups, lags)


# --- each stage by hand ------------------------------------------------------------------------------


def test_token_truncation_weighs_each_token_by_its_ratio_held_at_the_cap() -> None:
    out = _run([TokenTruncation(cap=2.0)], [[LOG(0.5), LOG(3.0), LOG(1.5)]])
    torch.testing.assert_close(out.token_weights, tensor([[0.5, 2.0, 1.5]]))
    assert out.loss_mask.all() and not out.rejected.any()
    torch.testing.assert_close(out.metrics[stage_metric("token_tis", "truncated_tokens")], tensor(1 / 3))
    torch.testing.assert_close(out.metrics[stage_metric("token_tis", "weight_mean")], tensor(4 / 3))


def test_sequence_truncation_weighs_every_token_of_a_trajectory_by_its_capped_product() -> None:
    # row 0: w = 2·2 = 4 → 3 (the cap); row 1: w = 0.5, its second cell (ratio e^7) is not sampled
    out = _run([SequenceTruncation(cap=3.0)], [[LOG(2.0), LOG(2.0)], [LOG(0.5), 7.0]],
               mask=[[True, True], [True, False]])
    torch.testing.assert_close(out.token_weights, tensor([[3.0, 3.0], [0.5, 0.0]]))
    torch.testing.assert_close(out.metrics[stage_metric("seq_tis", "truncated_tokens")], tensor(2 / 3))


def test_token_rejection_drops_the_tokens_outside_the_band_and_nothing_else() -> None:
    ratios = [[LOG(0.4), 0.0, LOG(2.5), LOG(1.9)], [0.1, 0.2, 0.0, 0.0]]
    out = _run([TokenRejection(lower=0.5, upper=2.0)], ratios)
    assert out.loss_mask.tolist() == [[False, True, False, True], [True, True, True, True]]
    assert out.token_weights is None and not out.rejected.any()
    torch.testing.assert_close(out.metrics[stage_metric("token_reject", "rejected_tokens")], tensor(2 / 8))
    torch.testing.assert_close(out.metrics[CORRECTION_REJECTED_TOKENS], tensor(2 / 8))


def test_sequence_rejection_drops_whole_trajectories_whose_product_leaves_the_band() -> None:
    # w = 3 (out), 1.5 (in), 0.4 (out): each split over two tokens so only the product decides
    ratios = [[LOG(1.5), LOG(2.0)], [LOG(1.5), 0.0], [LOG(0.8), LOG(0.5)]]
    out = _run([SequenceRejection(lower=0.5, upper=2.0)], ratios)
    assert out.loss_mask.tolist() == [[False, False], [True, True], [False, False]]
    assert out.rejected.tolist() == [True, False, True]
    share = out.metrics[stage_metric("seq_reject", "rejected_trajectories")]
    torch.testing.assert_close(share, tensor(2 / 3))
    torch.testing.assert_close(out.metrics[CORRECTION_REJECTED_TRAJECTORIES], tensor(2 / 3))


def test_geometric_rejection_judges_the_per_token_mean_not_the_product() -> None:
    # row 0: ratios 1.5 and 1/1.5, geometric mean 1 (kept); row 1: 1.2 on four tokens (mean 1.2: out);
    # row 2: 1.05 on ten tokens — w = 1.63 (a product band [0.9, 1.1] would drop it), mean 1.05 (kept)
    ratios = [[LOG(1.5), LOG(1 / 1.5)] + [0.0] * 8, [LOG(1.2)] * 4 + [0.0] * 6, [LOG(1.05)] * 10]
    mask = [[True] * 2 + [False] * 8, [True] * 4 + [False] * 6, [True] * 10]
    out = _run([GeometricRejection(lower=0.9, upper=1.1)], ratios, mask=mask)
    assert out.rejected.tolist() == [False, True, False]
    product = _run([SequenceRejection(lower=0.9, upper=1.1)], ratios, mask=mask)
    assert product.rejected.tolist() == [False, True, True]


def test_k3_rejection_reduces_the_k3_estimate_by_mean_sum_or_max() -> None:
    # k3(log 2) = 2 − 1 − log 2 = 0.30685; k3(log 1.2) = 0.2 − log 1.2 = 0.017678
    ratios = [[LOG(2.0), 0.0], [0.0, 0.0], [LOG(1.2), LOG(1.2)]]
    mean = _run([K3Rejection(threshold=0.1)], ratios)
    assert mean.rejected.tolist() == [True, False, False]  # means 0.153, 0, 0.0177
    total = _run([K3Rejection(threshold=0.03, reduce="sum")], ratios)
    assert total.rejected.tolist() == [True, False, True]  # sums 0.307, 0, 0.0354
    largest = _run([K3Rejection(threshold=0.3, reduce="max")], ratios)
    assert largest.rejected.tolist() == [True, False, False]  # maxima 0.307, 0, 0.0177
    assert K3Rejection(0.1).label == "k3_reject" and K3Rejection(0.1, "max").label == "k3_reject_max"


def test_opsm_drops_only_below_mean_trajectories_that_drifted_past_delta() -> None:
    # group 0: rewards 1, 0, 0 (mean 1/3): rows 1 and 2 are negative. Row 0 drifted but is positive; row 1
    # drifted (mean log μ/π_old = 0.01 > δ): dropped; row 2 moved the other way (−0.01): kept.
    # group 1: rewards 0, 0 (no group-relative signal, advantage 0): drifted but kept.
    ratios = [[-0.01, -0.01], [-0.005, -0.015], [0.01, 0.01], [-0.5, -0.5], [-0.5, -0.5]]
    out = _run([OffPolicySequenceMasking(delta=1e-3)], ratios, rewards=[1.0, 0.0, 0.0, 0.0, 0.0],
               groups=[0, 0, 0, 1, 1])
    assert out.rejected.tolist() == [False, True, False, False, False]


# --- a list of stages --------------------------------------------------------------------------------


def test_a_sequence_stage_judges_the_tokens_the_token_stages_kept_whatever_the_list_order() -> None:
    # ratio 5 on the first token: the token band drops it, and the rest has geometric mean 1 (kept). Alone,
    # the geometric band sees 5^(1/3) = 1.71 and drops the trajectory.
    ratios = [[LOG(5.0), 0.0, 0.0]]
    token, geo = TokenRejection(0.5, 2.0), GeometricRejection(0.9, 1.1)
    first, second = _run([token, geo], ratios), _run([geo, token], ratios)
    assert first.loss_mask.tolist() == second.loss_mask.tolist() == [[False, True, True]]
    assert _run([geo], ratios).rejected.tolist() == [True]


def test_the_truncation_weighs_the_kept_tokens_only() -> None:
    # seq TIS after a token rejection: w over the two kept tokens, 1.5·1.5 = 2.25, not 2.25·4
    out = _run([SequenceTruncation(cap=8.0), TokenRejection(0.5, 2.0)], [[LOG(1.5), LOG(4.0), LOG(1.5)]])
    torch.testing.assert_close(out.token_weights, tensor([[2.25, 0.0, 2.25]]))


def test_per_lag_metrics_by_hand() -> None:
    # lags 0, 1, 2, 3 → bins 0, 1, 2, 2. Row 1 loses 1 of 3 tokens (ratio 10), row 3 loses 1 of 3 (0.05);
    # row 2 (w = 1.5³ = 3.4 > 3) is dropped by the sequence band: 3 tokens.
    ratios = [[0.0, 0.0, 0.0], [LOG(10.0), 0.0, 0.0], [LOG(1.5)] * 3, [0.0, LOG(0.05), 0.0]]
    out = _run([TokenRejection(0.5, 2.0), SequenceRejection(1 / 3, 3.0)], ratios, lags=[0, 1, 2, 3])
    nan = math.nan
    torch.testing.assert_close(out.metrics[stage_metric("token_reject", "rejected_tokens_by_lag")],
                               tensor([0.0, 1 / 3, 1 / 6] + [nan] * 6), equal_nan=True)
    torch.testing.assert_close(out.metrics[stage_metric("seq_reject", "rejected_tokens_by_lag")],
                               tensor([0.0, 0.0, 3 / 6] + [nan] * 6), equal_nan=True)
    torch.testing.assert_close(out.metrics[CORRECTION_REJECTED_BY_LAG],
                               tensor([0.0, 1 / 3, 4 / 6] + [nan] * 6), equal_nan=True)
    torch.testing.assert_close(out.metrics[CORRECTION_REJECTED_TOKENS], tensor(5 / 12))
    torch.testing.assert_close(out.metrics[CORRECTION_REJECTED_TRAJECTORIES], tensor(1 / 4))


def test_a_trajectory_with_non_finite_inputs_passes_through_uncounted() -> None:
    ratios = [[LOG(10.0), 0.0], [math.nan, LOG(10.0)]]
    out = _run([TokenRejection(0.5, 2.0)], ratios)
    assert out.loss_mask.tolist() == [[False, True], [True, True]]  # row 1: the objective excludes it
    torch.testing.assert_close(out.metrics[CORRECTION_REJECTED_TOKENS], tensor(1 / 2))


@pytest.mark.parametrize(("stages", "message"), [
    ([TokenRejection(), TokenRejection(0.2, 5.0)], "more than once"),
    ([TokenTruncation(), SequenceTruncation()], "keep one truncation"),
])
def test_lists_that_cannot_run_together_are_refused(stages, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_stages(stages)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: TokenRejection(1.2, 2.0), "without 1"),
    (lambda: GeometricRejection(0.0, 1.1), "0 < lower"),
    (lambda: SequenceRejection(0.5, math.inf), "< ∞"),
    (lambda: K3Rejection(0.0), "threshold"),
    (lambda: K3Rejection(0.1, "median"), "reduce"),
    (lambda: OffPolicySequenceMasking(-1.0), "delta"),
    (lambda: TokenTruncation(0.0), "cap"),
])
def test_bad_stage_parameters_are_refused_naming_the_parameter(build, message) -> None:
    with pytest.raises(ValueError, match=message):
        build()


# --- what the objective then sees ---------------------------------------------------------------------


def _random(seed: int = 0, batch: int = 12, length: int = 10, spread: float = 0.3):
    generator = torch.Generator().manual_seed(seed)
    params = torch.randn(batch, length, generator=generator).requires_grad_(True)
    logprobs = torch.nn.functional.logsigmoid(params)
    behavior = logprobs.detach() + spread * torch.randn(batch, length, generator=generator)
    mask = torch.rand(batch, length, generator=generator) > 0.15
    mask[:, 0] = True
    inputs = PolicyLossInputs(
        logprobs=logprobs, old_logprobs=logprobs.detach(), behavior_logprobs=behavior, loss_mask=mask,
        rewards=(torch.rand(batch, generator=generator) > 0.5).float(),
        group_ids=torch.arange(batch) // 4, lags=torch.randint(0, 5, (batch,), generator=generator))
    return inputs, params


def test_a_rejected_trajectory_weighs_zero_in_the_ess_and_its_reward_stays_in_the_group() -> None:
    # four on-policy trajectories (w = 1), one rejected by OPSM: ESS = 3 of B = 4 → ρ = 0.75, where the
    # task-filtered convention (w = 1 for a trajectory without tokens) would give 1.
    logprobs = leaf([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    behavior = logprobs.detach().clone()
    behavior[3] = -0.9  # log μ/π_old = 0.1 per token on row 3
    inputs = simple_inputs(logprobs, [1.0, 1.0, 0.0, 0.0], [0, 0, 0, 0], behavior_logprobs=behavior)
    corrected, correction = correct_inputs([OffPolicySequenceMasking(delta=0.05)], inputs)
    assert correction.rejected.tolist() == [False, False, False, True]
    out = make_objective("grpo")(corrected)
    torch.testing.assert_close(out.metrics["is/ess_ratio"], tensor(0.75))
    assert out.log_is_weights[3] == -math.inf
    lr = EssLr(base_ess_ratio=1.0)(StepSizeInputs(out.log_is_weights, out.valid))
    torch.testing.assert_close(lr.metrics["lr/ess_ratio"], tensor(0.75))
    # the group mean still counts row 3's reward (0.5, not 2/3): row 2's advantage is negative
    assert out.advantages[2, 0] < 0 and out.advantages[3].abs().sum() == 0


def test_token_tis_objective_is_grpo_under_the_token_truncation_stage() -> None:
    inputs, params = _random()
    direct = make_objective("token_tis", token_is_cap=2.0)(inputs)
    corrected, _ = correct_inputs([TokenTruncation(cap=2.0)], inputs)
    layered = make_objective("grpo")(corrected)
    assert torch.equal(direct.loss, layered.loss)
    (want,) = torch.autograd.grad(direct.loss, params, retain_graph=True)
    (got,) = torch.autograd.grad(layered.loss, params)
    assert torch.equal(got, want) and want.abs().max() > 1e-3


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mis_is_grpo_under_a_band_and_a_truncation_at_its_cap_once_dropped_tokens_keep_the_denominator(
    level: str,
) -> None:
    """MIS keeps a dropped token in token-mean's denominator; a rejection removes it from the mask. With the
    denominator pinned to the sampled tokens (`num_units`) the two are the same loss and gradient."""
    inputs, params = _random(seed=3, spread=0.4 if level == "token" else 0.15)
    cap = 2.0
    band = TokenRejection(1 / cap, cap) if level == "token" else SequenceRejection(1 / cap, cap)
    truncation = TokenTruncation(cap) if level == "token" else SequenceTruncation(cap)
    corrected, correction = correct_inputs([band, truncation], inputs)
    assert 0 < correction.metrics[CORRECTION_REJECTED_TOKENS] < 0.6  # something is dropped, not everything
    sampled = inputs.loss_mask.sum()
    direct = make_objective("mis", is_cap=cap, level=level)(inputs)
    layered = make_objective("grpo")(PolicyLossInputs(**{**corrected.__dict__, "num_units": sampled}))
    torch.testing.assert_close(layered.loss, direct.loss, rtol=1e-6, atol=1e-7)
    (want,) = torch.autograd.grad(direct.loss, params, retain_graph=True)
    (got,) = torch.autograd.grad(layered.loss, params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("name", "params", "accepts"), [
    ("grpo", {}, True), ("dr_grpo", {}, True), ("reinforce", {}, True), ("rloo", {}, True),
    ("gspo", {"ratio_to": "proximal"}, True), ("cispo", {"ratio_to": "proximal"}, True),
    ("otb", {"use_is_weights": False}, True),
    ("gspo", {}, False), ("cispo", {}, False), ("otb", {}, False), ("vcpo", {}, False),
    ("seq_tis", {}, False), ("token_tis", {}, False), ("mis", {}, False), ("m2po", {}, False),
    ("bapo", {}, False), ("tba", {}, False),
])
def test_only_objectives_without_a_behaviour_weight_take_a_truncation(name, params, accepts) -> None:
    objective = make_objective(name, **params)
    assert objective.accepts_token_weights is accepts
    inputs, _ = _random()
    extra = {"seq_sq_grad_norms": torch.ones(12), "ref_logprobs": inputs.old_logprobs - 0.1,
             "sum_probs_squared": torch.full(inputs.loss_mask.shape, 0.3)}
    inputs = PolicyLossInputs(**{**inputs.__dict__, **extra})
    corrected, _ = correct_inputs([TokenTruncation(2.0)], inputs)
    if accepts:
        assert torch.isfinite(objective(corrected).loss)
    else:
        with pytest.raises(ValueError, match="truncation"):
            objective(corrected)
    rejected_only, _ = correct_inputs([K3Rejection(0.02)], inputs)  # a rejection stacks under every objective
    assert torch.isfinite(objective(rejected_only).loss)


def test_correcting_twice_is_refused() -> None:
    inputs, _ = _random()
    corrected, _ = correct_inputs([K3Rejection(0.02)], inputs)
    with pytest.raises(ValueError, match="once"):
        correct_inputs([TokenRejection()], corrected)


# --- veRL's rollout_corr_helper.py on random inputs ------------------------------------------------------

SAFETY_BOUND = 20.0


def _verl_masked_sum(values, mask, axis=None):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def _verl_masked_mean(values, mask, axis=None):
    return _verl_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def _verl_is_weights(log_ratio, response_mask, rollout_is, threshold):
    """veRL compute_rollout_correction_weights (no batch normalisation)."""
    if rollout_is == "token":
        weights = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        log_sum = _verl_masked_sum(log_ratio, response_mask, axis=-1).unsqueeze(-1)
        weights = torch.exp(torch.clamp(log_sum, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    return (weights * response_mask).clamp(max=threshold)


def _verl_rejection_mask(log_ratio, response_mask, options: list[str], thresholds: list[str]):
    """veRL compute_rollout_rejection_mask: every option on the sampled tokens, ANDed."""
    safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    for option, spec in zip(options, thresholds, strict=True):
        kind = option[-2:]
        stat = per_token[kind]
        if option.startswith("token"):
            level_stat = stat
        elif option.startswith("seq_sum"):
            level_stat = _verl_masked_sum(stat, response_mask, axis=-1).unsqueeze(-1).expand_as(stat)
        elif option.startswith("seq_mean"):
            level_stat = _verl_masked_mean(stat, response_mask, axis=-1).unsqueeze(-1).expand_as(stat)
        else:  # seq_max
            masked = stat.masked_fill(~response_mask.bool(), float("-inf")).max(dim=-1).values
            level_stat = masked.unsqueeze(-1).expand_as(stat)
        if kind == "k1":
            lower, upper = (float(x) for x in spec.split("_"))
            keep = (level_stat >= math.log(lower)) & (level_stat <= math.log(upper))
        else:
            keep = level_stat <= float(spec)
        combined = combined * keep.to(log_ratio.dtype)
    return (response_mask * combined).bool()


def _random_verl(seed: int, spread: float = 0.3, batch: int = 32, length: int = 12):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=generator) * 3
    rollout = old - spread * torch.randn(batch, length, generator=generator)
    mask = torch.rand(batch, length, generator=generator) > 0.2
    mask[:, 0] = True
    return old, rollout, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("stage", "rollout_is", "threshold"), [
    (TokenTruncation(1.5), "token", 1.5), (SequenceTruncation(1.5), "sequence", 1.5),
])
def test_truncation_weights_are_verls_rollout_is_weights(seed, stage, rollout_is, threshold) -> None:
    old, rollout, mask = _random_verl(seed, spread=0.2)
    out = apply_corrections([stage], old, rollout, mask, torch.ones(32), torch.arange(32))
    want = _verl_is_weights(old - rollout, mask.float(), rollout_is, threshold)
    assert (want == threshold).any() and (want < threshold).any()  # the cap acts, not everywhere
    torch.testing.assert_close(out.token_weights, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("stages", "options", "thresholds"), [
    ([TokenRejection(1 / 1.5, 1 / 0.7)], ["token_k1"], ["0.7_1.5"]),          # IcePop: μ/π ∈ [0.7, 1.5]
    ([SequenceRejection(1 / 4.0, 1 / 0.3)], ["seq_sum_k1"], ["0.3_4.0"]),
    ([GeometricRejection(1 / 1.1, 1 / 0.92)], ["seq_mean_k1"], ["0.92_1.1"]),
    ([K3Rejection(0.04)], ["seq_mean_k3"], ["0.04"]),
    ([K3Rejection(0.4, "sum")], ["seq_sum_k3"], ["0.4"]),
    ([K3Rejection(0.15, "max")], ["seq_max_k3"], ["0.15"]),
    ([GeometricRejection(1 / 1.1, 1 / 0.92), K3Rejection(0.04)], ["seq_mean_k1", "seq_mean_k3"],
     ["0.92_1.1", "0.04"]),
])
def test_rejection_masks_are_verls_rollout_rs_masks(seed, stages, options, thresholds) -> None:
    old, rollout, mask = _random_verl(seed)
    out = apply_corrections(stages, old, rollout, mask, torch.ones(32), torch.arange(32))
    want = _verl_rejection_mask(old - rollout, mask.float(), options, thresholds)
    kept = want.sum() / mask.sum()
    assert 0.05 < kept < 0.95, f"the thresholds should reject some and keep some, kept {kept:.2f}"
    assert torch.equal(out.loss_mask, want)


def test_a_token_and_a_sequence_option_differ_from_verl_as_documented() -> None:
    """veRL's seq_mean_k1 sees the token that token_k1 rejected; vcpo's geometric band sees the kept ones."""
    old = tensor([[LOG(5.0), 0.0, 0.0]])
    rollout, mask = torch.zeros_like(old), torch.ones(old.shape, dtype=torch.bool)
    ours = apply_corrections([TokenRejection(0.5, 2.0), GeometricRejection(0.9, 1.1)], old, rollout, mask,
                             tensor([1.0]), torch.tensor([0]))
    theirs = _verl_rejection_mask(old - rollout, mask.float(), ["token_k1", "seq_mean_k1"],
                                  ["0.5_2.0", f"{1 / 1.1}_{1 / 0.9}"])
    assert ours.loss_mask.tolist() == [[False, True, True]] and theirs.tolist() == [[False, False, False]]


# --- SkyRL's off_policy_correction_utils.py on random inputs ----------------------------------------------


def _skyrl_correction(old, rollout, loss_mask, eps_low, eps_high, tis, cap, geo_low, geo_high):
    """SkyRL compute_off_policy_correction with token masking, TIS and the geometric sequence mask (no
    outlier-token thresholds): returns (tis_ratio, loss_mask)."""
    log_ratio = old - rollout
    ratio = torch.exp(torch.clamp(log_ratio, -20.0, 20.0))
    in_bounds = (ratio >= (1 - eps_low)) & (ratio <= (1 + eps_high))
    loss_mask = loss_mask * (in_bounds | (loss_mask == 0)).float()
    if tis == "token":
        tis_ratio = torch.clamp(ratio, max=cap)
    else:
        seq = (log_ratio * loss_mask).sum(dim=-1, keepdim=True)
        tis_ratio = torch.clamp(torch.exp(torch.clamp(seq, -20.0, 20.0)), max=cap)
    num_tokens = loss_mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    geo = torch.exp(torch.clamp((log_ratio * loss_mask).sum(dim=-1, keepdim=True) / num_tokens, -20.0, 20.0))
    loss_mask = loss_mask * (~(geo > geo_high) & ~(geo < geo_low)).float()
    return tis_ratio, loss_mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("tis", "truncation"),
                         [("token", TokenTruncation(1.5)), ("sequence", SequenceTruncation(2.0))])
def test_token_mask_truncation_and_geometric_mask_are_skyrls(seed, tis, truncation) -> None:
    old, rollout, mask = _random_verl(seed, spread=0.15)
    stages = [GeometricRejection(0.97, 1.03), truncation, TokenRejection(0.8, 1.25)]  # any order: the same
    out = apply_corrections(stages, old, rollout, mask, torch.ones(32), torch.arange(32))
    cap = truncation.cap
    tis_ratio, want_mask = _skyrl_correction(old, rollout, mask.float(), 0.2, 0.25, tis, cap, 0.97, 1.03)
    kept = want_mask.sum() / mask.sum()
    assert 0.05 < kept < 0.95
    assert torch.equal(out.loss_mask, want_mask.bool())
    torch.testing.assert_close(out.token_weights, torch.where(out.loss_mask, tis_ratio.expand_as(old), 0.0),
                               rtol=1e-6, atol=0)


def test_geo_reject_reads_unclamped_token_ratios_as_skyrl_where_verl_clamps_each_token() -> None:
    """One row of 40 tokens, ℓ = −30 on the first and 0 elsewhere, band [0.5, 2]: the geometric mean of the
    ratios is e^{−0.75} = 0.47, so vcpo and SkyRL reject the row; veRL's seq_mean_k1 clamps ℓ at −20 first
    (mean −0.5, ratio 0.61) and keeps it. docs/algorithm.md states the difference."""
    old = torch.zeros(1, 40)
    old[0, 0] = -30.0
    rollout, mask = torch.zeros_like(old), torch.ones(old.shape, dtype=torch.bool)
    geo = [GeometricRejection(0.5, 2.0)]
    ours = apply_corrections(geo, old, rollout, mask, torch.ones(1), torch.arange(1))
    assert not ours.loss_mask.any()
    _, skyrl = _skyrl_correction(old, rollout, mask.float(), 1.0, 1e9, "token", 1e9, 0.5, 2.0)
    assert not skyrl.bool().any()
    verl = _verl_rejection_mask(old - rollout, mask.float(), ["seq_mean_k1"], ["0.5_2.0"])
    assert verl.all()
    # within ±20 per token the three agree: ℓ = −19 on the first token keeps it everywhere
    old[0, 0] = -19.0
    geo = [GeometricRejection(0.5, 2.0)]
    ours = apply_corrections(geo, old, rollout, mask, torch.ones(1), torch.arange(1))
    verl = _verl_rejection_mask(old - rollout, mask.float(), ["seq_mean_k1"], ["0.5_2.0"])
    assert ours.loss_mask.all() and verl.all()


def test_the_stages_weights_by_hand_as_token_tis_and_mis_use_them() -> None:
    """The weights the token_tis and mis objectives take from the stages: token truncation at 2 (ratios
    1/4 → 0.25, 4 → 2, an untrained token 0); MIS's token band [1/2, 2] keeps 0.5 (inclusive) and 1, drops 4,
    each kept token weighing its ratio; its sequence band [1/8, 8] drops a trajectory with w = 16 and keeps
    one with w = 4 at weight 4 on its trained token."""
    old = torch.zeros(1, 4)
    behavior = torch.log(tensor([[4.0, 1 / 4, 2.0, 1.0]]))  # π_old/μ = [1/4, 4, 1/2, 1]
    mask = torch.tensor([[True, True, True, False]])
    view = CorrectionView.of(old, behavior, mask, max_log_ratio=20.0)
    torch.testing.assert_close(TokenTruncation(2.0).weights(view), tensor([[0.25, 2.0, 0.5, 0.0]]))
    kept = TokenRejection(0.5, 2.0).keep(view) & view.mask
    assert kept.tolist() == [[False, False, True, False]]
    torch.testing.assert_close(TokenTruncation(2.0).weights(view._replace(mask=kept)),
                               tensor([[0.0, 0.0, 0.5, 0.0]]))
    old = torch.log(tensor([[16.0, 1.0], [4.0, 1.0]]))
    mask = torch.tensor([[True, True], [True, False]])
    view = CorrectionView.of(old, torch.zeros(2, 2), mask, max_log_ratio=20.0)
    kept = SequenceRejection(1 / 8, 8.0).keep(view)[:, None] & mask
    assert kept.tolist() == [[False, False], [True, False]]
    torch.testing.assert_close(SequenceTruncation(8.0).weights(view._replace(mask=kept)),
                               tensor([[0.0, 0.0], [4.0, 0.0]]))
