"""Staleness, IS, KL and baseline metrics."""

import math

import pytest
import torch

from tests.vcpo.helpers import tensor
from vcpo import metrics as m


def test_staleness_metrics_with_log2_histogram():
    lags = torch.tensor([0, 1, 2, 3, 4, 200])
    valid = torch.tensor([True, True, True, True, True, False])
    result = m.staleness_metrics(lags, valid)
    # valid lags [0, 1, 2, 3, 4]: mean 10/5 = 2, max 4; bins 0→0, 1→1, 2,3→2, 4→3
    assert result[m.STALENESS_MEAN].item() == 2.0 and result[m.STALENESS_MAX].item() == 4.0
    assert result[m.STALENESS_HIST].tolist() == [1, 1, 2, 1, 0, 0, 0, 0, 0]
    # 127 → bin 7 ([64, 127]); 128 and beyond → last bin 8
    assert m.staleness_bin(torch.tensor([64, 127, 128, 10_000])).tolist() == [7, 7, 8, 8]


def test_is_weight_metrics_hand_computed():
    log_w = torch.log(tensor([1.0, 2.0, 4.0, 16.0]))
    result = m.is_weight_metrics(log_w, torch.ones(4, dtype=torch.bool), cap=8.0)
    # ESS = 23²/277 = 1.909747 → ρ = 0.477437; clipped w̄ = [1, 2, 4, 8]: 15²/85 = 2.647059 → 0.661765
    torch.testing.assert_close(result[m.IS_ESS_RATIO], tensor(0.477437))
    torch.testing.assert_close(result[m.IS_ESS_RATIO_CLIPPED], tensor(0.661765))
    # w_max 16; p99 by linear interpolation at 0.99·3 = 2.97: 4 + 0.97·12 = 15.64; mean log w = 7 ln 2 / 4
    torch.testing.assert_close(result[m.IS_W_MAX], tensor(16.0))
    torch.testing.assert_close(result[m.IS_W_P99], tensor(15.64))
    torch.testing.assert_close(result[m.IS_LOG_W_MEAN], tensor(7 * math.log(2.0) / 4))


def test_is_weight_metrics_of_an_empty_batch_are_zero():
    result = m.is_weight_metrics(tensor([1.0, 2.0]), torch.zeros(2, dtype=torch.bool))
    assert all(value.item() == 0.0 for value in result.values())


def test_kl_k3_estimates_kl_from_mu_to_pi_under_samples_from_mu():
    # μ uniform over 3 tokens, so the token mean IS the expectation under μ; π = [0.7, 0.2, 0.1]
    pi = tensor([0.7, 0.2, 0.1])
    old_logprobs, behavior_logprobs = pi.log()[None], torch.full((1, 3), math.log(1 / 3))
    estimate = m.behavior_kl_k3(old_logprobs, behavior_logprobs, torch.ones(1, 3, dtype=torch.bool))
    # KL(μ‖π) = Σ (1/3) ln((1/3)/π) = (1/3)(−0.741937 + 0.510826 + 1.203973) = 0.324287
    kl_mu_pi = sum((1 / 3) * math.log((1 / 3) / p) for p in pi.tolist())
    torch.testing.assert_close(estimate, tensor(kl_mu_pi))
    torch.testing.assert_close(estimate, tensor(0.324287))
    # docs/algorithm.md's e^{−ℓ} + ℓ − 1 averaged under μ:
    # mean(μ/π) − 0.324287 − 1 = 1.825397 − 1.324287 = 0.501110, not KL(μ‖π)
    # (it is K3 for KL(π‖μ) when the samples come from π)
    ell = old_logprobs - behavior_logprobs
    torch.testing.assert_close((ell.neg().exp() + ell - 1).mean(), tensor(0.501110))


def test_token_fraction_reward_and_opob_metrics():
    mask = torch.tensor([[True, True, False], [True, True, True]])
    selected = torch.tensor([[True, False, True], [False, False, True]])
    # selected ∧ trained = 2 of 5 tokens
    torch.testing.assert_close(m.token_fraction(selected, mask), tensor(0.4))
    rewards = m.reward_metrics(tensor([1.0, 0.0, 0.0, 1.0, 99.0]), torch.tensor([True] * 4 + [False]))
    assert rewards[m.REWARD_MEAN].item() == 0.5 and rewards[m.REWARD_STD].item() == 0.5
    opob = m.opob_metrics(tensor([0.8, 0.2, 5.0]), tensor([0.5, 0.5, 0.0]), torch.tensor([True, True, False]))
    # baseline mean (0.8 + 0.2)/2 = 0.5; gap (|0.3| + |−0.3|)/2 = 0.3
    torch.testing.assert_close(opob[m.OPOB_BASELINE_MEAN], tensor(0.5))
    torch.testing.assert_close(opob[m.OPOB_GAP_TO_GROUP_MEAN], tensor(0.3))


def test_log_w_reward_correlation_hand_computed():
    from vcpo.metrics import log_w_reward_correlation

    valid = torch.tensor([True, True, True, False])
    # log w = [1, 2, 3], R = [0, 0, 1] over the valid three: centred x = [−1, 0, 1], y = [−1/3, −1/3, 2/3];
    # Σxy = 1, Σx² = 2, Σy² = 2/3 → r = 1/sqrt(4/3) = 0.8660
    log_w, rewards = torch.tensor([1.0, 2.0, 3.0, 99.0]), torch.tensor([0.0, 0.0, 1.0, 5.0])
    corr = log_w_reward_correlation(log_w, rewards, valid)
    assert float(corr) == pytest.approx(math.sqrt(3.0) / 2.0, rel=1e-6)
    # constant rewards: no correlation to speak of, 0 (never NaN)
    flat = log_w_reward_correlation(torch.tensor([1.0, 2.0, 3.0, 0.0]), torch.ones(4), valid)
    assert float(flat) == 0.0


def test_the_behaviour_ratio_by_lag_separates_the_mismatch_from_staleness() -> None:
    """Lags (0, 0, 1, 3, 3) and L = (0.1, −0.1, −1.0, −2.0, −3.0): the lag-0 bin is the mismatch (mean 0, ESS
    of e^{±0.1}), bin 1 holds lag 1, bin 2 lags 2–3; the staleness excess is the lagged mean −2.0 less 0."""
    from vcpo.is_weights import ess_ratio
    from vcpo.metrics import behavior_ratio_by_lag

    log_w = torch.tensor([0.1, -0.1, -1.0, -2.0, -3.0])
    k3 = torch.tensor([0.01, 0.02, 0.3, 0.5, 0.7])
    lags = torch.tensor([0, 0, 1, 3, 3])
    out = behavior_ratio_by_lag(log_w, k3, lags, torch.ones(5, dtype=torch.bool))
    by_mean = out["is/by_lag/log_w_mean"].tolist()
    assert by_mean[:3] == pytest.approx([0.0, -1.0, -2.5], abs=1e-6)
    assert all(math.isnan(v) for v in by_mean[3:])
    assert out["is/by_lag/kl_k3"].tolist()[:3] == pytest.approx([0.015, 0.3, 0.6])
    ess = out["is/by_lag/ess_ratio"].tolist()
    assert ess[1] == pytest.approx(1.0)  # one trajectory is its own ESS
    assert ess[2] == pytest.approx(float(ess_ratio(torch.tensor([-2.0, -3.0]))))
    assert float(out["is/mismatch/ess_ratio"]) == pytest.approx(float(ess_ratio(torch.tensor([0.1, -0.1]))))
    assert float(out["is/mismatch/log_w_mean"]) == pytest.approx(0.0, abs=1e-6)
    assert float(out["is/mismatch/kl_k3"]) == pytest.approx(0.015)
    assert float(out["is/staleness/log_w_mean_excess"]) == pytest.approx(-2.0)
    # an invalid (or rejected) trajectory counts nowhere; a batch without lag 0 has no mismatch part
    valid = torch.tensor([True, True, True, True, False])
    no_zero = behavior_ratio_by_lag(log_w, k3, torch.tensor([1, 1, 1, 3, 3]), valid)
    assert math.isnan(float(no_zero["is/mismatch/log_w_mean"]))
    assert math.isnan(float(no_zero["is/staleness/log_w_mean_excess"]))
    assert no_zero["is/by_lag/log_w_mean"].tolist()[2] == pytest.approx(-2.0)
