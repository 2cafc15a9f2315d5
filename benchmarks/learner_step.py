"""Learner throughput: step time and its phases, tokens/s, peak memory, and model FLOPs/s as a fraction
of the matmul peak measured in the same run, for the torch and megatron learners.

`bench_learner` builds a random Llama/Qwen2-shaped checkpoint (`BenchShape`), one random minibatch of
groups (`BenchBatch`: each group's trajectories share their first `prompt` tokens, as a prompt is),
and times `steps` optimizer steps after `warmup` untimed ones, returning a JSON-able dict. The
defaults are the default run's step (SmolLM2-135M, 2 × 8 trajectories of 240 tokens, a shared 150-token
prompt, 70 sampled).

Model FLOPs (`model_flops`) are what one training step of the objective needs, whatever the
implementation: forward + backward (6 FLOPs per parameter per token) of every linear layer of the
body over all tokens, of the output head over the trained tokens only (no other position needs
logits), and of causal attention within each trajectory. Not counted: the separate proximal forward
(log π_old), the per-trajectory gradient norms, casts — overheads an implementation may avoid. The
fraction of peak (`mfu`) divides model FLOPs/s by the best n×n×n GEMM rate of the learner's matmul
dtype (bf16 under autocast), measured right after the timed steps in the same process and threads.
`roofline_fraction` is the share of the step the step's own matmuls would take at the measured peaks
of the dtypes they run in (the proximal pass included) — how far the implementation is from its
own matmul bound. `kernel_floor` (`benchmarks/kernel_floor.py`) is a tighter bound: the step's own
kernels (its products at their shapes, its attention, VCPO's norm Grams, the proximal forward) timed
alone at the rates they reach here, and `step_over_floor` how far the step is above it; its
`mfu_at_floor` is the most `mfu` those kernels allow on this host.

The megatron backend needs CUDA (megatron-core hard-codes it) and a process group of TP ranks
(torchrun for TP > 1); the torch backend runs on CPU or one GPU, in the weights' dtype ('torch')
or under bf16 autocast over fp32 weights ('torch-autocast', `learner.autocast=bfloat16`). A bf16 row
on a device that only emulates bf16 is skipped at once, with the reason (it would run for minutes).

What it does not do: read configs or print (the CLI does), generate with an engine (the behaviour
log-probs are random near the model's), or measure weight sync.
"""

from __future__ import annotations

import json
import logging
import math
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import torch

from benchmarks.kernel_floor import best_seconds, kernel_floor
from benchmarks.schema import LearnerBenchConfig
from benchmarks.workload import BenchBatch, BenchShape
from configs.schema import AlgoConfig, LoraSettings, MegatronConfig, OptimConfig
from learner.backends.torch_learner import StepInput, TorchLearner
from learner.forward.fused_layers import resolve as resolve_fused_elementwise
from learner.forward.logprobs import native_bf16
from rollout.trajectory import Trajectory, TrajectoryVersions
from run.launch.host import host_description
from run.train.learner_setup import learner_device

log = logging.getLogger(__name__)


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
    """Random token ids and rewards; behaviour log-probs near a uniform policy's −log V (IS weights ~ 1).
    Every group's rewards differ: a group whose members all scored alike adds nothing to the gradient, so
    the learner leaves its gradient pass out and the step would time less than it claims (its last member's
    reward is flipped where the draw made them alike)."""
    rng = random.Random(seed)
    uniform = -torch.log(torch.tensor(float(vocab_size))).item()
    trajectories, group_ids = [], []
    for group in range(batch.groups):
        prompt = tuple(rng.randrange(vocab_size) for _ in range(batch.prompt))
        mask = batch.loss_mask()
        for member in range(batch.group_size):
            rest = tuple(rng.randrange(vocab_size) for _ in range(batch.tokens - batch.prompt))
            trajectories.append(Trajectory(
                trajectory_id=f"b{group}.{member}", group_id=str(group),
                token_ids=prompt + rest, loss_mask=mask,
                behavior_logprobs=tuple(uniform + rng.gauss(0, 0.01) if m else 0.0 for m in mask),
                versions=TrajectoryVersions(start=0, end=0), reward=float(rng.random() < 0.5)))
            group_ids.append(group)
        members = trajectories[-batch.group_size:]
        if len({member.reward for member in members}) == 1:
            members[-1] = members[-1].model_copy(update={"reward": 1.0 - members[-1].reward})
            trajectories[-1] = members[-1]
    size = len(trajectories)
    return StepInput(trajectories, group_ids, [0] * size, [True] * size)


def _linear_parameters(shape: BenchShape) -> tuple[int, int]:
    """(body, head): weights of the body's linear layers (attention and MLP, all layers) and of the
    output head, as HF Llama/Qwen2 lay them out (biases ignored: negligible)."""
    layer = sum(i * o for i, o in shape.body_linears())
    return shape.num_hidden_layers * layer, shape.vocab_size * shape.hidden_size


def model_flops(shape: BenchShape, batch: BenchBatch) -> dict[str, float]:
    """FLOPs one training step of the minibatch needs (see the module docstring): forward + backward
    of the body's linear layers over all tokens, of the head over the trained tokens, and of causal
    attention inside each trajectory; plus what a separate proximal forward adds on top."""
    body, head = _linear_parameters(shape)
    trajectories = batch.groups * batch.group_size
    tokens, trained = trajectories * batch.tokens, trajectories * batch.sampled
    q_width = shape.hidden_size // shape.num_attention_heads * shape.num_attention_heads
    # causal QKᵀ and PV: 2 × 2 × width × T(T+1)/2 multiply-adds per layer and trajectory, forward
    attention_forward = (shape.num_hidden_layers * trajectories * 2 * q_width
                         * batch.tokens * (batch.tokens + 1))
    forward = 2 * body * tokens + 2 * head * trained + attention_forward
    return {"model_flops": 3.0 * forward, "forward_flops": float(forward),
            "proximal_forward_flops": float(forward)}


def matmul_peak_gflops(dtype: torch.dtype, device: str, size: int = 4096, repeats: int = 8) -> float:
    """The best rate of an n×n×n matrix product in `dtype` on `device` (GFLOP/s) over `repeats` runs,
    after one warm-up: the matmul peak the learner's FLOPs are measured against, on the same threads.
    Best-of, because the host's clock and memory bandwidth swing (2.5× between two readings of a
    2048³ product here, minutes apart): the peak is what the hardware can do, not what it did once."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2.0 * size**3 / best_seconds(lambda: torch.mm(a, b), device, repeats) / 1e9


def unsupported_reason(backend: str, device: str, dtype: str) -> str | None:
    """Why `backend` in `dtype` would not run at hardware speed here (None: it would)."""
    matmul = _matmul_dtype(backend, dtype)
    if matmul == "bfloat16" and not native_bf16(torch.device(device)):
        return (f"{device} does bf16 matmuls only in emulation here (no AVX-512-BF16/AMX): a step would "
                "take minutes; run backends=[torch] dtype=float32, or force_emulated=true to time it anyway")
    return None


def _matmul_dtype(backend: str, dtype: str) -> str:
    """The dtype a backend's matmuls run in: bf16 under autocast, else the weights'."""
    return "bfloat16" if backend.startswith("torch-autocast") else dtype


def _build(backend: str, hf_dir: Path, device: str, algo: AlgoConfig, dtype: torch.dtype,
           micro_batch_tokens: int, megatron: MegatronConfig, proximal: str = "auto",
           share_prompts: bool = True, fused_elementwise: bool = False, recompute: bool = False,
           logits_chunk_mib: float | None = None, lora: LoraSettings | None = None) -> TorchLearner:
    optim = OptimConfig(lr=1e-6)
    if backend.endswith("-lora"):
        if lora is None:
            raise ValueError(f"{backend}: a LoRA row needs the adapters' settings (lora)")
        backend = backend.removesuffix("-lora")
    else:
        lora = None
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
        if recompute:
            model.gradient_checkpointing_enable()
        return TorchLearner(model, algo, optim, micro_batch_tokens=micro_batch_tokens,
                            autocast_dtype=autocast, proximal=proximal, share_prompts=share_prompts,
                            fused_elementwise=fused_elementwise, logits_chunk_mib=logits_chunk_mib,
                            lora=lora)
    if recompute and megatron.recompute_granularity is None:  # HF's gradient checkpointing: every layer
        megatron = megatron.model_copy(update={"recompute_granularity": "full"})
    if not device.startswith("cuda"):
        raise ValueError("the megatron learner benchmark needs CUDA (megatron-core hard-codes torch.cuda); "
                         "use device='cuda' or backend='torch'")
    from learner.backends.megatron.learner import MegatronLearner, init_model_parallel

    torch.cuda.set_device(torch.device(device).index or 0)  # set_device refuses a bare 'cuda'
    init_model_parallel(megatron, backend="nccl")
    return MegatronLearner(hf_dir, algo, optim, megatron, micro_batch_tokens=micro_batch_tokens, dtype=dtype,
                           device=torch.device("cuda", torch.cuda.current_device()), proximal=proximal)


def _peak_memory_mib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (KiB on Linux)


PHASES = ("time/learner_proximal", "time/learner_gradient", "time/learner_optimizer")


def bench_learner(backend: str, *, device: str = "cpu",
                  shape: BenchShape | None = None, batch: BenchBatch | None = None,
                  objective: Literal["grpo", "vcpo"] = "grpo",
                  grad_norm_path: Literal["fast", "per_trajectory"] = "fast",
                  dtype: Literal["float32", "bfloat16"] = "float32", micro_batch_tokens: int = 4096,
                  steps: int = 3, warmup: int = 1, megatron: MegatronConfig | None = None,
                  proximal: str = "auto", share_prompts: bool = True, fused_elementwise: bool = False,
                  peak_gemm_size: int = 4096, seed: int = 0, recompute: bool = False,
                  logits_chunk_mib: float | None = 512.0, hf_dir: Path | None = None,
                  with_kernel_floor: bool = True, lora: dict[str, Any] | None = None) -> dict[str, Any]:
    """Time `steps` learner steps (after `warmup`) on one random batch; a JSON-able dict of the results.

    `peak_memory_mib`: CUDA peak allocated bytes on GPUs; on CPU the process's peak RSS (includes
    everything the process ever held, e.g. the checkpoint written at the start). `recompute`: activation
    recompute (`model.gradient_checkpointing`; on megatron its 'full' recompute of every layer unless
    `megatron` sets its own); `logits_chunk_mib`: `learner.logits_chunk_mib`; `hf_dir`:
    a random checkpoint written already (else one is written here); `with_kernel_floor`: also time the
    step's kernels alone. A '-lora' backend trains `lora`'s adapters on the frozen base; its FLOPs and MFU
    count a full-weight step (LoRA skips the base's weight gradients): compare its time. No kernel floor.
    """
    adapters = LoraSettings.model_validate(lora or {}) if backend.endswith("-lora") else None
    with_kernel_floor = with_kernel_floor and adapters is None
    shape, batch = shape or BenchShape(), batch or BenchBatch()
    fused_elementwise = fused_elementwise and backend != "megatron"  # a torch-learner option
    norms = {"opob": {"grad_norm_path": grad_norm_path}} if objective == "vcpo" else {}
    algo = AlgoConfig.model_validate({"objective": {"type": objective, **norms},
                                      "group_size": batch.group_size})
    torch_dtype = getattr(torch, dtype)
    with tempfile.TemporaryDirectory(prefix="vcpo-bench-learner-") as tmp:
        if hf_dir is None:
            hf_dir = write_random_checkpoint(shape, Path(tmp) / "model", seed)
        built = time.perf_counter()
        learner = _build(backend, hf_dir, device, algo, torch_dtype, micro_batch_tokens,
                         megatron or MegatronConfig(), proximal, share_prompts, fused_elementwise,
                         recompute, logits_chunk_mib, adapters)
        # progress on stderr (`vcpo -v`): a bench cut at a time limit writes no JSON, its log says where
        log.info("%s: learner built in %.1f s", backend, time.perf_counter() - built)
    step_input = random_batch(batch, shape.vocab_size, seed)
    matmul_dtype = _matmul_dtype(backend, dtype)
    matmul_dtypes = dict.fromkeys([matmul_dtype, dtype])
    peaks_before = {name: matmul_peak_gflops(getattr(torch, name), device, peak_gemm_size)
                    for name in matmul_dtypes}
    for index in range(warmup):
        started = time.perf_counter()
        learner.step(step_input)
        log.info("%s: warm-up step %d took %.2f s", backend, index, time.perf_counter() - started)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, phases = [], {name: [] for name in PHASES}
    for _ in range(steps):
        started = time.perf_counter()
        metrics = learner.step(step_input)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        log.info("%s: timed step %d took %.3f s", backend, len(times) - 1, times[-1])
        for name in PHASES:
            phases[name].append(float(metrics.get(name, math.nan)))
    tokens = batch.groups * batch.group_size * batch.tokens
    mean = sum(times) / len(times)
    # the peaks, before and after the timed steps (the better of the two): same process and threads
    peaks = {name: max(peaks_before[name], matmul_peak_gflops(getattr(torch, name), device, peak_gemm_size))
             for name in matmul_dtypes}
    flops = model_flops(shape, batch)
    model_gflops_per_s = flops["model_flops"] / mean / 1e9
    # the step's own matmuls at the peaks of their dtypes: a separate proximal forward in the weights'
    # dtype, the gradient passes in the matmul dtype
    reuses = bool(getattr(learner, "reuses_gradient_forward", False))
    # … over the tokens it forwarded: a group's shared prompt once (`share_prompts`)
    forwarded = 1.0 - float(metrics.get("train/prompt_tokens_shared", 0.0)) / tokens
    proximal_flops = 0.0 if reuses else flops["proximal_forward_flops"] * forwarded
    roofline_s = (proximal_flops / (peaks[dtype] * 1e9) + flops["model_flops"] / (peaks[matmul_dtype] * 1e9))
    optimizer_s = sum(phases["time/learner_optimizer"]) / steps
    floor = None if backend == "megatron" or not with_kernel_floor else kernel_floor(
        shape, batch, micro_batch_tokens=micro_batch_tokens, matmul_dtype=getattr(torch, matmul_dtype),
        weight_dtype=torch_dtype, per_trajectory_norms=objective == "vcpo", separate_proximal=not reuses,
        share_prompts=share_prompts, optimizer_s=optimizer_s, model_flops=flops["model_flops"],
        peak_gflops=peaks[matmul_dtype], device=device)
    return {
        "backend": backend, "device": device, "dtype": dtype, "matmul_dtype": matmul_dtype,
        "objective": objective, "grad_norm_path": grad_norm_path if objective == "vcpo" else None,
        "proximal": proximal, "reuses_gradient_forward": reuses, "recompute": recompute,
        "logits_chunk_mib": logits_chunk_mib,
        "share_prompts": share_prompts, "fused_elementwise": fused_elementwise,
        "prompt_tokens_shared_per_step": float(metrics.get("train/prompt_tokens_shared", 0.0)),
        "shape": asdict(shape), "batch": asdict(batch), "micro_batch_tokens": micro_batch_tokens,
        "parameters_on_rank": sum(p.numel() for p in learner.model.parameters()),
        "trained_parameters": sum(p.numel() for p in learner.model.parameters() if p.requires_grad),
        "lora": adapters.model_dump() if adapters is not None else None,
        "megatron": (megatron or MegatronConfig()).model_dump() if backend == "megatron" else None,
        "skipped_groups_per_step": float(metrics.get("train/skipped_groups", 0.0)),
        "step_s": times, "step_s_mean": mean, "step_s_min": min(times),
        "phases_s_mean": {name.removeprefix("time/learner_"): sum(v) / len(v) for name, v in phases.items()},
        "tokens_per_step": tokens, "tokens_per_s": tokens / mean, "peak_memory_mib": _peak_memory_mib(device),
        "model_flops_per_step": flops["model_flops"], "model_gflops_per_s": model_gflops_per_s,
        "matmul_peak_gflops": peaks, "mfu": model_gflops_per_s / peaks[matmul_dtype],
        "roofline_fraction": roofline_s / mean,
        "kernel_floor": floor, "step_over_floor": None if floor is None else mean / floor["total_s"],
    }


def run_learner_bench(config: LearnerBenchConfig) -> dict[str, Any]:
    """`vcpo bench learner`: every configured backend on the same model and batch; a backend that cannot
    run here keeps its row with the reason; `vs_torch` = tokens/s relative to the torch learner. With a
    `sweep`, the long-trajectory sweep instead (`run_learner_sweep`)."""
    if config.sweep is not None:
        return run_learner_sweep(config)
    device = learner_device(config.device)
    shape = _shape(config)
    batch = BenchBatch(groups=config.groups, group_size=config.group_size, tokens=config.tokens,
                       sampled=config.sampled, prompt=config.prompt)
    fused, _ = resolve_fused_elementwise(config.fused_elementwise, torch.device(device))  # as in a run
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="vcpo-bench-learner-") as tmp:
        hf_dir = write_random_checkpoint(shape, Path(tmp) / "model") if config.isolate else None
        for backend in config.backends:
            skip = _skip_reason(config, backend, device)
            if skip is not None:
                results[backend] = {"backend": backend, "device": device, "skipped": skip}
                continue
            kwargs = {"backend": backend, "device": device, "shape": asdict(shape), "batch": asdict(batch),
                      "objective": config.objective, "grad_norm_path": config.grad_norm_path,
                      "dtype": config.dtype, "micro_batch_tokens": config.micro_batch_tokens,
                      "steps": config.steps, "warmup": config.warmup, "proximal": config.proximal,
                      "share_prompts": config.share_prompts, "fused_elementwise": fused,
                      "peak_gemm_size": config.peak_gemm_size, "logits_chunk_mib": config.logits_chunk_mib,
                      "hf_dir": str(hf_dir) if hf_dir is not None else None,
                      "lora": config.lora.model_dump(mode="json")}
            results[backend] = {"backend": backend, "device": device,
                                **_sweep_row(kwargs, config.isolate, timeout_s=3600.0)}
    baseline = results.get("torch", {}).get("tokens_per_s")
    for result in results.values():
        if baseline and "tokens_per_s" in result:
            result["vs_torch"] = round(result["tokens_per_s"] / baseline, 3)
        full = results.get(result["backend"].removesuffix("-lora"), {})
        if result["backend"].endswith("-lora") and "step_s_mean" in result and "step_s_mean" in full:
            memory = result["peak_memory_mib"] / full["peak_memory_mib"]
            result["vs_full_weights"] = {"step_s": round(result["step_s_mean"] / full["step_s_mean"], 3),
                                         "peak_memory": round(memory, 3)}
    return {"config": config.model_dump(mode="json"), "device": device, "host": host_description(),
            "results": results}


def _shape(config: LearnerBenchConfig) -> BenchShape:
    return BenchShape(kind=config.kind, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                      intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
                      num_attention_heads=config.num_attention_heads,
                      num_key_value_heads=config.num_key_value_heads)


def _skip_reason(config: LearnerBenchConfig, backend: str, device: str) -> str | None:
    if config.force_emulated or backend == "megatron":
        return None
    return unsupported_reason(backend, device, config.dtype)


SWEEP_STEPS = {"grpo": ("grpo", "fast"), "vcpo_fast": ("vcpo", "fast"),
               "vcpo_per_trajectory": ("vcpo", "per_trajectory")}
"""A sweep row → (objective, VCPO's norm path)."""


def sweep_batch(config: LearnerBenchConfig, length: int) -> BenchBatch:
    """The sweep's minibatch at `length` tokens a trajectory (its shares of prompt and sampled tokens)."""
    sweep = config.sweep
    assert sweep is not None
    sampled = max(sweep.turns, round(sweep.sampled_share * length))
    prompt = min(round(sweep.prompt_share * length), length - sampled - 1)
    return BenchBatch(groups=config.groups, group_size=config.group_size, tokens=length, sampled=sampled,
                      prompt=max(prompt, 1), turns=sweep.turns)


def run_learner_sweep(config: LearnerBenchConfig) -> dict[str, Any]:
    """Every backend × length × recompute × row of `config.sweep` (module docstring), each in its own process
    where `sweep.isolate`; a row that fails or runs out of memory keeps its place with the reason.
    `ratios`: each row's mean step time over GRPO's at the same backend, length and recompute."""
    sweep = config.sweep
    assert sweep is not None
    device = learner_device(config.device)
    shape = _shape(config)
    fused, _ = resolve_fused_elementwise(config.fused_elementwise, torch.device(device))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="vcpo-bench-learner-sweep-") as tmp:
        hf_dir = write_random_checkpoint(shape, Path(tmp) / "model")
        for backend in config.backends:
            skip = _skip_reason(config, backend, device)
            for length in sweep.lengths:
                batch = sweep_batch(config, length)
                for recompute in sweep.recompute:
                    for name in sweep.rows:
                        objective, path = SWEEP_STEPS[name]
                        where = {"backend": backend, "row": name, "length": length, "recompute": recompute}
                        if skip is not None:
                            rows.append({**where, "skipped": skip})
                            continue
                        kwargs = {"backend": backend, "device": device, "shape": asdict(shape),
                                  "batch": asdict(batch), "objective": objective, "grad_norm_path": path,
                                  "dtype": config.dtype,
                                  "micro_batch_tokens": max(config.micro_batch_tokens, length),
                                  "steps": config.steps, "warmup": config.warmup, "proximal": config.proximal,
                                  "share_prompts": config.share_prompts, "fused_elementwise": fused,
                                  "peak_gemm_size": config.peak_gemm_size, "recompute": recompute,
                                  "logits_chunk_mib": config.logits_chunk_mib, "hf_dir": str(hf_dir),
                                  "with_kernel_floor": False}
                        log.info("sweep: %s %s at %d tokens, recompute %s", backend, name, length, recompute)
                        rows.append({**where, **_sweep_row(kwargs, sweep.isolate, sweep.row_timeout_s)})
    return {"config": config.model_dump(mode="json"), "device": device, "host": host_description(),
            "rows": rows, "ratios": sweep_ratios(rows)}


def sweep_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (backend, length, recompute): each timed row's mean step time ÷ GRPO's, and its peak memory."""
    grpo = {(r["backend"], r["length"], r["recompute"]): r["step_s_mean"]
            for r in rows if r["row"] == "grpo" and "step_s_mean" in r}
    out = []
    for r in rows:
        key = (r["backend"], r["length"], r["recompute"])
        if r["row"] != "grpo" and "step_s_mean" in r and key in grpo:
            out.append({"backend": r["backend"], "length": r["length"], "recompute": r["recompute"],
                        "row": r["row"], "over_grpo": r["step_s_mean"] / grpo[key]})
    return out


def _sweep_row(kwargs: dict[str, Any], isolate: bool, timeout_s: float) -> dict[str, Any]:
    """One sweep row's result (or its error), run here or in a fresh process."""
    if not isolate:
        try:
            return bench_learner(**_row_arguments(kwargs))
        except (ValueError, RuntimeError, ImportError) as exc:  # an OOM is a RuntimeError too
            return {"error": f"{type(exc).__name__}: {exc}"}
    code = "from benchmarks.learner_step import sweep_row_main; sweep_row_main()"
    try:
        done = subprocess.run([sys.executable, "-c", code], input=json.dumps(kwargs), capture_output=True,
                              text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    sys.stderr.write(done.stderr)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def _row_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {**kwargs, "shape": BenchShape(**kwargs["shape"]), "batch": BenchBatch(**kwargs["batch"]),
            "hf_dir": Path(kwargs["hf_dir"]) if kwargs.get("hf_dir") else None}


def sweep_row_main() -> None:
    """A sweep row in a fresh process: its arguments as JSON on stdin, its result as one JSON line on stdout
    (an error as {"error": ...})."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    kwargs = json.loads(sys.stdin.read())
    try:
        result = bench_learner(**_row_arguments(kwargs))
    except (ValueError, RuntimeError, ImportError) as exc:
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result))
