"""GSPO and CISPO against hand-computed losses and gradients: the sequence clip that silences a whole
trajectory, the token weight that is held at its bound instead of dropping the token, `ratio_to`.

Every test uses the same minibatch: two prompt groups of two trajectories, rewards [1, 0] and [0, 1],
so GRPO's advantages (Bessel σ = sqrt(0.5)) are A = [+a, −a, −a, +a]; three positions, the last one of
trajectory 2 not trained (11 trained tokens). The ratios are set through d = log π_θ − log ν per token.
"""

import math

import pytest
import torch

from tests.vcpo.helpers import leaf, simple_inputs, tensor
from vcpo.registry import make_objective

a = 0.5 / (math.sqrt(0.5) + 1e-6)
ADVANTAGES = [a, -a, -a, a]
LOGPROBS = [[-1.0, -2.0, -0.5], [-0.7, -1.2, -0.9], [-0.3, -1.1, -2.0], [-0.8, -0.6, -1.4]]
MASK = torch.tensor([[True, True, True], [True, True, True], [True, True, False], [True, True, True]])
LENGTHS = [3, 3, 2, 3]
TOKENS = sum(LENGTHS)  # 11
B = 4


def _inputs(
    logprobs: torch.Tensor, behavior_diff: list[list[float]], old_diff: list[list[float]] | None = None
):
    """log μ = log π_θ − behavior_diff and log π_old = log π_θ − old_diff (default: π_old = π_θ)."""
    base = logprobs.detach()
    old = base.clone() if old_diff is None else base - tensor(old_diff)
    return simple_inputs(
        logprobs,
        [1.0, 0.0, 0.0, 1.0],
        [0, 0, 1, 1],
        behavior_logprobs=base - tensor(behavior_diff),
        old_logprobs=old,
        loss_mask=MASK,
    )


# --- GSPO --------------------------------------------------------------------------------------
# log s_i = mean over trained tokens of d: [0.3, 0, 0] → 0.1; [−0.2, 0, −0.1] → −0.1; [0.1, 0, (5, not
# trained)] → 0.05; [−0.15, 0, 0] → −0.05. With the default ε = (3e-4, 4e-4) every s is outside the range.
GSPO_DIFF = [[0.3, 0.0, 0.0], [-0.2, 0.0, -0.1], [0.1, 0.0, 5.0], [-0.15, 0.0, 0.0]]


def test_gspo_hand_computed_loss_and_gradient_with_every_clip_case():
    logprobs = leaf(LOGPROBS)
    out = make_objective("gspo")(_inputs(logprobs, GSPO_DIFF))
    s2, s3 = math.exp(0.05), math.exp(-0.05)
    # loss_i = −min(s A, clip(s) A):
    #   0: A > 0, s = e^0.1 > 1 + ε_high → the clipped branch is the min: −(1 + 4e-4)·a, no gradient
    #   1: A < 0, s = e^-0.1 < 1 − ε_low → the clipped branch is the min: (1 − 3e-4)·a, no gradient
    #   2: A < 0, s = e^0.05 > 1 + ε_high → the unclipped branch is the min: s·a, gradient through s
    #   3: A > 0, s = e^-0.05 < 1 − ε_low → the unclipped branch is the min: −s·a, gradient through s
    losses = [-(1 + 4e-4) * a, (1 - 3e-4) * a, s2 * a, -s3 * a]
    assert out.loss.item() == pytest.approx(sum(losses) / B, rel=1e-5)  # seq-mean-token-mean = (1/B) Σ_i
    out.loss.backward()
    # ∂s_i/∂log π_t = s_i / |M_i| (the geometric mean, not the product): ∂loss/∂log π_t = −A_i s_i / (|M_i| B)
    expected = [
        [0.0, 0.0, 0.0],
        [0.0, 0.0, 0.0],
        [a * s2 / (2 * B), a * s2 / (2 * B), 0.0],
        [-a * s3 / (3 * B)] * 3,
    ]
    torch.testing.assert_close(logprobs.grad, tensor(expected), rtol=1e-5, atol=1e-8)
    assert out.metrics["gspo/seq_clip_frac"].item() == pytest.approx(0.5)
    assert out.metrics["pg/clip_frac"].item() == pytest.approx(6 / TOKENS)  # tokens of trajectories 0, 1
    assert out.counts.clipped_tokens.item() == 6
    ratio_mean = (math.exp(0.1) + math.exp(-0.1) + s2 + s3) / 4
    assert out.metrics["gspo/seq_ratio_mean"].item() == pytest.approx(ratio_mean, rel=1e-6)


def test_gspo_respects_the_common_loss_aggregation():
    logprobs = leaf(LOGPROBS)
    out = make_objective("gspo", loss_aggregation="token-mean")(_inputs(logprobs, GSPO_DIFF))
    losses = [-(1 + 4e-4) * a, (1 - 3e-4) * a, math.exp(0.05) * a, -math.exp(-0.05) * a]
    # token-mean: each trajectory's loss_i counts once per trained token
    expected = sum(n * loss for n, loss in zip(LENGTHS, losses, strict=True)) / TOKENS
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)


def test_gspo_ratio_to_proximal_divides_by_pi_old_and_ignores_mu():
    logprobs = leaf(LOGPROBS)
    # π_old ≠ π_θ (as after a first step on the minibatch): log s = [0.02, −0.1, 0.1, 0]; μ is far off
    # (log r = 3 per token), which would clip every positive-advantage trajectory if it were used.
    old_diff = [[0.06, 0.0, 0.0], [0.0, -0.3, 0.0], [0.2, 0.0, 9.0], [0.0, 0.0, 0.0]]
    far = [[3.0] * 3] * 4
    objective = make_objective("gspo", ratio_to="proximal", clip_low=0.5, clip_high=0.5)
    out = objective(_inputs(logprobs, far, old_diff))
    s = [math.exp(0.02), math.exp(-0.1), math.exp(0.1), 1.0]
    expected_loss = sum(-A * si for A, si in zip(ADVANTAGES, s, strict=True)) / B  # ≈ −1.8e-3: cancellation
    assert out.loss.item() == pytest.approx(expected_loss, abs=1e-7)
    out.loss.backward()
    expected = [
        [-A * si / (n * B) if t < n else 0.0 for t in range(3)]
        for A, si, n in zip(ADVANTAGES, s, LENGTHS, strict=True)
    ]
    torch.testing.assert_close(logprobs.grad, tensor(expected), rtol=1e-5, atol=1e-8)
    assert out.metrics["gspo/seq_clip_frac"].item() == 0.0


def test_gspo_ratio_to_proximal_in_this_learner_is_a_sequence_mean_policy_gradient():
    logprobs = leaf(LOGPROBS)
    # π_old = π_θ at the gradient point: s = 1 whatever μ is, nothing is clipped even with the paper's ε
    out = make_objective("gspo", ratio_to="proximal")(_inputs(logprobs, GSPO_DIFF))
    out.loss.backward()
    expected = [
        [-A / (n * B) if t < n else 0.0 for t in range(3)] for A, n in zip(ADVANTAGES, LENGTHS, strict=True)
    ]
    torch.testing.assert_close(logprobs.grad, tensor(expected), rtol=1e-5, atol=1e-8)
    assert out.metrics["pg/clip_frac"].item() == 0.0


# --- CISPO -------------------------------------------------------------------------------------
# r_t = e^d: trajectory 0 [e^0.1, e^0.5 → 1.28, 1]; 1 [e^0.4 → 1.28, e^-3, 1]; 2 [1, 1, (e^7, not trained)];
# 3 [e^-0.2, e^0.3 → 1.28, 1]. With the default ε_low = 1 the lower bound is 0: e^-3 is kept as it is.
CISPO_DIFF = [[0.1, 0.5, 0.0], [0.4, -3.0, 0.0], [0.0, 0.0, 7.0], [-0.2, 0.3, 0.0]]
HIGH = 1.28


def _cispo_weights(low: float = 0.0) -> list[list[float]]:
    return [
        [math.exp(0.1), HIGH, 1.0],
        [HIGH, max(math.exp(-3.0), low), 1.0],
        [1.0, 1.0, 0.0],
        [math.exp(-0.2), HIGH, 1.0],
    ]


def test_cispo_hand_computed_loss_and_gradient_keep_every_token():
    logprobs = leaf(LOGPROBS)
    out = make_objective("cispo")(_inputs(logprobs, CISPO_DIFF))
    weights = _cispo_weights()
    # token-mean: loss = −(1/N) Σ_t w_t A_i log π_t, ∂loss/∂log π_t = −w_t A_i / N with w detached
    loss = -sum(
        w * A * lp
        for row_w, A, row_lp, row_m in zip(weights, ADVANTAGES, LOGPROBS, MASK.tolist(), strict=True)
        for w, lp, m in zip(row_w, row_lp, row_m, strict=True)
        if m
    )
    assert out.loss.item() == pytest.approx(loss / TOKENS, rel=1e-5)
    out.loss.backward()
    expected = [[-w * A / TOKENS for w in row] for row, A in zip(weights, ADVANTAGES, strict=True)]
    torch.testing.assert_close(logprobs.grad, tensor(expected), rtol=1e-5, atol=1e-8)
    # the three tokens above 1 + ε_high keep a gradient, scaled by 1.28 (a PPO clip would zero two of them)
    assert (logprobs.grad[[0, 1, 3], [1, 0, 1]] != 0).all()
    assert out.metrics["pg/clip_frac"].item() == pytest.approx(3 / TOKENS)
    assert out.counts.clipped_tokens.item() == 3
    weight_mean = sum(sum(row) for row in weights) / TOKENS
    assert out.metrics["cispo/weight_mean"].item() == pytest.approx(weight_mean, rel=1e-6)


def test_cispo_lower_bound_and_sequence_mean_aggregation():
    logprobs = leaf(LOGPROBS)
    objective = make_objective("cispo", clip_low=0.2, loss_aggregation="seq-mean-token-mean")
    out = objective(_inputs(logprobs, CISPO_DIFF))
    out.loss.backward()
    # ε_low = 0.2: e^-3 is held at 0.8 (e^-0.2 = 0.819 is inside);
    # seq-mean-token-mean: each trajectory weighs 1/B, each of its tokens 1/|M_i|
    weights = _cispo_weights(low=0.8)
    expected = [
        [-w * A / (n * B) for w in row] for row, A, n in zip(weights, ADVANTAGES, LENGTHS, strict=True)
    ]
    torch.testing.assert_close(logprobs.grad, tensor(expected), rtol=1e-5, atol=1e-8)
    assert out.metrics["pg/clip_frac"].item() == pytest.approx(4 / TOKENS)


def test_cispo_ratio_to_proximal_divides_by_pi_old_and_ignores_mu():
    logprobs = leaf(LOGPROBS)
    old_diff = [[0.5, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, -0.1, 0.0]]
    far = [[3.0] * 3] * 4  # r = e^3 against μ: every weight would be 1.28
    out = make_objective("cispo", ratio_to="proximal")(_inputs(logprobs, far, old_diff))
    out.loss.backward()
    weights = [[HIGH, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, math.exp(-0.1), 1.0]]
    expected = [[-w * A / TOKENS for w in row] for row, A in zip(weights, ADVANTAGES, strict=True)]
    torch.testing.assert_close(logprobs.grad, tensor(expected), rtol=1e-5, atol=1e-8)
    assert out.metrics["pg/clip_frac"].item() == pytest.approx(1 / TOKENS)


def test_cispo_ratio_to_proximal_in_this_learner_is_reinforce_with_grpo_advantages():
    logprobs = leaf(LOGPROBS)
    out = make_objective("cispo", ratio_to="proximal")(_inputs(logprobs, CISPO_DIFF))
    out.loss.backward()  # π_old = π_θ: r = 1 everywhere, whatever μ is
    expected = [
        [-A / TOKENS if t < n else 0.0 for t in range(3)] for A, n in zip(ADVANTAGES, LENGTHS, strict=True)
    ]
    torch.testing.assert_close(logprobs.grad, tensor(expected), rtol=1e-5, atol=1e-8)


# --- options -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "options", "field"),
    [
        ("gspo", {"ratio_to": "engine"}, "ratio_to"),
        ("gspo", {"clip_low": 1.0}, r"clip_low=1.0 must be in \[0, 1\)"),
        ("gspo", {"clip_low": -0.1}, "clip_low"),
        ("gspo", {"clip_high": -1e-4}, "clip_high"),
        ("cispo", {"ratio_to": "old"}, "ratio_to"),
        ("cispo", {"clip_low": 1.2}, r"clip_low=1.2 must be in \[0, 1\]"),
        ("cispo", {"clip_high": -0.1}, "clip_high"),
    ],
)
def test_bad_options_name_the_field(name: str, options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_objective(name, **options)


def test_defaults_and_the_bounds_that_are_allowed():
    gspo, cispo = make_objective("gspo"), make_objective("cispo")
    assert (gspo.clip_low, gspo.clip_high, gspo.ratio_to, gspo.loss_aggregation) == (
        3e-4,
        4e-4,
        "behavior",
        "seq-mean-token-mean",
    )
    assert (cispo.clip_low, cispo.clip_high, cispo.ratio_to, cispo.loss_aggregation) == (
        1.0,
        0.28,
        "behavior",
        "token-mean",
    )
    make_objective("gspo", clip_low=0.999)  # a lower bound just above 0 is fine for GSPO
    make_objective("cispo", clip_low=0.0, clip_high=0.0)  # CISPO with weights pinned at 1: REINFORCE
