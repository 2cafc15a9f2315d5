"""The batch context (vcpo/objectives/base.py): an objective's loss evaluated on parts of a minibatch, with
the whole minibatch's context held fixed, sums to the loss of one call on the whole minibatch — value and
gradient — for every objective of the registry, however the rows are split (groups included)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from vcpo.corrections import (
    K3Rejection,
    OffPolicySequenceMasking,
    TokenRejection,
    TokenTruncation,
    correct_inputs,
)
from vcpo.objectives import BatchContext, PolicyLossInputs
from vcpo.registry import OBJECTIVES, make_objective

LENGTHS = [7, 2, 5, 3, 6, 0, 4, 7, 3]
"""Trained tokens per trajectory, left-aligned as the learner lays them out; trajectory 5 has none (a
task-filtered one: in its group's statistics, out of the loss)."""
GROUPS = [0, 0, 0, 1, 1, 1, 2, 2, 2]
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
SPLITS = [[0, 4, 8], [1, 2], [3, 5, 6, 7]]
"""Parts that cut through every group, so no part can compute a group statistic by itself."""
WIDTH = max(LENGTHS)


def _minibatch(seed: int = 0) -> tuple[PolicyLossInputs, torch.Tensor]:
    """A minibatch at a gradient point (π_old = π_θ in value) and the (fp64) leaf behind log π_θ.

    Behaviour log-probs are 0.3-noisy (M2PO masks tokens, BAPO moves its bounds, IS weights vary), the
    reference 0.2-noisy (the KL term has a gradient)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (len(LENGTHS), WIDTH)
    params = torch.randn(shape, generator=generator, dtype=torch.float64).requires_grad_(True)
    logprobs = torch.nn.functional.logsigmoid(params) - 0.5
    mask = torch.arange(WIDTH)[None, :] < torch.tensor(LENGTHS)[:, None]
    noise = torch.randn((2, *shape), generator=generator, dtype=torch.float64)
    inputs = PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=logprobs.detach(),
        behavior_logprobs=logprobs.detach() + 0.3 * noise[0],
        loss_mask=mask,
        rewards=torch.tensor(REWARDS),
        group_ids=torch.tensor(GROUPS),
        lags=torch.arange(len(LENGTHS)) % 3,
        ref_logprobs=logprobs.detach() + 0.2 * noise[1],
        seq_sq_grad_norms=torch.rand(len(LENGTHS), generator=generator, dtype=torch.float64) + 0.1,
        sum_probs_squared=0.2 + 0.5 * torch.rand(shape, generator=generator, dtype=torch.float64),
        entropy=params.sigmoid() * 2.0,
    )
    return inputs, params


def _rows(inputs: PolicyLossInputs, rows: list[int]) -> PolicyLossInputs:
    """The part `rows` of `inputs`, cut to its own longest trained length (as a learner micro-batch)."""
    index = torch.tensor(rows)
    width = max(1, max(LENGTHS[i] for i in rows))
    fields: dict[str, Any] = {}
    for name in PolicyLossInputs.__dataclass_fields__:
        value = getattr(inputs, name)
        if isinstance(value, torch.Tensor):
            value = value[index]
            value = value[:, :width] if value.dim() == 2 else value
        fields[name] = value
    return PolicyLossInputs(**fields)


def _select(context: BatchContext, rows: list[int]) -> BatchContext:
    return context.select(torch.tensor(rows), max(1, max(LENGTHS[i] for i in rows)))


CASES = [(name, {}) for name in sorted(OBJECTIVES)] + [
    ("grpo", {"loss_aggregation": "seq-mean-token-sum-norm", "kl_coef": 0.3}),  # N and the KL term
    ("grpo", {"loss_aggregation": "seq-mean-token-sum", "entropy_coef": 0.05}),
    ("dr_grpo", {"kl_coef": 0.3, "kl_estimator": "k2"}),
    ("mis", {"level": "sequence", "is_cap": 1.5}),
    ("tba", {"kl_coef": 0.3}),
    ("vcpo", {"form": "reference"}),
    ("otb", {"use_is_weights": False}),
]


@pytest.mark.parametrize(("name", "params"), CASES, ids=[f"{n}-{'-'.join(p) or 'default'}" for n, p in CASES])
def test_parts_with_the_whole_minibatch_context_sum_to_the_whole_minibatch(name: str, params: dict) -> None:
    objective = make_objective(name, **params)
    inputs, params_leaf = _minibatch()
    whole = objective(inputs).loss
    (want,) = torch.autograd.grad(whole, params_leaf, retain_graph=True)
    assert want.abs().max() > 1e-3  # a real gradient, not a vanishing one that would match anything

    context = objective.batch_context(inputs)
    assert not any(v.requires_grad for v in (*context.rows.values(), *context.shared.values()))
    losses = [objective(_rows(inputs, rows), _select(context, rows)).loss for rows in SPLITS]
    (got,) = torch.autograd.grad(sum(losses), params_leaf)
    # the objectives compute in fp32 (prepare_batch): only the summation order differs
    torch.testing.assert_close(sum(losses), whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["reinforce", "dr_grpo", "m2po", "bapo", "tba", "grpo"])
def test_parts_without_the_context_do_not_sum_to_the_whole_minibatch(name: str) -> None:
    """Why the context exists: each part alone takes its own batch statistics (for GRPO: its own group
    statistics of a cut group, and its own denominator)."""
    objective = make_objective(name)
    inputs, params_leaf = _minibatch()
    (want,) = torch.autograd.grad(objective(inputs).loss, params_leaf, retain_graph=True)
    alone = sum(objective(_rows(inputs, rows)).loss for rows in SPLITS)
    (got,) = torch.autograd.grad(alone, params_leaf)
    assert (got - want).abs().max() > 1e-3 * want.abs().max()


def test_a_whole_call_takes_its_context_from_its_own_inputs() -> None:
    """objective(inputs) = objective(inputs, objective.batch_context(inputs)): value, advantages, metrics."""
    for name in sorted(OBJECTIVES):
        objective = make_objective(name)
        inputs, _ = _minibatch(seed=1)
        plain, given = objective(inputs), objective(inputs, objective.batch_context(inputs))
        assert torch.equal(plain.loss, given.loss), name
        assert torch.equal(plain.advantages, given.advantages), name
        assert plain.metrics.keys() == given.metrics.keys(), name
        for key, value in plain.metrics.items():
            # bit for bit; an empty staleness bin's NaN equals itself
            same = torch.allclose(value, given.metrics[key], rtol=0, atol=0, equal_nan=True)
            assert same, (name, key)


def test_select_takes_the_rows_in_order_and_fits_per_token_values_to_the_width() -> None:
    context = BatchContext(
        size=3,
        num_units=torch.tensor(7),
        token_sum_normalizer=4.0,
        rows={"a": torch.tensor([10.0, 11.0, 12.0]), "t": torch.arange(12.0).view(3, 4)},
        shared={"s": torch.tensor(2.5)},
    )
    narrow = context.select(torch.tensor([2, 0]), width=2)
    assert narrow.size == 2 and narrow.num_units == 7 and narrow.token_sum_normalizer == 4.0
    assert narrow.rows["a"].tolist() == [12.0, 10.0]
    assert narrow.rows["t"].tolist() == [[8.0, 9.0], [0.0, 1.0]]
    assert narrow.shared == context.shared
    wide = context.select(torch.tensor([1]), width=6)
    assert wide.rows["t"].tolist() == [[4.0, 5.0, 6.0, 7.0, 0.0, 0.0]]


def test_a_context_of_other_rows_is_refused() -> None:
    objective = make_objective("grpo")
    inputs, _ = _minibatch()
    context = objective.batch_context(inputs)
    with pytest.raises(ValueError, match=r"context\.select"):
        objective(_rows(inputs, [0, 1]), context)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_parts_of_a_corrected_minibatch_with_its_context_sum_to_the_whole(name: str) -> None:
    """The corrections run once on the whole minibatch (OPSM's group means need every member); each part
    then takes its rows of the kept mask, the truncation's weights and the rejected flags."""
    objective = make_objective(name)
    stages = [TokenRejection(0.75, 1.35), K3Rejection(0.05), OffPolicySequenceMasking(0.01)]
    if objective.accepts_token_weights:
        stages.append(TokenTruncation(1.5))
    inputs, params_leaf = _minibatch()
    corrected, correction = correct_inputs(stages, inputs)
    assert correction.rejected.any() and 0 < correction.metrics["correction/rejected_tokens"] < 0.7
    whole = objective(corrected).loss
    (want,) = torch.autograd.grad(whole, params_leaf, retain_graph=True)
    assert want.abs().max() > 1e-3
    context = objective.batch_context(corrected)
    losses = [objective(_rows(corrected, rows), _select(context, rows)).loss for rows in SPLITS]
    (got,) = torch.autograd.grad(sum(losses), params_leaf)
    torch.testing.assert_close(sum(losses), whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


DEGENERATE = [0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 0.7, 0.7, 0.0]
"""Group 0 scored alike (0.1, not exact in float32); group 1 mixed; group 2 mixed."""


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_a_degenerate_groups_gradient_is_exactly_zero_where_the_objective_says_so(name: str) -> None:
    """`silent_when_degenerate` lets the learner leave a degenerate group out of the gradient pass: where an
    objective claims it, the group's rows get an exactly zero gradient under noisy behaviour and reference
    log-probs while the other groups get a real one; where it does not claim it, no check (REINFORCE, OTB,
    TBA, VCPO's own coefficients decide for it)."""
    objective = make_objective(name)
    inputs, leaf_params = _minibatch(seed=3)
    inputs = dataclasses.replace(inputs, rewards=torch.tensor(DEGENERATE))
    (grad,) = torch.autograd.grad(objective(inputs).loss, leaf_params, retain_graph=True)
    if not objective.silent_when_degenerate:
        return
    assert float(grad[:3].abs().max()) == 0.0
    on_policy = dataclasses.replace(inputs, behavior_logprobs=inputs.old_logprobs)  # nothing clipped (GSPO)
    (grad,) = torch.autograd.grad(objective(on_policy).loss, leaf_params)
    assert float(grad[:3].abs().max()) == 0.0 and float(grad[3:].abs().max()) > 1e-4
    with_kl = make_objective(name, kl_coef=0.1)
    assert not with_kl.silent_when_degenerate  # a KL term has a gradient on every group


def test_the_claim_is_not_made_where_a_degenerate_group_has_a_gradient() -> None:
    """The check above can fail: REINFORCE's minibatch baseline gives an alike group a gradient, and it
    does not claim the property."""
    objective = make_objective("reinforce")
    inputs, leaf_params = _minibatch(seed=3)
    inputs = dataclasses.replace(inputs, rewards=torch.tensor(DEGENERATE))
    (grad,) = torch.autograd.grad(objective(inputs).loss, leaf_params)
    assert float(grad[:3].abs().max()) > 1e-4 and not objective.silent_when_degenerate
    claimed = sorted(n for n in OBJECTIVES if make_objective(n).silent_when_degenerate)
    assert claimed == ["bapo", "cispo", "dr_grpo", "grpo", "gspo", "m2po", "mis", "rloo", "seq_tis",
                       "token_tis"]
