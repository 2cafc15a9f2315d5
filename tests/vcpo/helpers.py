"""Small builders shared by the vcpo tests (no fixtures with hidden state)."""

from __future__ import annotations

import torch

from vcpo.objectives import PolicyLossInputs


def tensor(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def leaf(values) -> torch.Tensor:
    """A float32 leaf that requires grad, standing for the policy's log-probs."""
    return torch.tensor(values, dtype=torch.float32, requires_grad=True)


def simple_inputs(
    logprobs: torch.Tensor,
    rewards,
    group_ids,
    *,
    old_logprobs=None,
    behavior_logprobs=None,
    loss_mask=None,
    **optional,
) -> PolicyLossInputs:
    """Inputs where unspecified old/behaviour log-probs equal the current ones (ratio 1)."""
    base = logprobs.detach()
    return PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=base.clone() if old_logprobs is None else old_logprobs,
        behavior_logprobs=base.clone() if behavior_logprobs is None else behavior_logprobs,
        loss_mask=torch.ones(logprobs.shape, dtype=torch.bool) if loss_mask is None else loss_mask,
        rewards=tensor(rewards),
        group_ids=torch.tensor(group_ids, dtype=torch.long),
        **optional,
    )


def random_inputs(seed: int = 0, batch: int = 8, length: int = 6, group_size: int = 4) -> tuple:
    """A random minibatch with every optional field, and the leaf parameters behind log π_θ."""
    generator = torch.Generator().manual_seed(seed)
    params = torch.randn(batch, length, generator=generator).requires_grad_(True)
    logprobs = torch.nn.functional.logsigmoid(params)
    old = logprobs.detach() + 0.05 * torch.randn(batch, length, generator=generator)
    behavior = old + 0.3 * torch.randn(batch, length, generator=generator)
    mask = torch.rand(batch, length, generator=generator) > 0.2
    mask[:, 0] = True
    inputs = PolicyLossInputs(
        logprobs=logprobs,
        old_logprobs=old,
        behavior_logprobs=behavior,
        loss_mask=mask,
        rewards=torch.tensor([1.0, 0.0] * (batch // 2)),
        group_ids=torch.arange(batch) // group_size,
        lags=torch.randint(0, 6, (batch,), generator=generator),
        ref_logprobs=old - 0.1,
        seq_sq_grad_norms=torch.rand(batch, generator=generator) + 0.1,
        sum_probs_squared=0.2 + 0.5 * torch.rand(batch, length, generator=generator),
        entropy=torch.rand(batch, length, generator=generator) * params.sigmoid(),
    )
    return inputs, params
