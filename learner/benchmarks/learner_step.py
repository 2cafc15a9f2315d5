"""Learner throughput: step time, tokens/s and peak memory of the torch and megatron learners.

`bench_learner` builds a random Llama/Qwen2-shaped checkpoint (`BenchShape`), one random minibatch of
groups, and times `steps` optimizer steps after `warmup` untimed ones, returning a JSON-able dict.
The megatron backend needs CUDA (megatron-core hard-codes it) and a process group of TP ranks
(torchrun for TP > 1); the torch backend runs on CPU or one GPU, in the weights' dtype ('torch')
or under bf16 autocast over fp32 weights ('torch-autocast', `learner.autocast=bfloat16`). The same
batch and objective for all, so their numbers compare directly.

What it does not do: read configs or print (the CLI does), generate with an engine (the behaviour
log-probs are random near the model's), or measure weight sync.
"""

from __future__ import annotations

import random
import resource
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from configs.schema import AlgoConfig, LearnerBenchConfig, MegatronConfig, OptimConfig
from learner.backends.torch_learner import StepInput, TorchLearner
from rollout.trajectory import Trajectory, TrajectoryVersions


@dataclass(frozen=True)
class BenchShape:
    """A random model's architecture (HF config fields)."""

    kind: Literal["llama", "qwen2"] = "llama"
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    """Defaults: SmolLM2-135M's shape."""


@dataclass(frozen=True)
class BenchBatch:
    """The timed minibatch: groups × group_size trajectories of `tokens` tokens, the last `sampled` of
    them trained."""

    groups: int = 8
    group_size: int = 4
    tokens: int = 512
    sampled: int = 384


def write_random_checkpoint(shape: BenchShape, out_dir: Path, seed: int = 0) -> Path:
    """An HF directory holding a randomly initialised model of `shape` (fp32 safetensors)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    fields = {k: v for k, v in asdict(shape).items() if k != "kind"}
    torch.manual_seed(seed)
    if shape.kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**fields, tie_word_embeddings=False))
    else:
        model = LlamaForCausalLM(LlamaConfig(**fields, tie_word_embeddings=True))
    model.save_pretrained(out_dir)
    return out_dir


def random_batch(batch: BenchBatch, vocab_size: int, seed: int = 0) -> StepInput:
    """Random token ids and rewards; behaviour log-probs near a uniform policy's −log V (IS weights ~ 1)."""
    rng = random.Random(seed)
    uniform = -torch.log(torch.tensor(float(vocab_size))).item()
    trajectories, group_ids = [], []
    for group in range(batch.groups):
        for member in range(batch.group_size):
            mask = (False,) * (batch.tokens - batch.sampled) + (True,) * batch.sampled
            trajectories.append(Trajectory(
                trajectory_id=f"b{group}.{member}", group_id=str(group),
                token_ids=tuple(rng.randrange(vocab_size) for _ in range(batch.tokens)), loss_mask=mask,
                behavior_logprobs=tuple(uniform + rng.gauss(0, 0.01) if m else 0.0 for m in mask),
                versions=TrajectoryVersions(start=0, end=0), reward=float(rng.random() < 0.5)))
            group_ids.append(group)
    size = len(trajectories)
    return StepInput(trajectories, group_ids, [0] * size, [True] * size)


def _build(backend: str, hf_dir: Path, device: str, algo: AlgoConfig, dtype: torch.dtype,
           micro_batch_tokens: int, megatron: MegatronConfig) -> TorchLearner:
    optim = OptimConfig(lr=1e-6)
    if backend in ("torch", "torch-autocast"):
        from transformers import AutoModelForCausalLM

        from learner.forward.varlen_attention import register_varlen_sdpa

        autocast = None
        if backend == "torch-autocast":
            if dtype != torch.float32:
                raise ValueError("torch-autocast is bf16 autocast over fp32 weights; "
                                 "run it with dtype=float32")
            autocast = torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device)
        model.set_attn_implementation(register_varlen_sdpa())
        return TorchLearner(model, algo, optim, micro_batch_tokens=micro_batch_tokens,
                            autocast_dtype=autocast)
    if not device.startswith("cuda"):
        raise ValueError("the megatron learner benchmark needs CUDA (megatron-core hard-codes torch.cuda); "
                         "use device='cuda' or backend='torch'")
    from learner.backends.megatron.learner import MegatronLearner, init_model_parallel

    torch.cuda.set_device(torch.device(device))
    init_model_parallel(megatron, backend="nccl")
    return MegatronLearner(hf_dir, algo, optim, megatron, micro_batch_tokens=micro_batch_tokens, dtype=dtype,
                           device=torch.device("cuda", torch.cuda.current_device()))


def _peak_memory_mib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (KiB on Linux)


def bench_learner(backend: Literal["torch", "torch-autocast", "megatron"], *, device: str = "cpu",
                  shape: BenchShape | None = None, batch: BenchBatch | None = None,
                  objective: Literal["grpo", "vcpo"] = "grpo",
                  dtype: Literal["float32", "bfloat16"] = "float32", micro_batch_tokens: int = 4096,
                  steps: int = 3, warmup: int = 1, megatron: MegatronConfig | None = None,
                  seed: int = 0) -> dict[str, Any]:
    """Time `steps` learner steps (after `warmup`) on one random batch; a JSON-able dict of the results.

    `peak_memory_mib`: CUDA peak allocated bytes on GPUs; on CPU the process's peak RSS (includes
    everything the process ever held, e.g. the checkpoint written at the start).
    """
    shape, batch = shape or BenchShape(), batch or BenchBatch()
    algo = AlgoConfig.model_validate({"objective": {"type": objective}, "group_size": batch.group_size})
    torch_dtype = getattr(torch, dtype)
    with tempfile.TemporaryDirectory(prefix="vcpo-bench-learner-") as tmp:
        hf_dir = write_random_checkpoint(shape, Path(tmp) / "model", seed)
        learner = _build(backend, hf_dir, device, algo, torch_dtype, micro_batch_tokens,
                         megatron or MegatronConfig())
    step_input = random_batch(batch, shape.vocab_size, seed)
    for _ in range(warmup):
        learner.step(step_input)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        learner.step(step_input)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    tokens = batch.groups * batch.group_size * batch.tokens
    mean = sum(times) / len(times)
    return {
        "backend": backend, "device": device, "dtype": dtype, "objective": objective,
        "shape": asdict(shape), "batch": asdict(batch), "micro_batch_tokens": micro_batch_tokens,
        "parameters_on_rank": sum(p.numel() for p in learner.model.parameters()),
        "megatron": (megatron or MegatronConfig()).model_dump() if backend == "megatron" else None,
        "step_s": times, "step_s_mean": mean, "step_s_min": min(times),
        "tokens_per_step": tokens, "tokens_per_s": tokens / mean, "peak_memory_mib": _peak_memory_mib(device),
    }


def run_learner_bench(config: LearnerBenchConfig) -> dict[str, Any]:
    """`vcpo bench learner`: every configured backend on the same model and batch; a backend that cannot
    run here keeps its row with the reason; `vs_torch` = tokens/s relative to the torch learner."""
    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    shape = BenchShape(kind=config.kind, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                       intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                       num_attention_heads=config.num_attention_heads,
                       num_key_value_heads=config.num_key_value_heads)
    batch = BenchBatch(groups=config.groups, group_size=config.group_size, tokens=config.tokens,
                       sampled=config.sampled)
    results: dict[str, Any] = {}
    for backend in config.backends:
        try:
            results[backend] = bench_learner(backend, device=device, shape=shape, batch=batch,
                                             objective=config.objective, dtype=config.dtype,
                                             micro_batch_tokens=config.micro_batch_tokens, steps=config.steps,
                                             warmup=config.warmup)
        except (ValueError, RuntimeError, ImportError) as exc:
            results[backend] = {"backend": backend, "device": device, "error": f"{type(exc).__name__}: {exc}"}
    baseline = results.get("torch", {}).get("tokens_per_s")
    for result in results.values():
        if baseline and "tokens_per_s" in result:
            result["vs_torch"] = round(result["tokens_per_s"] / baseline, 3)
    return {"config": config.model_dump(mode="json"), "device": device, "results": results}
