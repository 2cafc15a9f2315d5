"""The megatron-core learner: the torch learner's step on a tensor/pipeline/context-parallel megatron GPT.

The step is `TorchLearner`'s — packing, the proximal pass, the objective or VCPO gradient, one
objective call for the metrics, the ESS/lag step size — run on `MegatronCausalLM`
(learner/backends/megatron/model.py),
a GPTModel built from the HF checkpoint; with pipeline stages its forward
and backward pass through every stage, with context parallelism each rank runs a chunk of every row,
and either way each rank runs the same step on its own layers and tokens. What
differs on sharded parameters is swapped in here:

* VCPO's per-trajectory norms: with local layers and no sequence parallelism the fast packed path, one
  forward and backward per micro-batch with megatron's layers hooked — recomputed layers included
  (learner/backends/megatron/packed_grads.py), each rank's norms those of its shards, stage and chunk of
  the rows, summed over TP × PP (and CP) in the baseline callback; otherwise
  `accumulate_opob_grad_per_trajectory` on this rank's shards
  (`_rank_sq_norm`: a replicated parameter — the RMSNorm weights — counted on TP rank 0 only, summed
  over TP first where sequence parallelism splits its gradient; a tied embedding's two pipeline copies
  summed, then counted once), then all-reduced over the model-parallel group (TP × PP) — inside the
  baseline callback, so every rank computes the same `b*_g`.
* the finishing step: gradients go into megatron's DistributedDataParallel fp32 buffers;
  `finalize_model_grads` sums them over the data-parallel ranks (and the sequence-parallel norm
  weights over TP, a tied embedding's copies over the first and last stage); megatron's optimizer
  computes the global norm (over DP shards and model-parallel ranks, replicated and shared parameters
  once), a non-finite norm skips the step, else it clips and steps (Adam, decoupled weight decay on
  every parameter as in the torch learner; `use_distributed_optimizer` shards its state over the DP
  ranks) at lr = schedule(step) × rule(ESS or lag).
* data parallelism: the world is TP × PP × CP × DP; each DP replica trains whole groups of the
  minibatch (learner/distributed/data_parallel.py:
  proximal log-probs and VCPO's norms summed over the DP group),
  so every replica takes the single-replica step.
* weights leave in HF names through mbridge, TP shards gathered and PP stages broadcast, for engines
  and `save_pretrained`.

Every model-parallel rank must call `step`, `named_weights`, `state_dict` and `save_pretrained` with
the same arguments in the same order (they communicate). Not supported (clear errors at
construction): context parallelism with TransformerEngine layers (see `MegatronConfig`), objectives
needing a reference model (KL, TBA), entropy bonuses, float16. Activation recompute is megatron's own
(`MegatronConfig.recompute_granularity`), not `model.gradient_checkpointing`.
`state_dict` holds this rank's shards under megatron names: a checkpoint resumes on the same parallel
layout only.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from configs.schema import AlgoConfig, MegatronConfig, OptimConfig, RunConfig
from configs.task_schema import TaskConfig
from learner.backends.megatron.model import MegatronCausalLM, export_hf_weights, load_megatron_gpt
from learner.backends.megatron.packed_grads import MegatronPackedGradHooks, fast_path_problem
from learner.backends.torch_learner import TorchLearner, lr_at
from learner.distributed.data_parallel import DataParallel
from learner.forward.logprobs import head_chunk_plan, packed_target_logprobs, trajectory_logliks
from learner.forward.packing import PackedMicroBatch
from learner.traj_grads.opob_grad import BaselineFn, accumulate_opob_grad_per_trajectory, squared_sum
from rollout.types import DEFAULT_TEMPERATURE

log = logging.getLogger(__name__)


def init_model_parallel(megatron: MegatronConfig, *, backend: str, seed: int = 0) -> None:
    """Join the torch.distributed world and set up megatron's TP/PP/CP groups and model-parallel RNG.

    An existing process group is used as is; otherwise ranks launched by torchrun or the Ray launcher
    rendezvous through the environment (env://, MASTER_ADDR set), and a lone process makes a world of
    one. `backend`: 'nccl' on GPUs, 'gloo' on CPUs. The world holds world / (TP × PP × CP) data-parallel
    replicas of the model.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    sizes = (megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size,
             megatron.context_parallel_size)
    if dist.get_world_size() % math.prod(sizes):
        raise ValueError(
            f"the world size ({dist.get_world_size()}) must be a multiple of tensor × pipeline × context "
            f"parallel = {' × '.join(map(str, sizes))} (the quotient is the number of data-parallel "
            "replicas): launch a multiple of that many ranks or change learner.megatron.*_parallel_size")
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_context_parallel_world_size())
        if current != sizes:
            raise ValueError(f"megatron's parallel state is already set up as (TP, PP, CP) = {current}, "
                             f"not {sizes}")
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes[0], pipeline_model_parallel_size=sizes[1],
            context_parallel_size=sizes[2])
    model_parallel_cuda_manual_seed(seed)


class MegatronLearner(TorchLearner):
    """`TorchLearner` on a megatron GPT loaded from `hf_dir` (module docstring). Needs
    `init_model_parallel` first; `device`: this rank's device (its CUDA device on GPUs)."""

    packed_hooks = MegatronPackedGradHooks

    def __init__(self, hf_dir: str | Path, algo: AlgoConfig, optim: OptimConfig, megatron: MegatronConfig, *,
                 micro_batch_tokens: int, temperature: float = DEFAULT_TEMPERATURE,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 proximal: Literal["separate", "reuse", "auto"] = "separate",
                 logits_chunk_mib: float | None = None) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the megatron learner trains in float32 or bfloat16, not {dtype}; set "
                             "model.dtype to 'float32' or 'bfloat16'")
        self.megatron_config, self.dtype = megatron, dtype
        self.gpt = load_megatron_gpt(hf_dir, megatron, dtype, torch.device(device))
        # the losses are normalised by minibatch-wide denominators, so the data-parallel ranks' gradients
        # must be summed; megatron averages them unless told the loss is per token
        self.gpt.gpt.config.calculate_per_token_loss = True
        self.ddp = DistributedDataParallel(
            config=self.gpt.gpt.config, module=self.gpt.gpt,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=megatron.use_distributed_optimizer))
        replicas = parallel_state.get_data_parallel_world_size()
        data_parallel = DataParallel(parallel_state.get_data_parallel_rank(), replicas,
                                     parallel_state.get_data_parallel_group()) if replicas > 1 else None
        super().__init__(MegatronCausalLM(self.gpt), algo, optim, micro_batch_tokens=micro_batch_tokens,
                         temperature=temperature, data_parallel=data_parallel, proximal=proximal,
                         logits_chunk_mib=logits_chunk_mib)
        self.fast_norms = self.objective.needs_grad_norms and algo.objective.opob.grad_norm_path == "fast"
        """VCPO's norms on the fast packed path (else per trajectory, summed over shards)."""
        problem = fast_path_problem(self.model)
        if self.fast_norms and problem is not None:
            self.fast_norms = False
            log.info("learner.backend='megatron': VCPO's per-trajectory norms take grad_norm_path="
                     "'per_trajectory' here: %s", problem)

    def _check_supported(self) -> None:
        super()._check_supported()
        if self.objective.needs_ref_logprobs:
            raise ValueError("this objective needs a frozen reference model (algo.kl_coef > 0 or TBA), "
                             "which the megatron learner does not keep yet; set algo.kl_coef=0, pick another "
                             "objective, or use learner.backend='torch'")

    def _build_optimizer(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        optim = self.optim_config
        config = OptimizerConfig(
            optimizer="adam", lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.betas[0],
            adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=optim.grad_clip or 0.0,
            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
            use_distributed_optimizer=self.megatron_config.use_distributed_optimizer)
        # config_overrides={}: weight decay on every parameter, biases and norms included (as the torch
        # learner's AdamW); megatron's default would exempt them.
        return get_megatron_optimizer(config, [self.ddp], config_overrides={})

    # --- the pieces of the step that see the shards ------------------------------------------------

    @property
    def reuses_gradient_forward(self) -> bool:
        """As the torch learner's, on the fast norm path with the model on one rank only (TP = PP = CP = 1):
        the per-trajectory path has no packed forward whose log-probs it could keep, and the reusing pass
        does not sum the ranks' norms."""
        megatron = self.megatron_config
        one_rank = (megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size,
                    megatron.context_parallel_size) == (1, 1, 1)
        return self.fast_norms and one_rank and super().reuses_gradient_forward

    def _accumulate_opob(self, microbatches: list[PackedMicroBatch], reward_coefs: Tensor,
                         baseline_coefs: Tensor, baseline_fn: BaselineFn) -> Tensor:
        # the fast path's norms: this rank's shards of its stage's layers and of its chunk of the rows,
        # summed over TP × PP (and CP); the per-trajectory path's are whole over CP already
        over_context = self.fast_norms and self.megatron_config.context_parallel_size > 1

        def baseline(group: int, members: Tensor, sq_norms: Tensor) -> float:
            return baseline_fn(group, members, self._sum_over_shards(sq_norms, over_context))

        if self.fast_norms:
            return self._sum_over_shards(
                super()._accumulate_opob(microbatches, reward_coefs, baseline_coefs, baseline), over_context)
        recomputes = self.megatron_config.recompute_granularity is not None
        if recomputes:
            self._check_main_grads_empty()
        result = accumulate_opob_grad_per_trajectory(
            self.model, microbatches, reward_coefs, baseline_coefs, baseline, rank_sq_norm=self._rank_sq_norm,
            temperature=self.temperature, trajectory_grads=self._grads_by_backward if recomputes else None)
        return self._sum_over_shards(result.sq_norms)

    def _grads_by_backward(self, single: PackedMicroBatch, params: list[nn.Parameter]) -> list[Tensor]:
        """One trajectory's `∇ℓ` by `backward()`, for the per-trajectory path under activation recompute:
        megatron's recompute is a reentrant checkpoint, which `torch.autograd.grad` cannot run through.
        megatron's DDP hooks move each gradient into its parameter's `main_grad` buffer (fp32), read here
        and zeroed — it holds nothing else during this pass (`_check_main_grads_empty`)."""
        if single.target_positions.numel() == 0:
            return [torch.zeros_like(p) for p in params]
        chunks = head_chunk_plan(self.model, single, self.logits_chunk_mib)
        with torch.enable_grad():
            logprobs = packed_target_logprobs(self.model, single, temperature=self.temperature, chunks=chunks)
            trajectory_logliks(logprobs, single)[0].backward()
        grads = []
        for param in params:
            grads.append(param.main_grad.clone())
            param.main_grad.zero_()
        return grads

    def _check_main_grads_empty(self) -> None:
        if any(bool(param.main_grad.any()) for param in self.model.parameters() if param.requires_grad):
            raise RuntimeError("megatron's gradient buffers hold gradients before VCPO's per-trajectory "
                               "pass, which reads each trajectory's gradient from them under activation "
                               "recompute")

    def _rank_sq_norm(self, params: Sequence[nn.Parameter], grads: Sequence[Tensor]) -> Tensor:
        """This rank's share of one trajectory's ‖g_i‖², such that the shares of the model-parallel ranks
        sum to the whole norm (`_sum_over_shards`):

        * a tensor-parallel shard: its own gradient;
        * a weight every TP rank holds whole (RMSNorm): counted on TP rank 0 — after summing the ranks'
          gradients where sequence parallelism gave each rank only its slice of the sequence's;
        * a tied embedding with PP > 1 (the first stage's embedding and the last stage's output layer are
          copies of one weight): the two copies' gradients summed, counted on the first stage;
        * with CP > 1 each CP rank holds its chunk's part of every gradient: they are summed over the CP
          group first (one all-reduce of this rank's whole gradient per trajectory), and every CP rank
          then has the same share.

        Collective (CP, TP and embedding groups): called in the same order on every rank.
        """
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        config, shared = self.gpt.gpt.config, self._pipeline_shared_weight()
        if config.context_parallel_size > 1 and grads:
            flat = torch.cat([g.float().flatten() for g in grads])
            dist.all_reduce(flat, group=parallel_state.get_context_parallel_group())
            parts = flat.split([g.numel() for g in grads])
            grads = [part.view_as(g) for part, g in zip(parts, grads, strict=True)]
        own, tp_partial, shared_grad = [], [], None
        for param, grad in zip(params, grads, strict=True):
            if param is shared:
                shared_grad = grad
            elif config.sequence_parallel and getattr(param, "sequence_parallel", False):
                tp_partial.append(grad)
            elif param_is_not_tensor_parallel_duplicate(param):
                own.append(grad)
        total = squared_sum(own, params[0].device if params else None)
        if tp_partial:
            summed = torch.cat([g.float().flatten() for g in tp_partial])
            dist.all_reduce(summed, group=parallel_state.get_tensor_model_parallel_group())
            if parallel_state.get_tensor_model_parallel_rank() == 0:
                total = total + summed.square().sum()
        if shared is not None:
            summed = (shared_grad if shared_grad is not None else torch.zeros_like(shared)).float().clone()
            dist.all_reduce(summed, group=parallel_state.get_embedding_group())
            if parallel_state.is_pipeline_first_stage():
                total = total + summed.square().sum()
        return total

    def _pipeline_shared_weight(self) -> nn.Parameter | None:
        """This stage's copy of a tied embedding that PP > 1 keeps on both the first and the last stage
        (megatron sums the copies' gradients); None otherwise."""
        gpt = self.gpt.gpt
        pipelined = self.megatron_config.pipeline_model_parallel_size > 1
        holds_a_copy = gpt.pre_process or gpt.post_process
        if not (pipelined and gpt.share_embeddings_and_output_weights and holds_a_copy):
            return None
        return gpt.shared_embedding_or_output_weight()

    def _sum_over_shards(self, partial: Tensor, over_context: bool = False) -> Tensor:
        """Σ over the model-parallel ranks of per-shard partial sums (each parameter counted once); with
        `over_context`, over the context-parallel ranks too (each holding part of the rows)."""
        from megatron.core import parallel_state

        total = partial.clone()
        group = parallel_state.get_model_parallel_group()
        if dist.get_world_size(group) > 1:  # one rank (TP = PP = 1): nothing to add
            dist.all_reduce(total, group=group)
        if over_context:
            dist.all_reduce(total, group=parallel_state.get_context_parallel_group())
        return total

    def _finish(self, lr_scale: float) -> float:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        for param in self.model.parameters():  # VCPO's gradients sit in .grad (DDP hooks see backward() only)
            if param.grad is not None:
                param.main_grad.add_(param.grad)
                param.grad = None
        # Σ over DP (all-reduce, or reduce-scatter with the distributed optimizer); Σ over TP of the norm
        # weights' gradients under sequence parallelism; Σ of a tied embedding's two copies under PP
        finalize_model_grads([self.ddp])
        optimizer = self.optimizer
        optimizer.prepare_grads()  # model grads → the optimizer's fp32 main grads (its shard)
        grad_norm = float(optimizer.get_grad_norm())  # DP shards + model-parallel ranks, duplicates once
        if math.isfinite(grad_norm):  # never let one poisoned batch destroy the weights
            for group in optimizer.param_groups:
                group["lr"] = lr_at(self.optim_config, self.step_count) * lr_scale
            if self.optim_config.grad_clip is not None:
                for part in self._optimizer_parts():
                    if part.get_parameters():
                        clip_grad_by_total_norm_fp32(part.get_parameters(), self.optim_config.grad_clip,
                                                     grad_norm)
            optimizer.step_with_ready_grads()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.step_count += 1
        return grad_norm

    # --- weights and state -------------------------------------------------------------------------

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) of every weight — TP shards gathered (collective) — what engines load."""
        yield from export_hf_weights(self.gpt)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards (megatron names), its optimizer state and the step count."""
        if self.megatron_config.use_distributed_optimizer:
            # the torch Adam inside each DistributedOptimizer holds this rank's moments (the whole buffer
            # with one replica); megatron's own save path assumes TE/Apex Adam (no per-parameter 'step')
            optimizer = {"parts": [part.optimizer.state_dict() for part in self._optimizer_parts()]}
        else:
            optimizer = self.optimizer.state_dict()
        return {"model": self.gpt.gpt.state_dict(), "optimizer": optimizer, "step_count": self.step_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()` of a learner with the same parallel layout. With the distributed
        optimizer in bfloat16, fp32 master weights restart from the bf16 weights."""
        self.gpt.gpt.load_state_dict(state["model"])
        if self.megatron_config.use_distributed_optimizer:
            for part, saved in zip(self._optimizer_parts(), state["optimizer"]["parts"], strict=True):
                part.optimizer.load_state_dict(saved)
                part.reload_model_params()
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])

    def _optimizer_parts(self) -> list[Any]:
        """megatron's optimizer(s): `get_megatron_optimizer` may chain one per parameter class."""
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def save_pretrained(self, path: Path) -> None:
        """The current policy as an HF directory (config + one safetensors file), written by rank 0."""
        from safetensors.torch import save_file

        weights = {name: tensor.cpu().clone(memory_format=torch.contiguous_format)
                   for name, tensor in self.named_weights()}
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
            save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
            self.gpt.hf_config.save_pretrained(path)


def build_megatron_learner(config: RunConfig, task: TaskConfig, cache_dir: Path) -> MegatronLearner:
    """`learner.backend: megatron` from a run config: parallel groups (NCCL), this rank's GPU, the model."""
    from rollout.models import resolve_model

    megatron = config.learner.megatron
    problems = []
    if not torch.cuda.is_available() or config.learner.device == "cpu":
        problems.append("learner.backend='megatron' needs CUDA devices (megatron-core hard-codes torch.cuda: "
                        "device placement, RNG, its optimizer's checks); on a CPU machine use "
                        "learner.backend='torch'")
    if problems:
        raise ValueError("; ".join(problems))
    if config.learner.device in ("auto", "cuda"):  # torchrun: one GPU per local rank (Ray: one per actor)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    else:
        torch.cuda.set_device(torch.device(config.learner.device))
    init_model_parallel(megatron, backend="nccl", seed=config.seed)
    dtype = getattr(torch, config.model.dtype)  # 'float32' | 'bfloat16' | 'float16' (refused by the learner)
    hf_dir = resolve_model(config.model.path, cache_dir).name_or_path
    return MegatronLearner(hf_dir, config.algo, config.optim, megatron,
                           micro_batch_tokens=config.learner.micro_batch_tokens,
                           temperature=task.loop.temperature, dtype=dtype, proximal=config.learner.proximal,
                           device=torch.device("cuda", torch.cuda.current_device()),
                           logits_chunk_mib=config.learner.logits_chunk_mib)
