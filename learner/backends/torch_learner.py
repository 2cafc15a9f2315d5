"""The torch learner: one optimizer step per minibatch of trajectory groups (CPU or one GPU).

A step (docs/algorithm.md):
1. pack the trajectories (no padding) into token-budget micro-batches of whole groups;
2. proximal forward (no grad): `log π_old` of every sampled token — θ at the start of the step;
   with `algo.corrections`, the stages (vcpo/corrections.py) then judge every token by it once, on the
   whole minibatch, and the micro-batches are re-packed with the tokens they kept, so every later pass,
   the objective, the ESS and VCPO's norms see only those (and a truncation's weights);
3. gradient: VCPO accumulates `−Σ (a_i − b*_g s_i) ∇ℓ_i` with exact per-trajectory norms
   (`learner/traj_grads/opob_grad.py`, one backward per micro-batch on the fast path), then back-propagates
   its KL term per micro-batch (an extra forward/backward each, only with kl_coef > 0); every other
   objective first computes its batch context — every statistic its loss takes over the whole minibatch
   (group statistics, baselines, masks, bounds, denominators; `vcpo/objectives/base.py`) — once, without
   grad, from `log π_old` (the value of log π_θ at the gradient point), then runs its loss per micro-batch
   with that context held fixed and back-propagates it, so the gradient does not depend on the split;
4. metrics and the step size from ONE objective call on the whole minibatch with `log π = log π_old`
   (one update per minibatch, so that is exactly the state the gradient was taken at) and that context;
5. clip, lr = schedule(step) × rule(ESS or lag), AdamW step.

Data parallel (`data_parallel`, learner/distributed/data_parallel.py):
every rank gets the whole minibatch, trains
its share of whole groups, and the proximal log-probs, VCPO's norms and the gradient are summed across
ranks, so every replica takes the single-process step.

What it does not do: talk to engines, read config files, or decide which trajectories to use
(the trainer applies the task's filters by passing `is_trained`). A model-parallel backend reuses this
step and overrides three seams — `_build_optimizer`, `_accumulate_opob` (norms summed across shards)
and `_finish` — as `learner/backends/megatron/learner.py` does.
Cost: one no-grad forward + one forward/backward per micro-batch (+ a reference-model forward when
the objective needs it). Blocking: `step` is synchronous; the trainer runs it on a worker thread.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from configs.schema import AlgoConfig, LoraSettings, OptimConfig
from learner.backends import lora as lora_adapters
from learner.backends.algorithm_from_config import build_corrections, build_lr_scale_rule, build_objective
from learner.distributed.data_parallel import DataParallel, assign_groups
from learner.forward.fused_layers import FusedElementwise, compiler_problem
from learner.forward.logprobs import (
    autocast,
    can_share_prompts,
    head_chunk_plan,
    packed_target_logprobs,
    packed_target_stats,
)
from learner.forward.packing import (
    PackedMicroBatch,
    SharedPrefixLayout,
    TargetPadding,
    TrajectoryTokens,
    build_microbatch,
    plan_microbatches,
    share_prefixes,
)
from learner.traj_grads.hooks import PackedGradHooks
from learner.traj_grads.opob_grad import (
    BaselineFn,
    accumulate_opob_grad_packed,
    accumulate_opob_grad_per_trajectory,
)
from rollout.trajectory import Trajectory
from rollout.types import DEFAULT_TEMPERATURE
from vcpo.corrections import Correction, apply_corrections
from vcpo.groups import degenerate_groups, index_groups, single_group
from vcpo.objectives import BatchContext, PolicyLossInputs
from vcpo.step_size import StepSizeInputs

_PACKED_AGGREGATION = {"seq-mean-token-mean": "mean", "seq-mean-token-sum": "sum"}
"""ℓ_i's token weights on VCPO's fast path for the aggregations it supports."""


@dataclass(frozen=True)
class StepInput:
    """One minibatch: trajectories, their group index, lag and whether they enter the loss."""

    trajectories: Sequence[Trajectory]
    group_ids: Sequence[int]
    lags: Sequence[int]
    is_trained: Sequence[bool]
    """False zeroes the trajectory's loss mask (task filters) but keeps it in its group's statistics."""


def lr_at(optim: OptimConfig, step: int) -> float:
    """Scheduled base lr at optimizer step `step` (0-based): linear warm-up, then constant/linear/cosine."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant" or optim.total_steps is None:
        return optim.lr
    progress = min(1.0, (step - optim.warmup_steps) / max(1, optim.total_steps - optim.warmup_steps))
    if optim.schedule == "linear":
        return optim.lr * (1.0 - progress)
    return optim.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


class TorchLearner:
    """Owns the trained model, its optimizer and the algorithm objects (see the module docstring)."""

    packed_hooks: type[PackedGradHooks] = PackedGradHooks
    """What hooks the model's layers on VCPO's fast norm path: an HF causal LM's here; a backend with
    layers of its own names its subclass."""

    def __init__(self, model: nn.Module, algo: AlgoConfig, optim: OptimConfig, *, micro_batch_tokens: int,
                 temperature: float = DEFAULT_TEMPERATURE, autocast_dtype: torch.dtype | None = None,
                 autocast_proximal: bool = False, data_parallel: DataParallel | None = None,
                 proximal: Literal["separate", "reuse", "auto"] = "separate",
                 share_prompts: bool = False, fused_elementwise: bool = False,
                 logits_chunk_mib: float | None = None, lora: LoraSettings | None = None,
                 lora_seed: int = 0) -> None:
        self.lora = lora
        """`learner.lora`: adapters on the frozen base (learner/backends/lora.py); None: full weights."""
        self.peft = lora_adapters.attach(model, lora, lora_seed) if lora is not None else None
        """peft's wrapper around `model` (the adapters live in `model` itself); None without LoRA."""
        self.model = model.train()
        self.logits_chunk_mib = logits_chunk_mib
        """The output head in chunks of target rows where a micro-batch's `(K, V)` logits would pass this many
        MiB (`learner.logits_chunk_mib`, learner/forward/chunked_head.py); None: always in one pass."""
        self.data_parallel = data_parallel
        """None: one process. Else this replica's rank among the data-parallel ones (module docstring)."""
        self.autocast_dtype = autocast_dtype
        """Gradient forwards under autocast in this dtype (bf16 matmuls, fp32 weights, grads and
        optimizer); None = the weights' dtype throughout."""
        self.autocast_proximal = autocast_proximal
        """Also the no-grad proximal forward (log π_old: IS weights, ESS, VCPO's coefficients). Off, those
        stay in the weights' dtype, so an fp32 engine's ratios at lag 0 stay exactly 1."""
        self.proximal = proximal
        """Where log π_old comes from (`learner.proximal`); see `reuses_gradient_forward`."""
        self.share_prompts = share_prompts
        """Forward a group's common prompt once (`learner.share_prompts`) wherever no hook needs each
        trajectory's own activations: the proximal, reference and OTB passes and the autograd gradient
        forward of objectives without per-trajectory norms (and of VCPO's KL term)."""
        self.fused = None
        """With `fused_elementwise`: the gradient forwards' RMSNorm, rotary and SiLU·up as fused kernels
        (learner/forward/fused_layers.py); the proximal pass keeps HF's eager code."""
        if fused_elementwise:
            problem = compiler_problem(next(model.parameters()).device)
            if problem is not None:
                raise ValueError(f"learner.fused_elementwise: {problem}")
            self.fused = FusedElementwise(model)
        self.algo, self.optim_config = algo, optim
        self.objective = build_objective(algo)
        self.corrections = build_corrections(algo)
        """`algo.corrections`: the stages applied to every minibatch after the proximal pass."""
        self.lr_rule = build_lr_scale_rule(algo)
        self.micro_batch_tokens = micro_batch_tokens
        self.temperature = temperature
        self.device = next(model.parameters()).device
        self._check_supported()
        self.optimizer = self._build_optimizer()
        self.step_count = 0
        self.reference = None
        if self.objective.needs_ref_logprobs:  # frozen copy of the initial policy (KL / TBA)
            # with LoRA the initial policy is the base: the model itself with its adapters switched off
            self.reference = (self.model if self.peft is not None
                              else copy.deepcopy(model).eval().requires_grad_(False))

    @property
    def trained_parameters(self) -> list[nn.Parameter]:
        """The optimised vector: every parameter, or the adapters' alone with LoRA."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _build_optimizer(self) -> Any:
        optim = self.optim_config
        return torch.optim.AdamW(self.trained_parameters, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                 weight_decay=optim.weight_decay, fused=self._fused_adamw)

    @property
    def _fused_adamw(self) -> bool | None:
        """AdamW's one-kernel-per-tensor implementation where torch has it (CPU, CUDA): on CPU the default
        per-parameter loop took 0.35 s of a default-run step and the fused one 0.17 s (docs/log.md); the
        same update up to fp32 rounding (~1 ulp). None elsewhere (torch's default)."""
        return True if self.device.type in ("cpu", "cuda") else None

    def _check_supported(self) -> None:
        if self.lora is not None and self.lora.dropout > 0 and self.proximal == "reuse":
            raise ValueError(f"learner.lora.dropout={self.lora.dropout} makes the gradient forward random, "
                             "so it cannot stand for log π_old; set learner.proximal to 'auto' or 'separate'")
        if self.corrections and self.proximal == "reuse":
            raise ValueError("algo.corrections judge every token by log π_old before the gradient pass, but "
                             "learner.proximal='reuse' takes log π_old from that pass; set learner.proximal "
                             "to 'separate' or 'auto'")
        if self.objective.needs_entropy:
            raise ValueError(
                "entropy_coef > 0 needs the policy's entropy with gradients, which the torch learner does "
                "not compute yet; set algo.entropy_coef=0")
        if self.objective.needs_grad_norms:
            if getattr(self.objective, "scope", "group") != "group":
                raise ValueError("algo.objective.opob.scope='minibatch' is not supported by the learner's "
                                 "per-trajectory norm path; use scope='group'")
            if self.objective.loss_aggregation not in _PACKED_AGGREGATION:
                raise ValueError(f"VCPO with loss_aggregation={self.objective.loss_aggregation!r} is not "
                                 f"supported; use one of {sorted(_PACKED_AGGREGATION)}")

    # --- weights and state --------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, tensor) of every parameter, detached — what the engines load. With LoRA: the base
        model's names, the adapters merged into their layers' weights."""
        if self.peft is not None:
            yield from lora_adapters.merged_weights(self.model)
            return
        for name, parameter in self.model.named_parameters():
            yield name, parameter.detach()

    def state_dict(self) -> dict[str, Any]:
        """Model (or, with LoRA, the adapters alone: the base is the run's model path), optimizer, step."""
        weights = ({"adapter": lora_adapters.adapter_state(self.peft)} if self.peft is not None
                   else {"model": self.model.state_dict()})
        return {**weights, "optimizer": self.optimizer.state_dict(), "step_count": self.step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.peft is not None:
            if "adapter" not in state:
                raise ValueError("the checkpoint holds full weights but this run trains LoRA adapters "
                                 "(learner.lora); resume it with learner.lora=null")
            lora_adapters.load_adapter_state(self.peft, state["adapter"])
        elif "model" not in state:
            raise ValueError("the checkpoint holds LoRA adapters (learner.lora) but this run trains full "
                             "weights; resume it with the learner.lora settings it was written with")
        else:
            self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if isinstance(self.optimizer, torch.optim.AdamW):  # a checkpoint's groups carry its optimizer's flags
            fused = self._fused_adamw
            for group in self.optimizer.param_groups:
                group.update(fused=fused, foreach=None if fused else group.get("foreach"))
        self.step_count = int(state["step_count"])

    def save_pretrained(self, path: Path) -> None:
        """The current policy as an HF directory (safetensors), loadable by every engine. With LoRA: the
        merged policy, and peft's adapter directory in its `adapter/` (its base: the run's model)."""
        if self.peft is None:
            self.model.save_pretrained(path, safe_serialization=True)
            return
        self.model.save_pretrained(path, state_dict=dict(self.named_weights()), safe_serialization=True)
        lora_adapters.save_adapter(self.peft, Path(path) / lora_adapters.ADAPTER_DIR,
                                   str(getattr(self.model, "name_or_path", "")))

    # --- the step ----------------------------------------------------------------------------

    def step(self, batch: StepInput) -> dict[str, Any]:
        """One optimizer step on `batch`; returns its metrics (floats, and lists for histograms)."""
        size = len(batch.trajectories)
        tokens = self._tokens(batch)
        rewards = torch.tensor([t.reward for t in batch.trajectories], dtype=torch.float32,
                               device=self.device)
        group_ids = torch.tensor(list(batch.group_ids), dtype=torch.long, device=self.device)
        lags = torch.tensor(list(batch.lags), dtype=torch.long, device=self.device)
        reuse = self.reuses_gradient_forward
        # groups whose gradient is exactly 0 get micro-batches of their own, out of the gradient pass
        silent = self._silent_trajectories(tokens, rewards, group_ids)
        ranked = self._pack_ranked(tokens, apart=silent)
        microbatches = [mb for mb, _ in ranked]
        rank = self.data_parallel.rank if self.data_parallel is not None else 0
        mine = [owner == rank for _, owner in ranked]
        behavior = [self._behavior(batch.trajectories, mb) for mb in microbatches]
        sum_sq = None
        started = time.perf_counter()  # phase times: CPU-synchronous; on CUDA they time the launches
        # with `reuse`, a micro-batch of silent groups is the only forward of the step that takes the shared
        # layout (unless a reference model needs one for every micro-batch)
        quiet = [silent is not None and bool(silent[mb.trajectory_indices].all()) for mb in microbatches]
        layouts = self._shared_prompt_layouts(
            microbatches, [own and (not reuse or self.reference is not None or q)
                           for own, q in zip(mine, quiet, strict=True)])
        with torch.no_grad():  # each rank its own micro-batches; zeros stand in for the others' until _share
            if reuse:  # log π_old from the gradient pass's forward (filled in by _vcpo_gradient); a silent
                # group's from a no-grad forward in the gradient forward's dtype (it has no gradient pass)
                old = [self._logprobs(self.model, mb, layout, proximal=False) if own and is_quiet
                       else self._zeros(mb)
                       for mb, own, is_quiet, layout in zip(microbatches, mine, quiet, layouts, strict=True)]
            elif self.objective.needs_sum_probs_squared:  # OTB: Σ_v π_old(v)² from the same forward
                stats = [self._target_stats(mb, layout) if own else (self._zeros(mb), self._zeros(mb))
                         for mb, own, layout in zip(microbatches, mine, layouts, strict=True)]
                old, sum_sq = self._share([lp for lp, _ in stats]), self._share([sq for _, sq in stats])
            else:
                old = self._share([self._logprobs(self.model, mb, layout) if own else self._zeros(mb)
                                   for mb, own, layout in zip(microbatches, mine, layouts, strict=True)])
            ref = None
            if self.reference is not None:
                with self._reference_policy():
                    ref = self._share([self._logprobs(self.reference, mb, layout) if own else self._zeros(mb)
                                       for mb, own, layout in zip(microbatches, mine, layouts, strict=True)])
        proximal_s, started = time.perf_counter() - started, time.perf_counter()
        full = _FullBatch(microbatches, size, old, behavior, ref, self.device, sum_sq, layouts)
        correction = None
        if self.corrections:  # the kept tokens re-packed: every later pass and statistic sees only those
            correction, ranked, full, quiet = self._correct(full, tokens, rewards, group_ids, lags)
            microbatches = [mb for mb, _ in ranked]
            mine = [owner == rank for _, owner in ranked]
        num_units = full.num_units(self.objective.loss_aggregation)
        norms, skipped_groups = None, 0
        with self._gradient_forwards():  # the fused kernels, where on, for every gradient forward
            if self.objective.needs_grad_norms:
                norms, skipped_groups = self._vcpo_gradient(full, rewards, group_ids, mine, reuse=reuse,
                                                            quiet=quiet)
                if self.data_parallel is not None:  # count the minibatch's groups, as one process does
                    count = torch.tensor([float(skipped_groups)], device=self.device)
                    skipped_groups = int(self.data_parallel.all_reduce_sum_(count).item())
            # log π_θ = log π_old in value at the gradient point. Every rank has the whole minibatch's
            # old/ref/Σπ² (`_share`) and VCPO's norms, so the context is the global one on every rank.
            whole = full.inputs(full.old, rewards, group_ids, lags, norms, num_units)
            context = self.objective.batch_context(whole)
            if self.objective.needs_grad_norms:
                self._regularizer_gradient(full, context, rewards, group_ids, lags, mine)
            else:
                skipped_groups = self._objective_gradient(full, context, rewards, group_ids, lags, mine,
                                                          quiet)
                if self.data_parallel is not None:
                    count = torch.tensor([float(skipped_groups)], device=self.device)
                    skipped_groups = int(self.data_parallel.all_reduce_sum_(count).item())
        with torch.no_grad():
            output = self.objective(whole, context)
            lr_scale = self.lr_rule(StepSizeInputs(output.log_is_weights, output.valid, lags))
        base_lr = lr_at(self.optim_config, self.step_count)
        gradient_s, started = time.perf_counter() - started, time.perf_counter()
        grad_norm = self._finish(float(lr_scale.scale))
        optimizer_s = time.perf_counter() - started
        metrics: dict[str, Any] = {key: _plain(value) for key, value in output.metrics.items()}
        metrics.update({key: _plain(value) for key, value in lr_scale.metrics.items()})
        if correction is not None:
            metrics.update({key: _plain(value) for key, value in correction.metrics.items()})
        metrics.update({"lr/base": base_lr, "grad/norm": grad_norm,
                        "train/trajectories": size, "train/micro_batches": len(microbatches),
                        "train/prompt_tokens_shared": sum(
                            mb.num_tokens - layout.num_tokens
                            for mb, layout in zip(full.microbatches, full.layouts, strict=True) if layout),
                        "train/skipped_groups": skipped_groups,
                        "train/nonfinite_trajectories": int(output.counts.nonfinite_trajectories),
                        "train/degenerate_groups": int(output.counts.degenerate_groups),
                        "time/learner_proximal": proximal_s, "time/learner_gradient": gradient_s,
                        "time/learner_optimizer": optimizer_s})
        if self.data_parallel is not None:
            metrics.update(self._balance_metrics(ranked))
        return metrics

    def _correct(self, full: _FullBatch, tokens: list[TrajectoryTokens], rewards: Tensor, group_ids: Tensor,
                 lags: Tensor) -> tuple[Correction, list[tuple[PackedMicroBatch, int]], _FullBatch,
                                        list[bool]]:
        """Run `algo.corrections` on the whole minibatch (every rank has all of `log π_old`, so every rank
        gets the same answer) and re-pack it with the tokens they kept: a rejected token is no longer a
        target, a rejected trajectory has none (as a task-filtered one). The sequences are unchanged, so
        the packing keeps its groups and ranks; the proximal values move with their tokens. Returns the
        correction, the new (micro-batch, rank) list, the new `_FullBatch` and its silent micro-batches."""
        stacked = full.inputs(full.old, rewards, group_ids, lags, None, 0.0)
        correction = apply_corrections(
            self.corrections, stacked.old_logprobs, stacked.behavior_logprobs, stacked.loss_mask, rewards,
            group_ids, lags, self.objective.max_log_ratio)
        kept = correction.loss_mask & full.mask
        kept_list = kept.tolist()
        corrected_tokens = []
        for i, t in enumerate(tokens):
            trained = iter(kept_list[i])  # column c of row i is the c-th trained position of trajectory i
            mask = [bool(m) and next(trained) for m in t.loss_mask]
            corrected_tokens.append(TrajectoryTokens(t.token_ids, mask, group_id=t.group_id,
                                                     token_weights=t.token_weights,
                                                     segment_starts=t.segment_starts))
        silent = self._silent_trajectories(corrected_tokens, rewards, group_ids)
        ranked = self._pack_ranked(corrected_tokens, apart=silent)
        microbatches = [mb for mb, _ in ranked]
        rank = self.data_parallel.rank if self.data_parallel is not None else 0
        mine = [owner == rank for _, owner in ranked]
        quiet = [silent is not None and bool(silent[mb.trajectory_indices].all()) for mb in microbatches]
        # kept columns first, in their order: row i of the new layout is its kept tokens, left-aligned
        order = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)
        counts = kept.sum(dim=1, keepdim=True)
        filled = torch.arange(kept.shape[1], device=kept.device)[None, :] < counts

        def per_microbatch(values: Tensor) -> list[Tensor]:
            compact = torch.where(filled, values.gather(1, order), 0.0)
            flats = []
            for mb in microbatches:
                pad = TargetPadding(mb)
                flats.append(compact[mb.trajectory_indices][:, : pad.shape[1]][pad.mask])
            return flats

        layouts = self._shared_prompt_layouts(microbatches, mine)
        weights = None if correction.token_weights is None else per_microbatch(correction.token_weights)
        corrected = _FullBatch(
            microbatches, full.size, per_microbatch(stacked.old_logprobs),
            per_microbatch(stacked.behavior_logprobs),
            None if full.ref is None else per_microbatch(stacked.ref_logprobs), self.device,
            None if full.sum_sq is None else per_microbatch(stacked.sum_probs_squared), layouts,
            token_weights=weights, rejected=correction.rejected)
        return correction, ranked, corrected, quiet

    def _balance_metrics(self, ranked: list[tuple[PackedMicroBatch, int]]) -> dict[str, float]:
        """Tokens per data-parallel rank this step: the busiest rank's share against a perfect split."""
        load = [0] * self.data_parallel.world_size  # type: ignore[union-attr]
        for mb, owner in ranked:
            load[owner] += mb.input_ids.shape[1]
        mean = sum(load) / len(load)
        return {"train/dp_ranks": float(len(load)),
                "train/dp_max_rank_tokens_over_mean": max(load) / mean if mean else 1.0}

    def _zeros(self, mb: PackedMicroBatch) -> Tensor:
        return torch.zeros(mb.target_positions.numel(), device=self.device)

    def _share(self, per_microbatch: list[Tensor]) -> list[Tensor]:
        """Each rank's own micro-batches' values, everyone else's zeros → every rank has all of them."""
        if self.data_parallel is None:
            return per_microbatch
        return self.data_parallel.all_reduce_concat_(per_microbatch)

    def _tokens(self, batch: StepInput) -> list[TrajectoryTokens]:
        tokens = []
        for trajectory, group, is_trained in zip(batch.trajectories, batch.group_ids, batch.is_trained,
                                                 strict=True):
            mask = trajectory.loss_mask if is_trained else (False,) * len(trajectory.loss_mask)
            tokens.append(TrajectoryTokens(trajectory.token_ids, mask, group_id=int(group),
                                           segment_starts=trajectory.segment_starts))
        return tokens

    def _pack(self, tokens: list[TrajectoryTokens]) -> list[PackedMicroBatch]:
        return [mb for mb, _ in self._pack_ranked(tokens)]

    def _pack_ranked(self, tokens: list[TrajectoryTokens], apart: Tensor | None = None
                     ) -> list[tuple[PackedMicroBatch, int]]:
        """(micro-batch, data-parallel rank that trains it), rank by rank; one process: all rank 0.
        `apart`: (B,) bool, whole groups packed into micro-batches of their own (`_silent_trajectories`).

        VCPO's two-buffer gradient lets a group span micro-batches, so its micro-batches keep to the
        token budget (activation memory ∝ budget). Other objectives' micro-batches hold whole groups (over
        budget when a group is larger), as they always have; their losses take every cross-trajectory
        statistic from the batch context, so a split group would give the same gradient too
        (tests/vcpo/test_batch_context.py splits groups). Either way a group stays on one rank
        (`assign_groups`)."""
        group_tokens: dict[int, int] = {}
        for t in tokens:
            group_tokens[t.group_id] = group_tokens.get(t.group_id, 0) + len(t.token_ids)
        budget = self.micro_batch_tokens
        if not self.objective.needs_grad_norms:
            budget = max(budget, max(group_tokens.values()))
        world = self.data_parallel.world_size if self.data_parallel is not None else 1
        owner = assign_groups(group_tokens, world) if world > 1 else dict.fromkeys(group_tokens, 0)
        ranked: list[tuple[PackedMicroBatch, int]] = []
        flags = apart.tolist() if apart is not None else [False] * len(tokens)
        for rank in range(world):
            for side in (False, True):
                indices = [i for i, t in enumerate(tokens) if owner[t.group_id] == rank and flags[i] == side]
                ranked += [(mb, rank) for mb in self._pack_indices(tokens, indices, budget)]
        return ranked

    def _silent_trajectories(self, tokens: list[TrajectoryTokens], rewards: Tensor,
                             group_ids: Tensor) -> Tensor | None:
        """(B,) bool: the members of groups whose gradient is exactly 0 whatever the weights, or None when the
        objective has no such groups. VCPO: the trajectories whose coefficients a_i, s_i are 0 (those the
        objective does not keep, `advantage_divisor`: in the spec form the degenerate groups' members) or
        that have no trained token (∇ℓ_i = 0). An objective whose loss is
        linear in a group-relative advantage (`silent_when_degenerate`: GRPO, the TIS family, ...): the
        members of degenerate groups, where every advantage is exactly 0. Grouped so a group is silent only
        when all its members are. They are packed apart and left out of the gradient pass (69–86% of the
        default run's groups are: docs/results.md); the proximal pass still forwards them (their IS weights
        enter the ESS, the step size and the metrics), and with `learner.proximal: reuse` that no-grad
        forward gives their log π_old. A step whose every group is silent steps the optimizer on an exact
        zero gradient (AdamW's moments decay, as when the zero is computed), whatever the objective."""
        # trained targets: positions 1.. of the loss mask (packing.build_microbatch), as `trained_counts`
        valid = torch.tensor([any(t.loss_mask[1:]) for t in tokens], dtype=torch.bool, device=self.device)
        groups = index_groups(group_ids)
        # group statistics count every member with a finite reward, trained tokens or not (a filtered or
        # rejected one too: vcpo/objectives/base.py, prepare_batch); the objective's members are a subset
        # (it also drops non-finite log-probs), so a group degenerate here is degenerate there too
        in_statistics = torch.isfinite(rewards)
        if self.objective.needs_grad_norms:
            _, keep = self.objective.advantage_divisor(rewards, in_statistics, groups)
            keep = keep & valid
        elif self.objective.silent_when_degenerate:
            keep = valid & ~degenerate_groups(rewards, in_statistics, groups)[groups.index]
        else:
            return None
        zero = (~keep).tolist()
        silent: dict[int, bool] = {}
        for t, z in zip(tokens, zero, strict=True):
            silent[t.group_id] = silent.get(t.group_id, True) and z
        return torch.tensor([silent[t.group_id] for t in tokens], dtype=torch.bool, device=self.device)

    def _pack_indices(self, tokens: list[TrajectoryTokens], indices: list[int],
                      budget: int) -> list[PackedMicroBatch]:
        """`tokens[i]` for `i in indices`, packed group-aligned into micro-batches of `budget` tokens."""
        if not indices:
            return []
        aggregation = _PACKED_AGGREGATION.get(self.objective.loss_aggregation, "mean")
        plans = plan_microbatches([len(tokens[i].token_ids) for i in indices],
                                  [tokens[i].group_id for i in indices], budget)
        return [build_microbatch(tokens, [indices[j] for j in plan], aggregation).to(self.device)
                for plan in plans]

    def _behavior(self, trajectories: Sequence[Trajectory], mb: PackedMicroBatch) -> Tensor:
        """(K,) engine log-probs aligned with the micro-batch's targets (target t predicts token t+1)."""
        values: list[float] = []
        for j, index in enumerate(mb.trajectory_indices.tolist()):
            trajectory = trajectories[index]
            if mb.target_counts[j]:
                pairs = zip(trajectory.behavior_logprobs, trajectory.loss_mask, strict=True)
                values += [logprob for logprob, is_sampled in pairs if is_sampled]
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def _shared_prompt_layouts(self, microbatches: list[PackedMicroBatch],
                               forwarded: list[bool]) -> list[SharedPrefixLayout | None]:
        """Per micro-batch, its layout with each group's prompt once (`share_prompts`) where `forwarded`
        (this rank runs a forward that takes the layout); None where nothing is shared and elsewhere."""
        if not self.share_prompts or not can_share_prompts(self.model):
            return [None] * len(microbatches)
        return [share_prefixes(mb) if use else None for mb, use in zip(microbatches, forwarded, strict=True)]

    def _logprobs(self, model: nn.Module | None, mb: PackedMicroBatch,
                  layout: SharedPrefixLayout | None = None, *, proximal: bool = True) -> Tensor:
        """Target log-probs; `proximal`: the no-grad pass (autocast only with `autocast_proximal`);
        `layout`: the micro-batch with its groups' prompts shared."""
        if mb.target_positions.numel() == 0:
            return torch.zeros(0, device=self.device)
        gradient_forward = not proximal and model is self.model
        fused = self._gradient_forwards() if gradient_forward else self._no_grad_forwards()
        with fused, autocast(self.device, self._forward_dtype(proximal)):
            return packed_target_logprobs(model, mb, temperature=self.temperature, layout=layout,
                                          chunks=head_chunk_plan(model, mb, self.logits_chunk_mib))

    def _gradient_forwards(self) -> contextlib.AbstractContextManager[object]:
        """The model's fused elementwise kernels while active (`fused_elementwise`; nests), else nothing."""
        return self.fused if self.fused is not None else contextlib.nullcontext()

    def _no_grad_forwards(self) -> contextlib.AbstractContextManager[object]:
        """The policy as the engine samples it: LoRA's dropout off (it only regularises the gradient)."""
        return lora_adapters.dropout_off(self.model) if self.peft is not None else contextlib.nullcontext()

    def _reference_policy(self) -> contextlib.AbstractContextManager[object]:
        """With LoRA the reference (the initial policy) is the base: the adapters switched off inside."""
        return self.peft.disable_adapter() if self.peft is not None else contextlib.nullcontext()

    def _target_stats(self, mb: PackedMicroBatch, layout: SharedPrefixLayout | None) -> tuple[Tensor, Tensor]:
        if mb.target_positions.numel() == 0:
            empty = torch.zeros(0, device=self.device)
            return empty, empty
        with self._no_grad_forwards(), autocast(self.device, self._forward_dtype(proximal=True)):
            return packed_target_stats(self.model, mb, temperature=self.temperature, layout=layout)

    def _forward_dtype(self, proximal: bool) -> torch.dtype | None:
        return None if proximal and not self.autocast_proximal else self.autocast_dtype

    def _microbatch_losses(self, full: _FullBatch, context: BatchContext, rewards: Tensor, group_ids: Tensor,
                           lags: Tensor, mine: list[bool]) -> Iterator[tuple[PolicyLossInputs, BatchContext]]:
        """Per micro-batch this rank trains: its inputs with log π_θ from a gradient forward, and the
        context's rows for its trajectories."""
        for index, mb in enumerate(full.microbatches):
            if mb.target_positions.numel() == 0 or not mine[index]:
                continue
            pad = full.padding[index]
            local = mb.trajectory_indices
            inputs = PolicyLossInputs(
                logprobs=pad(self._logprobs(self.model, mb, full.layouts[index], proximal=False)),
                old_logprobs=pad(full.old[index]),
                behavior_logprobs=pad(full.behavior[index]), loss_mask=pad.mask, rewards=rewards[local],
                group_ids=group_ids[local], lags=lags[local],
                ref_logprobs=pad(full.ref[index]) if full.ref is not None else None,
                sum_probs_squared=pad(full.sum_sq[index]) if full.sum_sq is not None else None,
                token_weights=pad(full.token_weights[index]) if full.token_weights is not None else None,
                rejected=full.rejected[local] if full.rejected is not None else None)
            yield inputs, context.select(local, pad.shape[1])

    def _objective_gradient(self, full: _FullBatch, context: BatchContext, rewards: Tensor, group_ids: Tensor,
                            lags: Tensor, mine: list[bool], quiet: list[bool]) -> int:
        """Back-propagate the objective's loss per micro-batch, the whole minibatch's statistics held fixed
        (`context`): the summed gradient is the whole minibatch's whatever the split. `quiet` micro-batches
        (silent groups only, `_silent_trajectories`) add exactly nothing and are left out; returns how many
        of this rank's groups they held."""
        train = [own and not is_quiet for own, is_quiet in zip(mine, quiet, strict=True)]
        for inputs, local_context in self._microbatch_losses(full, context, rewards, group_ids, lags, train):
            self.objective(inputs, local_context).loss.backward()
        if not any(train):  # nothing back-propagated: an exact zero, stepped on as a computed one is
            for parameter in self.model.parameters():
                if parameter.requires_grad and parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
        left_out = {int(g) for mb, own, is_quiet in zip(full.microbatches, mine, quiet, strict=True)
                    if own and is_quiet for g in group_ids[mb.trajectory_indices].tolist()}
        return len(left_out)

    def _regularizer_gradient(self, full: _FullBatch, context: BatchContext, rewards: Tensor,
                              group_ids: Tensor, lags: Tensor, mine: list[bool]) -> None:
        """VCPO's KL term (kl_coef · agg(KL), the objective's aggregation and global denominator): its
        gradient goes straight into `.grad`, next to the policy-gradient buffer `A`, and not into the
        ‖∇ℓ_i‖² that b*_g weighs — b*_g minimises the variance of the policy-gradient estimator, which the
        (baseline-free) KL term does not change. Nothing to do without a KL term; the entropy bonus is
        refused at construction (`_check_supported`)."""
        if self.objective.kl_coef == 0 and self.objective.entropy_coef == 0:
            return
        for inputs, local_context in self._microbatch_losses(full, context, rewards, group_ids, lags, mine):
            self.objective.regularizer_loss(inputs, local_context).backward()

    @property
    def reuses_gradient_forward(self) -> bool:
        """Whether this step takes log π_old from the gradient pass's forward (`proximal`): VCPO on the
        fast norm path, without the OTB statistics; 'auto' only where that forward is in the weights'
        dtype (no autocast), so the log-probs are those a separate forward would give."""
        if self.proximal == "separate" or not self.objective.needs_grad_norms or self.corrections:
            return False  # corrections read log π_old before the gradient pass
        if self.lora is not None and self.lora.dropout > 0:
            return False  # a gradient forward with dropout is not the policy the engine samples
        if self.algo.objective.opob.grad_norm_path != "fast" or self.objective.needs_sum_probs_squared:
            return False
        return self.proximal == "reuse" or self.autocast_dtype is None

    def _vcpo_gradient(self, full: _FullBatch, rewards: Tensor, group_ids: Tensor,
                       mine: list[bool], *, reuse: bool = False,
                       quiet: list[bool] | None = None) -> tuple[Tensor, int]:
        """VCPO's gradient with exact per-trajectory norms (this rank's groups); returns ‖∇ℓ_i‖² (B,) of
        the whole minibatch and how many of this rank's groups the gradient pass left out. With `reuse`,
        `full.old` is filled here from the gradient forwards.

        A group whose every member has both coefficients exactly 0 (a degenerate group in the spec form) was
        packed apart by `step` (`quiet` micro-batches, `_silent_trajectories`): the gradient pass leaves
        those micro-batches out — they add exactly nothing to A − b*S whatever their ∇ℓ_i — and reports
        their norms as 0. With `reuse` their log π_old came from `step`'s no-grad forward."""
        objective = self.objective
        log_w = full.seq_log_ratios()
        counts = full.trained_counts()
        # group statistics (σ_g, degeneracy, b*'s members) count every member with a finite reward, as the
        # objective's own (vcpo/objectives/base.py, prepare_batch) and the authors' group advantages do; a
        # member without trained tokens has ∇ℓ_i = 0, so it adds nothing to A − b*S and its ω_i is 0
        valid = torch.isfinite(rewards)
        _, truncated = objective.sequence_weights(log_w)
        groups = index_groups(group_ids)
        # spec or reference form (vcpo/objectives/weighted.py): the objective owns every formula
        coefs = objective.gradient_coefficients(truncated, rewards, valid, groups, full.size)

        def baseline(group: int, members: Tensor, sq_norms: Tensor) -> float:
            members = members.to(self.device)
            one_group = single_group(len(members), self.device)
            omega = objective.baseline_weights(sq_norms, log_w[members], counts[members], one_group)
            result = objective.group_baseline(rewards[members], omega, valid[members], one_group)
            return float(result.per_trajectory[0])

        live = [mb for mb, own in zip(full.microbatches, mine, strict=True)
                if own and mb.target_positions.numel() > 0]
        trained = counts > 0  # the others have no ∇ℓ_i (and no micro-batch): their coefficients are moot
        reward_coef = coefs.reward_coef.float() * trained
        baseline_coef = coefs.baseline_coef.float() * trained
        if self.data_parallel is not None:  # other ranks' trajectories: not in `live`, no coefficients
            packed = torch.zeros(full.size, dtype=torch.bool, device=self.device)
            for mb in live:
                packed[mb.trajectory_indices] = True
            reward_coef, baseline_coef = reward_coef * packed, baseline_coef * packed
        skipped = 0
        if quiet is not None:  # silent groups' micro-batches: no gradient pass
            silent = [mb for mb, own, q in zip(full.microbatches, mine, quiet, strict=True) if own and q]
            skipped = len({g for mb in silent for g in group_ids[mb.trajectory_indices].tolist()})
            live = [mb for mb in live if not any(mb is other for other in silent)]
        if skipped and not live:  # the gradient is exactly 0: AdamW still steps as on a computed 0
            for parameter in self.model.parameters():
                if parameter.requires_grad and parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
        if not reuse:
            sq_norms = self._accumulate_opob(live, reward_coef, baseline_coef, baseline)
        elif not live:
            sq_norms = torch.zeros(full.size, dtype=torch.float32, device=self.device)
            full.old[:] = self._share(full.old)
        else:
            positions = [next(i for i, mb in enumerate(full.microbatches) if mb is part) for part in live]

            def from_logprobs(m: int, logprobs: Tensor) -> tuple[Tensor, Tensor]:
                """Micro-batch m's IS weights from its own forward, and from them its coefficients
                (σ_g, the keep mask and B depend on rewards alone, so the others' weights do not matter)."""
                index = positions[m]
                pad, local = full.padding[index], full.microbatches[index].trajectory_indices
                full.old[index] = logprobs
                log_w[local] = ((pad(logprobs) - pad(full.behavior[index])) * pad.mask).sum(dim=-1)
                truncated[local] = objective.sequence_weights(log_w[local])[1]
                part = objective.gradient_coefficients(truncated, rewards, valid, groups, full.size)
                return part.reward_coef[local].float(), part.baseline_coef[local].float()

            placeholder = torch.zeros_like(reward_coef)
            sq_norms = accumulate_opob_grad_packed(
                self.model, live, placeholder, placeholder, baseline, autocast_dtype=self.autocast_dtype,
                temperature=self.temperature, coefficients_from_logprobs=from_logprobs,
                hooks_class=self.packed_hooks, logits_chunk_mib=self.logits_chunk_mib).sq_norms
            full.old[:] = self._share(full.old)  # every rank: the whole minibatch's log π_old
        if self.data_parallel is None:
            return sq_norms, skipped
        return self.data_parallel.all_reduce_sum_(sq_norms.detach().float().clone()), skipped

    def _accumulate_opob(self, microbatches: list[PackedMicroBatch], reward_coefs: Tensor,
                         baseline_coefs: Tensor, baseline_fn: BaselineFn) -> Tensor:
        """`.grad += −Σ (a_i − b*_g s_i) ∇ℓ_i` (learner/traj_grads/opob_grad.py); returns
        ‖∇ℓ_i‖² (B,). The seam a
        model-parallel backend overrides to complete the per-shard norms across its ranks."""
        if self.algo.objective.opob.grad_norm_path == "fast":
            return accumulate_opob_grad_packed(
                self.model, microbatches, reward_coefs, baseline_coefs, baseline_fn,
                autocast_dtype=self.autocast_dtype, temperature=self.temperature,
                hooks_class=self.packed_hooks, logits_chunk_mib=self.logits_chunk_mib).sq_norms
        return accumulate_opob_grad_per_trajectory(
            self.model, microbatches, reward_coefs, baseline_coefs, baseline_fn,
            autocast_dtype=self.autocast_dtype, temperature=self.temperature,
            logits_chunk_mib=self.logits_chunk_mib).sq_norms

    def _finish(self, lr_scale: float) -> float:
        if self.data_parallel is not None:
            self.data_parallel.all_reduce_grads_(self.trained_parameters)
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        if self.optim_config.grad_clip is not None and parameters:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, self.optim_config.grad_clip))
        else:
            grad_norm = float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad) for p in parameters]))) if parameters else 0.0
        if not math.isfinite(grad_norm):  # never let one poisoned batch destroy the weights
            self.optimizer.zero_grad(set_to_none=True)
            self.step_count += 1
            return grad_norm
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.optim_config, self.step_count) * lr_scale
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return grad_norm


class _FullBatch:
    """The minibatch's per-micro-batch target tensors, and their (B, T) padded forms."""

    def __init__(self, microbatches: list[PackedMicroBatch], size: int, old: list[Tensor],
                 behavior: list[Tensor], ref: list[Tensor] | None, device: torch.device,
                 sum_sq: list[Tensor] | None = None, layouts: list[SharedPrefixLayout | None] | None = None,
                 token_weights: list[Tensor] | None = None, rejected: Tensor | None = None) -> None:
        self.microbatches, self.size, self.device = microbatches, size, device
        self.layouts = layouts or [None] * len(microbatches)
        """Per micro-batch, its layout with each group's prompt once (None: the full packed row)."""
        self.old, self.behavior, self.ref, self.sum_sq = old, behavior, ref, sum_sq
        self.token_weights = token_weights
        """Per micro-batch, a truncation correction's weight of each target (None: no truncation)."""
        self.rejected = rejected
        """(B,) bool, trajectories the corrections rejected whole (None: no corrections)."""
        self.padding = [TargetPadding(mb) for mb in microbatches]
        self.width = max([max(mb.target_counts) for mb in microbatches] + [1])

    def _stack(self, per_microbatch: list[Tensor]) -> Tensor:
        """(B, width): row i = trajectory i's targets, whatever micro-batch it sat in."""
        out = torch.zeros(self.size, self.width, device=self.device)
        for pad, mb, values in zip(self.padding, self.microbatches, per_microbatch, strict=True):
            rows = pad(values)
            out[mb.trajectory_indices, : rows.shape[1]] = rows
        return out

    @cached_property
    def mask(self) -> Tensor:
        """(B, width) bool: the filled (trained-token) cells of the stacked layout."""
        out = torch.zeros(self.size, self.width, dtype=torch.bool, device=self.device)
        for pad, mb in zip(self.padding, self.microbatches, strict=True):
            out[mb.trajectory_indices, : pad.mask.shape[1]] = pad.mask
        return out

    def trained_counts(self) -> Tensor:
        counts = torch.zeros(self.size, dtype=torch.long, device=self.device)
        for mb in self.microbatches:
            counts[mb.trajectory_indices] = torch.tensor(mb.target_counts, device=self.device)
        return counts

    def seq_log_ratios(self) -> Tensor:
        """(B,) L_i = Σ_{t∈M_i} log π_old − log μ."""
        return ((self._stack(self.old) - self._stack(self.behavior)) * self.mask).sum(dim=-1)

    def num_units(self, aggregation: str) -> float:
        return float(self.mask.sum()) if aggregation == "token-mean" else float(self.size)

    def inputs(self, logprobs: list[Tensor], rewards: Tensor, group_ids: Tensor, lags: Tensor,
               norms: Tensor | None, num_units: float) -> PolicyLossInputs:
        return PolicyLossInputs(
            logprobs=self._stack(logprobs), old_logprobs=self._stack(self.old),
            behavior_logprobs=self._stack(self.behavior), loss_mask=self.mask, rewards=rewards,
            group_ids=group_ids, lags=lags,
            ref_logprobs=self._stack(self.ref) if self.ref is not None else None,
            sum_probs_squared=self._stack(self.sum_sq) if self.sum_sq is not None else None,
            seq_sq_grad_norms=norms, num_units=num_units,
            token_weights=self._stack(self.token_weights) if self.token_weights is not None else None,
            rejected=self.rejected)


def _plain(value: Tensor | float) -> float | list[float]:
    if isinstance(value, Tensor):
        return value.tolist() if value.dim() > 0 else float(value)
    return float(value)
