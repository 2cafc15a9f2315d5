"""Build the learner of a training run from its validated config: its device, autocast dtype and fused
kernels, and the torch or megatron learner itself (`build_learner`, also used by the Ray launcher's
learner ranks)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from configs.schema import RunConfig
from configs.task_schema import TaskConfig
from learner.backends.torch_learner import TorchLearner
from learner.distributed.data_parallel import join_data_parallel_from_env
from learner.forward.fused_layers import resolve as resolve_fused_elementwise
from learner.forward.logprobs import autocast_dtype
from learner.forward.varlen_attention import register_varlen_sdpa

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def learner_device(spec: str) -> str:
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return spec


def learner_autocast(config: RunConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype `learner.autocast` resolves to for the torch learner's fp32 weights on `device`
    (None: no autocast — also for megatron, whose mixed precision is model.dtype)."""
    if config.learner.backend != "torch" or config.model.dtype != "float32":
        return None
    return autocast_dtype(config.learner.autocast, device)


def learner_fused_elementwise(config: RunConfig, device: torch.device) -> bool:
    """Whether `learner.fused_elementwise` turns the fused kernels on for `device` (`fused_layers.resolve`;
    where 'auto' turns them off, the log says why)."""
    on, problem = resolve_fused_elementwise(config.learner.fused_elementwise, device)
    if problem is not None:
        log.warning("learner: fused elementwise kernels off (learner.fused_elementwise=auto): %s", problem)
    return on


def build_learner(config: RunConfig, task: TaskConfig, cache_dir: Path) -> TorchLearner:
    """The learner's own model copy (packing-aware attention) and optimizer, on `learner.backend`. Started
    as one of several ranks (the Ray launcher's torch learner ranks, torchrun), it is one data-parallel
    replica."""
    if config.learner.backend == "megatron":
        from learner.backends.megatron.learner import build_megatron_learner

        return build_megatron_learner(config, task, cache_dir)
    from rollout.models import load_causal_lm

    model = load_causal_lm(config.model.path, cache_dir, _DTYPES[config.model.dtype],
                           learner_device(config.learner.device))
    model.set_attn_implementation(register_varlen_sdpa())
    if config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    device = next(model.parameters()).device
    autocast = learner_autocast(config, device)
    fused = learner_fused_elementwise(config, device)
    log.info("learner: %s weights, autocast %s (learner.autocast=%s), fused elementwise kernels %s, %s",
             config.model.dtype, autocast or "off", config.learner.autocast, "on" if fused else "off",
             "full weights trained" if config.learner.lora is None else
             f"LoRA adapters trained (rank {config.learner.lora.rank}, alpha {config.learner.lora.alpha})")
    return TorchLearner(model, config.algo, config.optim,
                        micro_batch_tokens=config.learner.micro_batch_tokens,
                        temperature=task.loop.temperature,
                        autocast_dtype=autocast,
                        autocast_proximal=config.learner.autocast_proximal,
                        proximal=config.learner.proximal, share_prompts=config.learner.share_prompts,
                        fused_elementwise=fused,
                        data_parallel=join_data_parallel_from_env(device),
                        logits_chunk_mib=config.learner.logits_chunk_mib,
                        lora=config.learner.lora, lora_seed=config.seed)
