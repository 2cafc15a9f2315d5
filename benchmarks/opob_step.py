"""`vcpo bench opob`: the cost of a VCPO optimizer step next to a plain GRPO step, same batch.

For each trajectory length it builds one packed minibatch (two prompt groups, random tokens, the
first `prompt_fraction` of each trajectory masked out, behaviour log-probs = the model's own
perturbed by noise so IS weights are non-trivial, binary rewards with both values in each group)
and times, interleaved round-robin after a warm-up, three complete optimizer steps:

* `grpo`: packed forward, the registry's GRPO objective (clip-higher + dual clip), ordinary
  autograd backward, grad-norm clip, AdamW step;
* `vcpo_fast`: IS weights and ESS step size from the proximal log-probs, VCPO's two-buffer
  coefficients, exact per-trajectory gradient norms on packed micro-batches with hooks, b* per
  group (OPOB), clip, AdamW step at the ESS-scaled lr;
* `vcpo_per_trajectory`: the same with one backward per trajectory (the reference path).

The proximal (old) log-probs come from one no-grad forward that every async objective needs anyway
(the staleness/IS metrics of docs/algorithm.md compare π_old with μ for all of them); it is timed once and
reported separately, not added to either step, so the ratio is the conservative one.
Attention: the packing-aware per-trajectory sdpa kernel (`learner.forward.varlen_attention`) so no N×N
mask is built. It measures; the tests check the results.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.schema import OpobBenchConfig
from learner.forward.logprobs import packed_target_logprobs
from learner.forward.packing import PackedMicroBatch, TargetPadding, TrajectoryTokens, pack_trajectories
from learner.forward.varlen_attention import register_varlen_sdpa
from learner.traj_grads.opob_grad import accumulate_opob_grad_packed, accumulate_opob_grad_per_trajectory
from run.launch.host import host_description
from run.train.learner_setup import learner_device
from vcpo.groups import group_std, index_groups
from vcpo.is_weights import ess_ratio, sequence_is_weights, truncated_is_weights
from vcpo.objectives import PolicyLossInputs
from vcpo.opob import opob_baseline_weights, vcpo_coefficients
from vcpo.registry import make_objective
from vcpo.step_size import ess_lr_scale_sqrt

_SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
_TINY_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
IS_CAP = 8.0
LR = 1e-6


def build_bench_model(spec: str, cache_dir: Path, seed: int) -> nn.Module:
    """'tiny-smollm2-shape' / 'tiny' (random weights) or any model spec (e.g. 'default'), fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout.models import load_causal_lm

    attention = register_varlen_sdpa()
    shapes = {"tiny-smollm2-shape": _SMOLLM2_SHAPE, "tiny": _TINY_SHAPE}
    if spec in shapes:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**shapes[spec], attn_implementation=attention))
    else:
        model = load_causal_lm(spec, cache_dir)
        model.set_attn_implementation(attention)
    return model.train()


def _batch(vocab: int, config: OpobBenchConfig, length: int) -> tuple[list[TrajectoryTokens], Tensor]:
    rng = random.Random(config.seed + length)
    group_size = config.num_trajectories // 2
    prompt = max(1, int(length * config.prompt_fraction))
    trajectories = [
        TrajectoryTokens([rng.randrange(vocab) for _ in range(length)],
                         [False] * prompt + [True] * (length - prompt), group_id=i // group_size)
        for i in range(config.num_trajectories)
    ]
    # binary rewards, both values present in every group (no degenerate group in a cost benchmark)
    rewards = torch.tensor([float(i % 2) for i in range(config.num_trajectories)])
    return trajectories, rewards


class _Steps:
    """The three optimizer steps on one minibatch (shared model and AdamW)."""

    def __init__(self, model: nn.Module, microbatches: Sequence[PackedMicroBatch], rewards: Tensor) -> None:
        self.model, self.microbatches, self.rewards = model, microbatches, rewards
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        self.groups = index_groups(torch.cat([mb.group_ids for mb in microbatches]))
        self.size = rewards.numel()
        self.grpo = make_objective("grpo")
        with torch.no_grad():
            self.old = [packed_target_logprobs(model, mb).float() for mb in microbatches]
        generator = torch.Generator().manual_seed(0)
        self.behavior = [old + 0.05 * torch.randn(old.shape, generator=generator).to(old.device, old.dtype)
                         for old in self.old]
        self.log_w = torch.cat([self._seq_sum(old - beh, mb) for old, beh, mb
                                in zip(self.old, self.behavior, microbatches, strict=True)])
        self.padding = [TargetPadding(mb) for mb in microbatches]
        self.padded_old = [pad(old) for pad, old in zip(self.padding, self.old, strict=True)]
        self.padded_behavior = [pad(beh) for pad, beh in zip(self.padding, self.behavior, strict=True)]

    @staticmethod
    def _seq_sum(token_values: Tensor, mb: PackedMicroBatch) -> Tensor:
        # L_i = Σ_{t∈M_i} (log π_old − log μ): every target is a loss token
        return torch.stack([chunk.sum() for chunk in token_values.split(list(mb.target_counts))])

    def old_forward(self) -> None:
        with torch.no_grad():
            for mb in self.microbatches:
                packed_target_logprobs(self.model, mb)

    def _finish(self, lr_scale: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = LR * lr_scale
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def grpo_step(self) -> None:
        for index, mb in enumerate(self.microbatches):
            pad = self.padding[index]
            inputs = PolicyLossInputs(
                logprobs=pad(packed_target_logprobs(self.model, mb)), old_logprobs=self.padded_old[index],
                behavior_logprobs=self.padded_behavior[index], loss_mask=pad.mask,
                rewards=self.rewards[mb.trajectory_indices], group_ids=mb.group_ids,
                num_units=float(self.size))
            self.grpo(inputs).loss.backward()
        self._finish(1.0)

    def vcpo_step(self, accumulate: Callable[..., Any]) -> None:
        valid = torch.ones(self.size, dtype=torch.bool, device=self.rewards.device)
        weights = sequence_is_weights(self.log_w)
        truncated = truncated_is_weights(weights, IS_CAP)
        sigma = group_std(self.rewards, valid, self.groups)[self.groups.index]
        coefs = vcpo_coefficients(truncated, self.rewards, sigma, valid, self.size)

        def baseline(group: int, members: Tensor, sq_norms: Tensor) -> float:
            omega = opob_baseline_weights(sq_norms, weights[members])  # ω_i = w_i² ‖∇ℓ_i‖²
            return float((omega * self.rewards[members].double()).sum() / omega.sum().clamp_min(1e-300))

        accumulate(self.model, self.microbatches, coefs.reward_coef.float(), coefs.baseline_coef.float(),
                   baseline)
        self._finish(float(ess_lr_scale_sqrt(ess_ratio(self.log_w), base_ess_ratio=1.0)))


def _median_times(runs: dict[str, Callable[[], None]], repeats: int, warmup: int,
                  device: torch.device) -> dict[str, float]:
    def synchronize() -> None:  # CUDA kernels run asynchronously: time them to their end
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_index in range(warmup + repeats):
        for name, run in runs.items():
            synchronize()
            start = time.perf_counter()
            run()
            synchronize()
            if round_index >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def run_opob_bench(config: OpobBenchConfig, cache_dir: Path,
                   progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Measure every configured length; returns the JSON-able table with ratios and targets."""
    device = torch.device(learner_device(config.device))
    model = build_bench_model(config.model, cache_dir, config.seed).to(device, getattr(torch, config.dtype))
    vocab = model.config.vocab_size
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for length in config.lengths:
        trajectories, rewards = _batch(vocab, config, length)
        group_tokens = length * (config.num_trajectories // 2)
        budget = max(config.micro_batch_tokens, group_tokens)  # groups whole inside a micro-batch
        microbatches = [mb.to(device) for mb in pack_trajectories(trajectories, max_tokens=budget)]
        steps = _Steps(model, microbatches, rewards.to(device))
        runs: dict[str, Callable[[], None]] = {
            "old_forward_s": steps.old_forward,
            "grpo_step_s": steps.grpo_step,
            "vcpo_fast_step_s": lambda s=steps: s.vcpo_step(accumulate_opob_grad_packed),
        }
        with_reference = length <= config.per_trajectory_max_length
        if with_reference:
            runs["vcpo_per_trajectory_step_s"] = (
                lambda s=steps: s.vcpo_step(accumulate_opob_grad_per_trajectory))
        rounds = config.warmup_rounds + config.repeats
        progress(f"[bench opob] length {length}: {len(runs)} steps × {rounds} rounds ...")
        row: dict[str, Any] = {"length": length, "num_trajectories": config.num_trajectories,
                               "micro_batches": len(microbatches),
                               "tokens": length * config.num_trajectories}
        row.update(_median_times(runs, config.repeats, config.warmup_rounds, device))
        row["vcpo_fast_over_grpo"] = row["vcpo_fast_step_s"] / row["grpo_step_s"]
        row["vcpo_per_trajectory_over_fast"] = (
            row["vcpo_per_trajectory_step_s"] / row["vcpo_fast_step_s"] if with_reference else None)
        row["ess_ratio"] = float(ess_ratio(steps.log_w))
        rows.append(row)
        progress(f"[bench opob] length {length}: fast/grpo {row['vcpo_fast_over_grpo']:.3f}")
    worst = max(row["vcpo_fast_over_grpo"] for row in rows)
    return {
        "benchmark": "opob",
        "model": config.model,
        "parameters": params,
        "dtype": config.dtype,
        "device": str(device),
        "peak_memory_mib": (torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda"
                            else None),
        "host": host_description(),
        "rows": rows,
        "target": {"vcpo_fast_over_grpo_max": 1.15, "worst_measured": worst,
                   "is_met": bool(worst <= 1.15 and math.isfinite(worst))},
    }
