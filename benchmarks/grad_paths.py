"""Micro-benchmark of the OPOB gradient paths against a plain packed step (for `vcpo bench opob`).

On the same packed micro-batches it times (a) a plain step — packed forward and ordinary
autograd backward of `Σ_i a_i ℓ_i`, the cost of a GRPO-style update — (b) the packed OPOB path
and (c) the per-trajectory reference path, each as the median of `repeats` runs after `warmup`
runs, interleaved round-robin, gradients reset to None before every run. It measures; it does
not check results (the tests do) and prints nothing.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from learner.forward.logprobs import packed_target_logprobs
from learner.forward.packing import PackedMicroBatch, TrajectoryTokens, pack_trajectories
from learner.traj_grads.opob_grad import accumulate_opob_grad_packed, accumulate_opob_grad_per_trajectory


def synthetic_microbatches(
    vocab_size: int,
    num_trajectories: int,
    length: int,
    group_size: int,
    max_tokens: int,
    prompt_fraction: float = 0.25,
    seed: int = 0,
) -> list[PackedMicroBatch]:
    """Random-token trajectories of `length` tokens (the first `prompt_fraction` masked out), in
    groups of `group_size`, packed with a `max_tokens` budget."""
    rng = random.Random(seed)
    prompt = max(1, int(length * prompt_fraction))
    trajectories = [
        TrajectoryTokens(
            [rng.randrange(vocab_size) for _ in range(length)],
            [False] * prompt + [True] * (length - prompt),
            group_id=i // group_size,
        )
        for i in range(num_trajectories)
    ]
    return pack_trajectories(trajectories, max_tokens=max_tokens)


def _interleaved_medians(
    runs: dict[str, Callable[[], object]],
    model: nn.Module,
    repeats: int,
    warmup: int,
    clock: Callable[[], float],
) -> dict[str, float]:
    """Median seconds per run, timed round-robin so a busy neighbour on a shared machine biases
    every path alike; gradients are reset to None before each run."""
    device = next(model.parameters()).device
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(warmup + repeats):
        for name, run in runs.items():
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = clock()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if round_index >= warmup:
                times[name].append(clock() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _plain_step(model: nn.Module, microbatches: Sequence[PackedMicroBatch], reward_coefs: Tensor) -> None:
    for batch in microbatches:
        token_coefs = reward_coefs[batch.trajectory_indices][batch.token_trajectory] * batch.target_weights
        logprobs = packed_target_logprobs(model, batch)
        (-(logprobs * token_coefs[batch.target_positions]).sum()).backward()


def time_grad_paths(
    model: nn.Module,
    microbatches: Sequence[PackedMicroBatch],
    *,
    repeats: int = 3,
    warmup: int = 1,
    include_per_trajectory: bool = True,
    dense_cost_flops: float | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """Median seconds of the plain step, the packed path and (optionally) the per-trajectory path.

    `microbatches` must be on the model's device and hold trajectory indices `0..B−1`.
    Coefficients are fixed pseudo-VCPO values and the baseline is the real weighted-mean `b*`.
    Returns `plain_s`, `packed_s`, `packed_over_plain` and, if timed, `per_trajectory_s`,
    `per_trajectory_over_packed`. Leaves `.grad` of the last run in place. `clock`: wall time by
    default; `time.process_time` with one intra-op thread is far less sensitive to neighbours on
    a shared CPU machine (meaningless on GPU, where the work is not this process's CPU time).
    """
    count = sum(batch.num_trajectories for batch in microbatches)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(0)
    weights = (torch.rand(count, generator=generator) + 0.5).to(device)
    rewards = torch.randint(0, 2, (count,), generator=generator).float().to(device)
    reward_coefs, baseline_coefs = weights * rewards / count, weights / count

    def baseline(group: int, members: Tensor, sq_norms: Tensor) -> float:
        importance = weights[members] ** 2 * sq_norms
        return float((importance * rewards[members]).sum() / importance.sum().clamp(min=1e-30))

    runs: dict[str, Callable[[], object]] = {
        "plain_s": lambda: _plain_step(model, microbatches, reward_coefs),
        "packed_s": lambda: accumulate_opob_grad_packed(
            model, microbatches, reward_coefs, baseline_coefs, baseline, dense_cost_flops=dense_cost_flops
        ),
    }
    if include_per_trajectory:
        runs["per_trajectory_s"] = lambda: accumulate_opob_grad_per_trajectory(
            model, microbatches, reward_coefs, baseline_coefs, baseline
        )
    result = _interleaved_medians(runs, model, repeats, warmup, clock)
    result["packed_over_plain"] = result["packed_s"] / result["plain_s"]
    if include_per_trajectory:
        result["per_trajectory_over_packed"] = result["per_trajectory_s"] / result["packed_s"]
    return result
