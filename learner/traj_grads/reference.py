"""Brute-force per-trajectory gradients: the test oracle for the OPOB gradient paths (debug only).

Deliberately independent of `learner/forward/packing.py` and `learner/forward/logprobs.py`: each
trajectory runs
alone through a plain `model(input_ids)` forward, its log-likelihood is formed from the full
log-softmax with the shift written out here, and `torch.autograd.grad` gives `g_i` as one flat
fp32 vector. Memory is `B × (trainable size)`: use it on tiny models only.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from learner.forward.packing import Aggregation, TrajectoryTokens, aggregation_weights
from learner.traj_grads.opob_grad import BaselineFn


@dataclass(frozen=True)
class ReferenceOpob:
    """The brute-force OPOB quantities, all over the model's trainable parameters."""

    flat_grads: Tensor
    """(B, P) fp32: `g_i = ∇ℓ_i`, parameters in `names` order, flattened and concatenated."""
    sq_norms: Tensor
    """(B,) fp32 `‖g_i‖²`."""
    baselines: dict[int, float]
    """`b*_g` returned by the callback."""
    param_grads: dict[str, Tensor]
    """`−Σ_g Σ_{i∈g} (a_i − b*_g s_i) g_i` per parameter name (what `.grad` should receive)."""


def trajectory_loglik(model: nn.Module, trajectory: TrajectoryTokens, aggregation: Aggregation) -> Tensor:
    """`ℓ = Σ_t c_t log π(y_t | y_<t)` of one unpacked trajectory (0-dim, differentiable): each of its
    segments a forward of its own (its context alone), the weights `c_t` over all of its loss tokens."""
    device = next(model.parameters()).device
    ids = torch.as_tensor(list(trajectory.token_ids), device=device)
    mask = torch.as_tensor(list(trajectory.loss_mask), dtype=torch.bool, device=device)
    if trajectory.token_weights is None:
        weights = aggregation_weights(mask, aggregation)
    else:
        weights = torch.as_tensor(list(trajectory.token_weights), dtype=torch.float32, device=device) * mask
    bounds = [*trajectory.segment_starts, len(trajectory.token_ids)]
    total = torch.zeros((), device=device)
    for start, end in itertools.pairwise(bounds):
        segment = ids[start:end].unsqueeze(0)
        logits = model(input_ids=segment, use_cache=False).logits[0].float()
        logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(-1, segment[0, 1:].unsqueeze(-1)).squeeze(-1)
        total = total + (logprobs * weights[start + 1:end]).sum()  # logits[t] predicts token t+1
    return total


def reference_opob_gradient(
    model: nn.Module,
    trajectories: Sequence[TrajectoryTokens],
    reward_coefs: Tensor,
    baseline_coefs: Tensor,
    baseline_fn: BaselineFn,
    aggregation: Aggregation = "mean",
) -> ReferenceOpob:
    """Per-trajectory `g_i` by autograd, then norms, baselines and the combination directly.

    `trajectories[i]` pairs with `reward_coefs[i]`, `baseline_coefs[i]`; `baseline_fn` is called
    once per group in order of first appearance. Does not touch `.grad`.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    rows = []
    for trajectory in trajectories:
        with torch.enable_grad():
            grads = torch.autograd.grad(
                trajectory_loglik(model, trajectory, aggregation), params, allow_unused=True
            )
        rows.append(
            torch.cat(
                [
                    (torch.zeros_like(p) if g is None else g).float().flatten()
                    for p, g in zip(params, grads, strict=True)
                ]
            )
        )
    flat_grads = torch.stack(rows)
    sq_norms = flat_grads.square().sum(1)
    group_ids = [t.group_id for t in trajectories]
    baselines: dict[int, float] = {}
    for group in dict.fromkeys(group_ids):
        members = torch.tensor([i for i, g in enumerate(group_ids) if g == group])
        baselines[group] = float(baseline_fn(group, members, sq_norms[members]))
    b = torch.tensor([baselines[g] for g in group_ids])
    combined = -((reward_coefs.float().cpu() - b * baseline_coefs.float().cpu()) @ flat_grads.cpu())
    param_grads, offset = {}, 0
    for name, param in named:
        param_grads[name] = combined[offset : offset + param.numel()].reshape(param.shape)
        offset += param.numel()
    return ReferenceOpob(flat_grads, sq_norms, baselines, param_grads)
