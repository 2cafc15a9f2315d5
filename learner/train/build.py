"""Build the learner of a training run from its validated config, and run the whole run in this process
(`run_local`: engine, tool, rollout manager and learner side by side, `learner.train.trainer.train`)."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch

from agent_env.datasets import load_samples
from agent_env.heldout import HeldoutEvaluator, select_heldout
from agent_env.runtime import TaskRuntime, episode_settings
from configs.schema import RunConfig
from configs.task_schema import TaskConfig
from learner.backends.torch_learner import TorchLearner
from learner.distributed.data_parallel import join_data_parallel_from_env
from learner.forward.fused_layers import resolve as resolve_fused_elementwise
from learner.forward.logprobs import autocast_dtype
from learner.forward.varlen_attention import register_varlen_sdpa
from learner.train.compose import task_runtime
from learner.train.trainer import TrainSummary, train

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
    log.info("learner: %s weights, autocast %s (learner.autocast=%s), fused elementwise kernels %s",
             config.model.dtype, autocast or "off", config.learner.autocast, "on" if fused else "off")
    return TorchLearner(model, config.algo, config.optim,
                        micro_batch_tokens=config.learner.micro_batch_tokens,
                        temperature=task.loop.temperature,
                        autocast_dtype=autocast,
                        autocast_proximal=config.learner.autocast_proximal,
                        proximal=config.learner.proximal, share_prompts=config.learner.share_prompts,
                        fused_elementwise=fused,
                        data_parallel=join_data_parallel_from_env(device))


async def run_local(
    config: RunConfig, task: TaskConfig, task_path: Path, settings: Any, cache_dir: Path, run_dir: Path, *,
    progress: bool = True, stop_after_step: int | None = None,
) -> TrainSummary:
    """Train `config` on `task` in this process (`launcher: local`); resumes when run_dir has a checkpoint."""
    from rollout.models import load_tokenizer, resolve_model

    started = time.perf_counter()
    resolved = resolve_model(config.model.path, cache_dir)
    tokenizer = load_tokenizer(config.model.path, cache_dir)
    learner = build_learner(config, task, cache_dir)
    async with task_runtime(task, task_path, model_dir=resolved.name_or_path, tokenizer=tokenizer,
                            settings=settings, which="train") as runtime:
        heldout = None
        if config.trainer.eval_every:
            heldout = heldout_evaluator(config, runtime, task_path, run_dir)
        startup_s = time.perf_counter() - started
        summary = await train(config, runtime, learner, run_dir, progress=progress,
                              stop_after_step=stop_after_step, heldout=heldout)
    summary.phases = {"startup": startup_s, **summary.phases}
    return summary


def heldout_evaluator(config: RunConfig, runtime: TaskRuntime, task_path: Path, run_dir: Path
                      ) -> HeldoutEvaluator:
    """The trainer's held-out evaluation of `runtime`'s task: the task's heldout_dataset less every
    training prompt, the first `trainer.eval_samples`, sampled as the training rollouts are (or at
    `trainer.eval_temperature`), with one fixed seed per (prompt, sample) across versions."""
    task, trainer = runtime.task, config.trainer
    loaded = load_samples(task, which="heldout", task_dir=task_path.parent)
    chosen = select_heldout(loaded.samples, runtime.samples, task.prompt.system, task.prompt.user,
                            trainer.eval_samples, source=loaded.source)
    log.info("held-out evaluation: %d prompts of %s (%d overlapping training prompts dropped), k = %d, "
             "every %d steps", len(chosen.samples), chosen.source, chosen.overlapping, trainer.eval_k,
             trainer.eval_every)
    settings = episode_settings(task, seed=config.seed)
    if trainer.eval_temperature is not None:
        settings = dataclasses.replace(settings, temperature=trainer.eval_temperature)
    return HeldoutEvaluator(chosen, engine=runtime.engine, tokenizer=runtime.tokenizer, tool=runtime.tool,
                            system=task.prompt.system, user=task.prompt.user, reward=runtime.reward,
                            settings=settings, k=trainer.eval_k, out_dir=run_dir / "eval",
                            concurrency=trainer.eval_concurrency, task_name=task.name)
