"""The `vcpo bench` configurations: one typed, documented schema per benchmark (the files beside it in
`benchmarks/configs/` are their shipped presets). Imports only pydantic and the run's schemas, so any
machine can check a benchmark config."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from configs.base import StrictModel
from configs.schema import LoraSettings


class OpobBenchConfig(StrictModel):
    """`vcpo bench opob`: cost of a VCPO step (fast and per-trajectory norms) vs a plain GRPO step."""

    model: str = "tiny-smollm2-shape"
    """'tiny-smollm2-shape' (random weights, SmolLM2-135M's shape), 'tiny' (2-layer), or a model spec
    as in model.path (e.g. 'default')."""
    num_trajectories: int = Field(8, ge=2)
    """Trajectories in the packed batch (two groups of half that size)."""
    lengths: list[Annotated[int, Field(ge=8)]] = Field(default_factory=lambda: [128, 512, 2048])
    """Trajectory lengths (tokens) to measure, one table row each."""
    prompt_fraction: float = Field(0.25, ge=0, lt=1)
    """Share of each trajectory that is prompt (loss_mask 0)."""
    repeats: int = Field(3, ge=1)
    """Timed repeats per measurement (median reported)."""
    warmup_rounds: int = Field(1, ge=0)
    """Untimed rounds before the timed ones (0 for very long steps, where warm-up is negligible)."""
    per_trajectory_max_length: int = Field(2048, ge=8)
    """Skip the slow per-trajectory path above this length (it is reported as skipped)."""
    micro_batch_tokens: int = Field(8192, ge=64)
    """Token budget of one packed micro-batch."""
    seed: int = 0
    """Seed of the random batch and model."""
    device: str = "cpu"
    """'cpu', 'cuda', 'cuda:N' or 'auto' (cuda when available, else cpu)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the model (bf16 on GPUs; the IS and norm arithmetic stays fp32)."""


class AsyncBenchConfig(StrictModel):
    """`vcpo bench async`: wall time of the same training workload at several lag bounds k."""

    run_config: str = "configs/default.yaml"
    """The run config whose workload (model, task, algo, batch) every k trains."""
    lags: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [0, 1, 2, 4])
    """Lag bounds to compare; 0 (synchronous) is the baseline of the speedups."""
    steps: int = Field(16, ge=1)
    """Optimizer steps per k (the same for all); the first k + 1 are the pipeline fill and the last k the
    drain, the steps between them the steady state (benchmarks/asynchrony.py)."""
    overrides: list[str] = Field(default_factory=list)
    """a.b.c=value overrides applied to the run config (e.g. a smaller model or batch)."""
    run_root: str = "runs/bench-async"
    """Where each k's run directory goes (wiped first)."""


def check_bench_lengths(tokens: int, prompt: int, sampled: int) -> None:
    """The learner bench's trajectory layout: a shared prompt and the trained tail must both fit in it
    (`LearnerBenchConfig` and the bench's own `BenchBatch` apply this one rule)."""
    if prompt + sampled > tokens:
        raise ValueError(f"prompt ({prompt}) + sampled ({sampled}) must not exceed tokens ({tokens}); "
                         "lower one of them")


class MainJobBenchConfig(StrictModel):
    """`vcpo bench main_job`: the main job (`vcpo train` of `config`) once per seed, each run's small files
    kept as evidence, and the summary every figure of the main job's claim comes from — held-out success
    at every evaluation, start → end gain with its 95% interval, wall time by phase, the host
    (benchmarks/main_job.py)."""

    config: str = "configs/default.yaml"
    """The run config each seed trains (relative paths start at the repository root)."""
    overrides: list[str] = Field(default_factory=list)
    """a.b.c=value overrides applied to every seed's run (after `seed` and `run_dir`)."""
    seeds: list[int] = Field(default_factory=lambda: [31, 32, 33], min_length=1)
    """The seeds, fixed before any of them runs."""
    runs_dir: str = "runs/main_job"
    """Where each seed trains (`<runs_dir>/seed_<s>`; checkpoints and exports stay here, uncommitted)."""
    evidence_dir: str = "docs/results/main_job_runs"
    """Where each finished seed's small files are copied (`<evidence_dir>/seed_<s>`): config, task,
    summary.json, metrics.jsonl, trajectories.jsonl (without the episodes' text), eval/*.jsonl, timing.json.
    A seed already here is not run again."""
    run: bool = True
    """False: summarize the evidence already stored, run nothing (a seed without evidence is an error)."""
    min_gain: float = Field(0.10, ge=0, le=1)
    """The claim: every seed's held-out success rises by at least this (a fraction) with its interval
    above 0, and no evaluation falls significantly below the start."""
    base_model: bool = False
    """Also evaluate the model before its warm start, per seed, on the same sets with the same settings and
    seed (`vcpo train` of the config with warm_start.enabled=false and --stop-after-step 0): the baseline
    the warm start and RL are measured from."""
    baselines: dict[str, str] = Field(default_factory=dict)
    """Other arms to compare with: a name → the evidence_dir of another `vcpo bench main_job` run of the
    same seeds and sets (e.g. the same task without compaction). Per seed and set, the summary gives this
    arm's final success minus the baseline's, paired by prompt, with its 95% interval (`versus`)."""


LearnerSweepRow = Literal["grpo", "vcpo_fast", "vcpo_per_trajectory"]
"""A step the long-trajectory sweep times: GRPO, VCPO with its packed per-trajectory norms, or VCPO with one
backward per trajectory."""


class LearnerSweepConfig(StrictModel):
    """`vcpo bench learner` at long trajectories (benchmarks/learner_step.py `run_learner_sweep`): every
    length × recompute × row on the config's model, `groups × group_size` multi-turn trajectories of each
    length (a prompt, `turns` sampled segments with tool outputs between), one trajectory per micro-batch
    (or more, if `micro_batch_tokens` is larger), each row in a fresh process so its peak memory is its
    own."""

    lengths: list[Annotated[int, Field(ge=64)]] = Field(default_factory=lambda: [2048, 8192, 16384])
    """Tokens per trajectory."""
    rows: list[LearnerSweepRow] = Field(default_factory=lambda: ["grpo", "vcpo_fast", "vcpo_per_trajectory"])
    """The steps timed at each length; the ratios are against 'grpo'."""
    recompute: list[bool] = Field(default_factory=lambda: [False, True])
    """Activation recompute off and/or on (`model.gradient_checkpointing`)."""
    turns: int = Field(4, ge=1)
    """Sampled segments per trajectory (tool outputs between them)."""
    prompt_share: float = Field(0.1, ge=0.0, lt=1.0)
    """The prompt's share of a trajectory's tokens."""
    sampled_share: float = Field(0.6, gt=0.0, le=1.0)
    """The sampled (trained) share; the rest are tool outputs."""
    isolate: bool = True
    """Each row in its own process (peak RSS on CPU is a process's lifetime peak)."""
    row_timeout_s: float = Field(1800.0, gt=0)
    """A row still running after this long is stopped and reported as timed out."""

    @model_validator(mode="after")
    def _check_shares(self) -> LearnerSweepConfig:
        if self.prompt_share + self.sampled_share > 1.0:
            raise ValueError(f"prompt_share ({self.prompt_share}) + sampled_share ({self.sampled_share}) "
                             "must not exceed 1")
        return self


LearnerBackend = Literal["torch", "torch-autocast", "torch-lora", "torch-autocast-lora", "megatron"]
"""A `vcpo bench learner` row's learner (LearnerBenchConfig.backends)."""


class LearnerBenchConfig(StrictModel):
    """`vcpo bench learner` (benchmarks/learner_step.py): optimizer steps of each learner backend
    on one random minibatch of a random model, by default the default run's step (SmolLM2-135M's shape,
    2 groups × 8 trajectories of 240 tokens with a shared 150-token prompt and 70 sampled tokens, 2048-
    token micro-batches, VCPO with fast norms). Reports step time and its phases, tokens/s, peak memory,
    model FLOPs/s and their fraction of the matmul peak of the learner's dtype, measured in the same run
    (a large GEMM), the torch learner's kernel floor (its own kernels timed alone) and each backend's speed
    relative to the torch learner."""

    backends: list[LearnerBackend] = Field(default_factory=lambda: ["torch", "torch-autocast", "megatron"])
    """Backends to time: 'torch' (in `dtype`), 'torch-autocast' (the torch learner with
    learner.autocast=bfloat16 over fp32 weights), each with '-lora' (LoRA adapters, `lora`, on the frozen
    base: only they get gradients and optimizer state), 'megatron'. One that cannot run here (megatron
    without CUDA, autocast with bf16 weights, bf16 on a CPU that only emulates it) is reported with its
    reason."""
    lora: LoraSettings = Field(default_factory=lambda: LoraSettings(rank=16, alpha=32.0))
    """The '-lora' rows' adapters (configs/default_lora.yaml's)."""
    isolate: bool = False
    """Each backend in a fresh process, so its peak memory (peak RSS on a CPU) is its own, not the
    largest of the rows before it."""
    device: str = "auto"
    """'auto' (cuda when available, else cpu), 'cpu' or 'cuda'."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the learners (bf16 on GPUs)."""
    objective: Literal["grpo", "vcpo"] = "vcpo"
    """The step timed: plain GRPO, or VCPO with its per-trajectory gradient norms."""
    grad_norm_path: Literal["fast", "per_trajectory"] = "fast"
    """VCPO's norms (`algo.objective.opob.grad_norm_path`): the packed hooks, or one backward per
    trajectory (what megatron falls back to when a layer is split over ranks)."""
    proximal: Literal["separate", "reuse", "auto"] = "auto"
    """Where log π_old comes from (`learner.proximal`: a separate forward, or the gradient pass's)."""
    share_prompts: bool = True
    """Forward each group's common prompt once where no per-trajectory hook needs it
    (`learner.share_prompts`; the run's default). False: every trajectory forwards its whole prompt."""
    fused_elementwise: bool | Literal["auto"] = False
    """The torch learners' gradient forward with fused RMSNorm, rotary and SiLU·up kernels
    (`learner.fused_elementwise`; 'auto': where torch.compile can build them)."""
    kind: Literal["llama", "qwen2"] = "llama"
    """Architecture of the random model."""
    hidden_size: int = Field(576, ge=8)
    """Model width (defaults: SmolLM2-135M's shape)."""
    intermediate_size: int = Field(1536, ge=8)
    """MLP width."""
    num_hidden_layers: int = Field(30, ge=1)
    """Transformer layers."""
    num_attention_heads: int = Field(9, ge=1)
    """Query heads."""
    num_key_value_heads: int = Field(3, ge=1)
    """Key/value heads (grouped-query attention)."""
    vocab_size: int = Field(49152, ge=16)
    """Vocabulary size."""
    groups: int = Field(2, ge=1)
    """Groups in the minibatch (the default run: 2 prompts per step)."""
    group_size: int = Field(8, ge=2)
    """Trajectories per group (the default run: 8)."""
    tokens: int = Field(240, ge=2)
    """Tokens per trajectory (the default run's warm-started episodes: ~300)."""
    prompt: int = Field(150, ge=0)
    """Leading tokens shared by a group's trajectories, as a prompt is (the default run: 148–152)."""
    sampled: int = Field(70, ge=1)
    """Trained (sampled) tokens at the end of each trajectory (the default run: ~70)."""
    micro_batch_tokens: int = Field(2048, ge=1)
    """Packed micro-batch budget (the default run's `learner.micro_batch_tokens`)."""
    steps: int = Field(3, ge=1)
    """Timed steps (after `warmup` untimed ones)."""
    warmup: int = Field(1, ge=0)
    """Untimed steps first (allocator and kernel warm-up)."""
    peak_gemm_size: int = Field(4096, ge=64)
    """n of the n×n×n GEMM whose best time over 8 repeats, before and after the timed steps, is the
    measured matmul peak."""
    force_emulated: bool = False
    """Run a bf16 backend even where the device only emulates bf16 (minutes per step on AVX2-only CPUs);
    by default such a row is skipped at once with the reason."""
    logits_chunk_mib: float | None = Field(512.0, gt=0)
    """`learner.logits_chunk_mib`: the output head in chunks where a micro-batch's logits would pass it."""
    sweep: LearnerSweepConfig | None = None
    """Time long trajectories instead of the one step above: every length × recompute × row
    (benchmarks/configs/learner_long.yaml); `tokens`, `prompt`, `sampled` are then the sweep's."""

    @model_validator(mode="after")
    def _check_lengths(self) -> LearnerBenchConfig:
        check_bench_lengths(self.tokens, self.prompt, self.sampled)
        return self


class SandboxBenchConfig(StrictModel):
    """`vcpo bench sandbox`: local sandbox latency/throughput vs a bare `python3 -c`, same run."""

    num_calls: int = Field(200, ge=10)
    """Calls per measurement (latency percentiles and each concurrency level)."""
    concurrencies: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 8, 32])
    """Concurrent calls in flight for the throughput measurements."""


class EngineBenchConfig(StrictModel):
    """`vcpo bench engine`: tokens/s per backend vs HF `generate`, in paired rounds
    (benchmarks/engine.py)."""

    model: str = "default"
    """Model spec as in model.path."""
    backends: list[Literal["hf", "vllm"]] = Field(default_factory=lambda: ["hf", "vllm"])
    """Engines to measure (those that cannot start here are reported as unavailable)."""
    concurrencies: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 8, 32])
    """Concurrent requests in flight."""
    max_new_tokens: int = Field(128, ge=1)
    """Tokens generated per request."""
    min_requests: int = Field(8, ge=1)
    """Requests per measurement at least (max(concurrency, min_requests))."""
    rounds: int = Field(3, ge=1)
    """Paired rounds: each measures every backend and the baseline back to back at each concurrency; the
    speedup reported is the median of the rounds' ratios (the JSON has every round's)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Model dtype in every engine and in the baseline."""
    vllm_use_eager: bool = False
    """vLLM without torch.compile (the engine default is compiled: faster decode, slower start-up)."""
