"""The OPOB gradient with exact per-trajectory gradient norms: a fast packed path and the reference.

For a minibatch of `B` trajectories in groups, with `g_i = ∇_θ ℓ_i` over all trainable
parameters, caller-given coefficients `a_i`, `s_i` (VCPO: `a_i = w̄_i R_i/(σ_g B)`,
`s_i = w̄_i/(σ_g B)`) and a callback turning a group's `‖g_i‖²` into its baseline `b*_g`, both
entry points compute

    sq_norms[i] = ‖g_i‖²   (fp32)                 baselines[g] = baseline_fn(g, members, ‖g‖²)
    param.grad += −Σ_g Σ_{i∈g} (a_i − b*_g s_i) g_i

(minus: optimizers minimise; this is ascent on `ĝ = Σ_i w̄_i (R_i − b*_g)/σ_g · ∇ℓ_i / B`).
Both keep `A = Σ a_i g_i` (in `.grad`, negated) and one `S_g = Σ s_i g_i` per *open* group, and
on a group's completion subtract `b*_g S_g` (`learner/traj_grads/buffers.py`).

* `accumulate_opob_grad_per_trajectory` — one forward/backward per trajectory; any model.
* `accumulate_opob_grad_packed` — one forward and ONE backward per packed micro-batch with
  per-module hooks (`learner/traj_grads/hooks.py`); costs about a plain packed step.

Memory bound for `S_g`: (groups holding a buffer at once) × (trainable parameter size);
`OpobGradResult.max_open_groups` reports the peak. A group is open from its first trajectory's
backward until its last one's; with group-aligned packing (`learner/forward/packing.py`) at most one
group is open across a micro-batch boundary. Inside a micro-batch the packed path needs `S_g`
only for parameters where some member took the dense route (trajectories longer than the
Gram/dense break-even, `learner/traj_grads/handlers.py`): then every group of the micro-batch
may hold one. `dense_cost_flops=math.inf` forces the Gram route and bounds the count by the
groups open across boundaries (≤ 1 with group-aligned packing) at a higher cost for long
trajectories.

With sharded parameters (FSDP/TP) the norms computed here are per-shard partial sums:
`baseline_fn` — called on every rank in the same order, once per group — is the place to
all-reduce them (`rank_sq_norm` gives this rank's share: replicated parameters counted on one rank
only, copies of a tied weight summed before squaring; `learner/backends/megatron/learner.py` does both).
Nothing here communicates unless `rank_sq_norm` does.

Only the policy-gradient term is here. A KL term of the loss is back-propagated by the learner on its own,
into `.grad` next to `A` (`TorchLearner._regularizer_gradient`): it is not part of any `g_i`, so it
neither enters `‖g_i‖²` nor moves `b*_g` — the baseline that minimises the variance of the
policy-gradient estimator, which a baseline-free regulariser does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from learner.forward.logprobs import autocast, head_chunk_plan, packed_target_logprobs, trajectory_logliks
from learner.forward.packing import PackedMicroBatch
from learner.traj_grads.buffers import GroupBuffers, grad_of
from learner.traj_grads.handlers import ApplyPlan, MicroBatchState
from learner.traj_grads.hooks import PackedGradHooks
from rollout.types import DEFAULT_TEMPERATURE

BaselineFn = Callable[[int, Tensor, Tensor], float]
"""`baseline_fn(group_id, member_indices (m,) long ascending, sq_norms (m,) fp32) -> b*_g`.
Called exactly once per group, as soon as the last member's norm is complete."""

CoefficientsFn = Callable[[int, Tensor], tuple[Tensor, Tensor]]
"""`coefficients(m, log_probs) -> (a, s)`: micro-batch m's (n,) coefficients from its forward's (K,) target
log-probs (`accumulate_opob_grad_packed`)."""

RankSqNorm = Callable[[Sequence[nn.Parameter], Sequence[Tensor]], Tensor]
"""`rank_sq_norm(params, grads) -> ()` fp32: this rank's share of one trajectory's `‖g_i‖²`."""

TrajectoryGrads = Callable[[PackedMicroBatch, list[nn.Parameter]], list[Tensor]]
"""`trajectory_grads(one-trajectory micro-batch, params) -> ∇ℓ` for those params (zeros where unused)."""


def squared_sum(grads: Sequence[Tensor], device: torch.device | None = None) -> Tensor:
    """`Σ ‖grad‖²` in fp32 over `grads`; a 0 on `device` (default CPU) when there are none."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack([g.float().square().sum() for g in grads]).sum()


def sum_sq_norm(params: Sequence[nn.Parameter], grads: Sequence[Tensor]) -> Tensor:
    """The default `RankSqNorm`: every parameter counted, no communication."""
    return squared_sum(grads, params[0].device if params else None)


DENSE_COST_FLOPS: dict[tuple[str, torch.dtype | None], float] = {
    ("cpu", None): 64.0,
    ("cpu", torch.bfloat16): 1024.0,
    ("cuda", None): 2048.0,
}
"""Default price, in GEMM flops, of one element of the memory-bound passes (norm + two axpys)
that materialising a per-trajectory weight gradient costs; decides Gram vs dense per layer.
Keyed by (device type, autocast dtype; None: the weights' dtype). CPU fp32: ~0.5 ns/element at
~130 GFLOP/s (measured, 2 cores). CPU bf16: the Gram products run at the bf16 GEMM's speed (~6×
fp32's with AMX) while the memory passes do not get faster; 1024 was the best of 64–∞ at the
default run's shape (docs/performance.md). GPU: HBM bandwidth vs tensor cores."""


def default_dense_cost_flops(device: torch.device, autocast_dtype: torch.dtype | None) -> float:
    """`DENSE_COST_FLOPS` for this device and compute dtype (the device's fp32 price, else 2048)."""
    key = (device.type, autocast_dtype)
    if key in DENSE_COST_FLOPS:
        return DENSE_COST_FLOPS[key]
    return DENSE_COST_FLOPS.get((device.type, None), 2048.0)


@dataclass(frozen=True)
class OpobGradResult:
    """What one OPOB gradient accumulation produced besides `.grad`."""

    sq_norms: Tensor
    """(B,) fp32: `‖∇_θ ℓ_i‖²` over all trainable parameters."""
    baselines: dict[int, float]
    """`b*_g` per group id, as returned by `baseline_fn`."""
    max_open_groups: int
    """Most `S_g` buffers alive at once (peak extra memory ≈ this × trainable parameter size)."""


@dataclass(frozen=True)
class _GroupSchedule:
    """Members of each group and where (micro-batch, packed index) its last trajectory sits."""

    members: dict[int, Tensor]
    last: dict[int, tuple[int, int]]

    @staticmethod
    def build(microbatches: Sequence[PackedMicroBatch], reward_coefs: Tensor,
              baseline_coefs: Tensor) -> _GroupSchedule:
        """A trajectory may be left out only with both coefficients zero (another data-parallel rank's:
        its norm is then reported as 0)."""
        num_trajectories = reward_coefs.shape[0]
        seen: dict[int, int] = {}
        members: dict[int, list[int]] = {}
        last: dict[int, tuple[int, int]] = {}
        for m, batch in enumerate(microbatches):
            for j, (index, group) in enumerate(
                zip(batch.trajectory_indices.tolist(), batch.group_ids.tolist(), strict=True)
            ):
                if not 0 <= index < num_trajectories or index in seen:
                    raise ValueError(
                        f"trajectory index {index} (micro-batch {m}) is outside [0, {num_trajectories}) "
                        "or appears twice; every minibatch trajectory must be packed exactly once and the "
                        "coefficient tensors must have one entry per trajectory"
                    )
                seen[index] = group
                members.setdefault(group, []).append(index)
                last[group] = (m, j)
        if len(seen) != num_trajectories:
            live = ((reward_coefs != 0) | (baseline_coefs != 0)).nonzero().flatten().tolist()
            missing = sorted(set(live) - set(seen))
            if missing:
                raise ValueError(f"trajectories {missing[:8]} have coefficients but are in no micro-batch")
        return _GroupSchedule({g: torch.tensor(sorted(ix)) for g, ix in members.items()}, last)

    def closing_after(self, microbatch: int) -> list[int]:
        return [g for g, (m, _) in self.last.items() if m == microbatch]


def _check_coefs(reward_coefs: Tensor, baseline_coefs: Tensor) -> int:
    if reward_coefs.ndim != 1 or reward_coefs.shape != baseline_coefs.shape:
        raise ValueError(
            f"reward_coefs {tuple(reward_coefs.shape)} and baseline_coefs {tuple(baseline_coefs.shape)} "
            "must both be (B,), one entry per minibatch trajectory"
        )
    return reward_coefs.numel()


def _baseline(baseline_fn: BaselineFn, group: int, members: Tensor, sq_norms: Tensor) -> float:
    index = members.to(sq_norms.device)
    return float(baseline_fn(group, index, sq_norms[index]))


def _close_group(
    buffers: GroupBuffers, group: int, baseline: float, target: Callable[[nn.Parameter], Tensor]
) -> None:
    """`target(p) += b*_g S_g[p]` for every buffer of the group, then free them."""
    for param, buffer in buffers.pop(group).items():
        target(param).add_(buffer, alpha=baseline)


def accumulate_opob_grad_packed(
    model: nn.Module,
    microbatches: Sequence[PackedMicroBatch],
    reward_coefs: Tensor,
    baseline_coefs: Tensor,
    baseline_fn: BaselineFn,
    *,
    dense_cost_flops: float | None = None,
    autocast_dtype: torch.dtype | None = None,
    temperature: float = DEFAULT_TEMPERATURE,
    coefficients_from_logprobs: CoefficientsFn | None = None,
    hooks_class: type[PackedGradHooks] = PackedGradHooks,
    logits_chunk_mib: float | None = None,
) -> OpobGradResult:
    """OPOB gradient on packed micro-batches: one forward and one backward each, exact norms.

    `microbatches` (on the model device) hold each of the `B` trajectories once;
    `reward_coefs`/`baseline_coefs`: (B,) `a_i`/`s_i`, indexed by `trajectory_indices`.
    `dense_cost_flops` overrides `DENSE_COST_FLOPS` for the model's device and compute dtype.
    `autocast_dtype`: run the forwards under autocast in that dtype (weight gradients are then taken in
    it, as autograd's would be, and accumulated in the weights' dtype; norms are summed in fp32).
    `temperature`: the behaviour policy's sampling temperature T — ℓ_i is of softmax(logits / T), as in
    the proximal pass whose log-probs make the IS weights. `coefficients_from_logprobs(m, log_probs)`:
    when given, micro-batch `m`'s `a_j`, `s_j` come from it, called with the log-probs of that
    micro-batch's own forward (detached) before its backward — the coefficient tensors passed in are then
    only placeholders (zeros); the callback keeps the log-probs it needs (`learner.proximal: reuse`).
    `hooks_class`: what hooks `model`'s layers — `PackedGradHooks` for an HF causal LM; a backend with
    layers of its own passes its subclass (learner/backends/megatron/packed_grads.py).
    `logits_chunk_mib`: the output head in chunks of target rows where its logits would pass this many MiB
    (`learner.logits_chunk_mib`; None: never).
    Raises `UnsupportedParameterError` (naming them) if some trainable parameter has no hook. Hooks and
    `requires_grad` flags are always restored; after an exception `.grad` is partial.
    """
    num_trajectories = _check_coefs(reward_coefs, baseline_coefs)
    schedule = _GroupSchedule.build(microbatches, reward_coefs, baseline_coefs)
    hooks = hooks_class(model, autocast_dtype, temperature, logits_chunk_mib)
    cost = (dense_cost_flops if dense_cost_flops is not None
            else default_dense_cost_flops(hooks.device, autocast_dtype))
    sq_norms = torch.zeros(num_trajectories, dtype=torch.float32, device=hooks.device)
    buffers, baselines = GroupBuffers(), {}
    with hooks:
        for m, batch in enumerate(microbatches):
            local = batch.trajectory_indices
            state = MicroBatchState(
                batch=batch,
                reward_coefs=reward_coefs[local].float(),
                baseline_coefs=baseline_coefs[local].float(),
                buffers=buffers,
                dense_cost_flops=cost,
                vocab_size=hooks.vocab_size,
                closing_groups=frozenset(schedule.closing_after(m)),
            )
            after_forward = None
            if coefficients_from_logprobs is not None:
                def after_forward(logprobs: Tensor, m: int = m, state: MicroBatchState = state,
                                  coefficients: CoefficientsFn = coefficients_from_logprobs) -> None:
                    reward, baseline = coefficients(m, logprobs.float())
                    state.set_coefficients(reward.float(), baseline.float())

            hooks.backward(state, after_forward)
            sq_norms[local] = state.sq_norms
            closing = schedule.closing_after(m)
            for group in closing:
                baselines[group] = _baseline(baseline_fn, group, schedule.members[group], sq_norms)
            hooks.apply(_apply_plan(state, closing, baselines))
            for group in closing:
                _close_group(buffers, group, baselines[group], grad_of)
    return OpobGradResult(sq_norms, baselines, buffers.max_open_groups)


def _apply_plan(state: MicroBatchState, closing: list[int], baselines: dict[int, float]) -> ApplyPlan:
    """`grad_coefs_j = −(a_j − b_j s_j)` with `b_j = b*_g` if `j`'s group closed, else 0 (→ `−a_j`)."""
    groups = state.group_of
    b = torch.tensor([baselines[g] if g in closing else 0.0 for g in groups], device=state.device)
    grad_coefs = -(state.reward_coefs - b * state.baseline_coefs)
    open_members: dict[int, list[int]] = {}
    for j, g in enumerate(groups):
        if g not in closing:
            open_members.setdefault(g, []).append(j)
    return ApplyPlan(grad_coefs, tuple((g, tuple(js)) for g, js in open_members.items()))


def _trajectory_grads(model: nn.Module, single: PackedMicroBatch, params: list[nn.Parameter],
                      autocast_dtype: torch.dtype | None = None,
                      temperature: float = DEFAULT_TEMPERATURE, logits_chunk_mib: float | None = None
                      ) -> list[Tensor]:
    """`∇ℓ` of a one-trajectory micro-batch for `params` by plain autograd (zeros where unused)."""
    if single.target_positions.numel() == 0:
        return [torch.zeros_like(p) for p in params]
    with torch.enable_grad():
        with autocast(single.input_ids.device, autocast_dtype):
            logprobs = packed_target_logprobs(model, single, temperature=temperature,
                                              chunks=head_chunk_plan(model, single, logits_chunk_mib))
        loglik = trajectory_logliks(logprobs, single)[0]
        grads = torch.autograd.grad(loglik, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)]


def accumulate_opob_grad_per_trajectory(
    model: nn.Module,
    microbatches: Sequence[PackedMicroBatch],
    reward_coefs: Tensor,
    baseline_coefs: Tensor,
    baseline_fn: BaselineFn,
    *,
    rank_sq_norm: RankSqNorm | None = None,
    autocast_dtype: torch.dtype | None = None,
    temperature: float = DEFAULT_TEMPERATURE,
    logits_chunk_mib: float | None = None,
    trajectory_grads: TrajectoryGrads | None = None,
) -> OpobGradResult:
    """The reference OPOB gradient: one forward/backward per trajectory, two buffers.

    Same inputs and result as `accumulate_opob_grad_packed`; works for any model whose trainable
    parameters autograd reaches. Per trajectory: `A += a_i g_i`, `S_g += s_i g_i`, and after a
    group's last member `A −= b*_g S_g`; finally `.grad += −A`. Exact but slow: a full-size norm
    and two full-size axpys per trajectory, and short sequences use the hardware poorly.
    `rank_sq_norm(params, grads)`: this rank's share of `‖g_i‖²` from its parameters and their
    gradients for trajectory i (default: `Σ ‖grad‖²` over all of them), called once per trajectory
    in the same order on every rank; with model parallelism the shares over the ranks must sum to
    the whole norm (module docstring). `temperature`, `logits_chunk_mib`: as in
    `accumulate_opob_grad_packed`. `trajectory_grads`: how one trajectory's `∇ℓ` is computed (default:
    `torch.autograd.grad` of its log-likelihood; a backend whose graph `autograd.grad` cannot run through
    passes its own). `.grad` is left untouched if it raises.
    """
    num_trajectories = _check_coefs(reward_coefs, baseline_coefs)
    schedule = _GroupSchedule.build(microbatches, reward_coefs, baseline_coefs)
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    ascent = {p: torch.zeros_like(p) for p in params}
    device = params[0].device if params else reward_coefs.device
    sq_norms = torch.zeros(num_trajectories, dtype=torch.float32, device=device)
    buffers, baselines = GroupBuffers(), {}

    def autograd_grads(single: PackedMicroBatch, params: list[nn.Parameter]) -> list[Tensor]:
        return _trajectory_grads(model, single, params, autocast_dtype, temperature, logits_chunk_mib)

    gradients = trajectory_grads or autograd_grads
    for m, batch in enumerate(microbatches):
        for j in range(batch.num_trajectories):
            index, group = int(batch.trajectory_indices[j]), int(batch.group_ids[j])
            grads = gradients(batch.select(j), params)
            sq_norms[index] = (rank_sq_norm or sum_sq_norm)(params, grads)
            reward_coef, baseline_coef = float(reward_coefs[index]), float(baseline_coefs[index])
            for param, grad in zip(params, grads, strict=True):
                ascent[param].add_(grad, alpha=reward_coef)
                buffers.add(group, param, grad, baseline_coef)
            if schedule.last[group] == (m, j):
                baselines[group] = _baseline(baseline_fn, group, schedule.members[group], sq_norms)
                _close_group(buffers, group, -baselines[group], ascent.__getitem__)
    for param in params:
        grad_of(param).sub_(ascent[param])
    return OpobGradResult(sq_norms, baselines, buffers.max_open_groups)
