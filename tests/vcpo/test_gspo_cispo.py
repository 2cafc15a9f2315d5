"""GSPO and CISPO against hand-computed losses and gradients: the sequence clip that silences a whole
trajectory, the token weight that is held at its bound instead of dropping the token, `ratio_to`."""

import math

import pytest
import torch

from tests.vcpo.helpers import leaf, simple_inputs, tensor
from vcpo.registry import make_objective

# one group of two: R = [1, 0] → A = ±0.5 / (sqrt(0.5) + 1e-6) (GRPO, Bessel)
A = 0.5 / (math.sqrt(0.5) + 1e-6)


def _inputs(logprobs: torch.Tensor, behavior: list[list[float]]):
    return simple_inputs(logprobs, [1.0, 0.0], [0, 0], behavior_logprobs=tensor(behavior))


def test_gspo_clips_the_length_normalised_sequence_ratio_and_silences_that_trajectory():
    logprobs = leaf([[-1.0, -2.0], [-0.5, -1.5]])
    # trajectory 0: log s = mean(0.1, 0.1) = 0.1 → s = 1.105 > 1 + 4e-4 with A > 0: clipped, no gradient
    # trajectory 1: s = 1 (μ = π_θ), A < 0: loss −s·A, ∂/∂log π_t = −A · s / |M| per token
    out = make_objective("gspo")(_inputs(logprobs, [[-1.1, -2.1], [-0.5, -1.5]]))
    # seq-mean-token-mean: (1/2)(−(1 + 4e-4)·A + A) = −2e-4·A
    assert float(out.loss) == pytest.approx(-2e-4 * A, rel=1e-4)
    out.loss.backward()
    expected = [[0.0, 0.0], [0.5 * A / 2, 0.5 * A / 2]]
    torch.testing.assert_close(logprobs.grad, tensor(expected), rtol=1e-5, atol=1e-7)
    assert float(out.metrics["gspo/seq_clip_frac"]) == pytest.approx(0.5)
    assert float(out.metrics["pg/clip_frac"]) == pytest.approx(0.5)  # 2 of the 4 tokens


def test_gspo_ratio_to_proximal_is_one_at_the_gradient_point():
    logprobs = leaf([[-1.0, -2.0], [-0.5, -1.5]])
    out = make_objective("gspo", ratio_to="proximal")(_inputs(logprobs, [[-1.1, -2.1], [-0.5, -1.5]]))
    out.loss.backward()
    # s = 1 for both: −A_i · (1/|M|) per token, then the 1/B of the sequence mean
    expected = [[-A / 4, -A / 4], [A / 4, A / 4]]
    torch.testing.assert_close(logprobs.grad, tensor(expected), rtol=1e-5, atol=1e-7)
    assert float(out.metrics["gspo/seq_clip_frac"]) == 0.0


def test_cispo_holds_the_token_weight_at_its_bound_and_keeps_every_token():
    logprobs = leaf([[-1.0, -2.0], [-0.5, -1.5]])
    # trajectory 0: ratios e^0.1 = 1.1052 (kept) and e^0.5 = 1.6487 → held at 1 + 0.28; trajectory 1: 1
    out = make_objective("cispo")(_inputs(logprobs, [[-1.1, -2.5], [-0.5, -1.5]]))
    out.loss.backward()
    # token-mean over 4 tokens: ∂/∂log π_t = −w_t · A_i / 4, the weight detached
    expected = [[-math.exp(0.1) * A / 4, -1.28 * A / 4], [A / 4, A / 4]]
    torch.testing.assert_close(logprobs.grad, tensor(expected), rtol=1e-5, atol=1e-7)
    loss = -(math.exp(0.1) * A * -1.0 + 1.28 * A * -2.0 - A * -0.5 - A * -1.5) / 4
    assert float(out.loss) == pytest.approx(loss, rel=1e-5)
    assert float(out.metrics["pg/clip_frac"]) == pytest.approx(0.25)


def test_cispo_lower_bound_and_ratio_to_proximal():
    logprobs = leaf([[-1.0, -2.0], [-0.5, -1.5]])
    # ε_low = 0.2: a ratio of e^-0.5 = 0.607 is held at 0.8
    out = make_objective("cispo", clip_low=0.2)(_inputs(logprobs, [[-0.5, -2.0], [-0.5, -1.5]]))
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad[0], tensor([-0.8 * A / 4, -A / 4]), rtol=1e-5, atol=1e-7)
    logprobs.grad = None
    proximal = make_objective("cispo", ratio_to="proximal")(_inputs(logprobs, [[-0.5, -2.0], [-0.5, -1.5]]))
    proximal.loss.backward()  # r = 1 everywhere: plain REINFORCE with GRPO's advantages
    expected = tensor([[-A / 4, -A / 4], [A / 4, A / 4]])
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("name", "options", "field"), [
    ("gspo", {"ratio_to": "engine"}, "ratio_to"), ("gspo", {"clip_low": 1.5}, "clip_low"),
    ("cispo", {"clip_high": -0.1}, "clip_high"), ("cispo", {"clip_low": 1.2}, "clip_low")])
def test_bad_options_name_the_field(name: str, options: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_objective(name, **options)
