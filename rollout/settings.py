"""Engine settings: one frozen, documented pydantic model per backend, tagged on `backend`.

Imports only pydantic, so settings can be validated on any machine (no torch, no vLLM). The CLI
builds these from the run config and hands them to `rollout.engines.factory.build_engine`; engines read
nothing else (no environment variables, no config files). Where a backend needs environment
variables (vLLM-CPU), its settings hold the values and the engine sets them at start-up.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StrictFrozenModel(BaseModel):
    """Frozen, rejects unknown keys, one-line docstring per field (becomes its description)."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, use_attribute_docstrings=True, protected_namespaces=()
    )


Dtype = Literal["float32", "bfloat16", "float16"]


class HFEngineSettings(StrictFrozenModel):
    """The HF transformers engine: our own batched decode loop over a KV cache (CPU or one GPU)."""

    backend: Literal["hf"] = "hf"
    """Backend name."""
    dtype: Dtype = "float32"
    """Parameter dtype. float32 keeps engine and fp32 learner logprobs within ~1e-5."""
    device: str = "cpu"
    """torch device of the model, e.g. 'cpu' or 'cuda:0'."""
    max_batch_size: int = Field(32, gt=0)
    """Most sequences decoded together; more requests wait in the queue."""
    batch_window_s: float = Field(0.005, ge=0)
    """When idle, wait this long after the first request for others to join its batch."""
    max_model_len: int | None = Field(None, gt=0)
    """Prompt + generated tokens cap (finish_reason='length'); None = the model's max positions."""
    seed: int = 0
    """Seeds the engine generator that draws seeds for requests that bring none."""
    use_kv_recompute_on_update: bool = True
    """After load_weights, recompute the KV cache of in-flight sequences with the new weights
    (every later token is sampled exactly from the new policy). False keeps the stale KV (cheaper;
    PipelineRL behaviour)."""
    request_timeout_s: float = Field(3600.0, gt=0)
    """Longest a single generate may take before EngineTimeout (the request is aborted)."""
    step_timeout_s: float = Field(600.0, gt=0)
    """Longest pause/load_weights/close wait for the step in flight to finish."""


class VLLMEngineSettings(StrictFrozenModel):
    """vLLM, in-process (engine core and worker in this process, stepped from one thread)."""

    backend: Literal["vllm"] = "vllm"
    """Backend name."""
    dtype: Dtype = "float32"
    """Model dtype. float32 matches an fp32 learner to ~1e-4; bfloat16 is ~2x faster on AMX CPUs but
    leaves a ~0.04 per-token logprob gap."""
    max_model_len: int = Field(4096, gt=0)
    """Prompt + generated tokens cap; also sizes the scheduler's buffers."""
    max_num_seqs: int = Field(64, gt=0)
    """Most sequences scheduled together."""
    use_eager: bool = False
    """Skip torch.compile. Compiled (the default) decodes ~1.9x faster at one request on this CPU
    (`vcpo bench engine`); its start-up is ~60 s the first time and ~28 s once `cache_root` holds the
    compiled graphs, against ~14 s eager. True suits short-lived engines (tests, quick evals)."""
    use_prefix_caching: bool = True
    """Reuse KV blocks of shared prompt prefixes (multi-turn histories); reset on every weight load."""
    use_kv_recompute_on_update: bool = True
    """After load_weights, preempt in-flight sequences so their KV is recomputed with the new weights.
    False keeps their stale KV (then prefix caching must be off: a stale cache cannot be reset while
    requests hold it)."""
    seed: int = 0
    """vLLM's global seed (requests without a seed draw from it)."""
    block_size: int | None = Field(None, gt=0)
    """Tokens per KV-cache block, the granularity of prefix caching (a turn's history is reused up to its
    last full block). None: 32 on CPUs (vLLM-CPU's own default, 128, recomputed up to 127 tokens of every
    multi-turn request; measured in docs/performance.md), vLLM's default elsewhere. vLLM-CPU wants
    a multiple of 32."""
    cpu_kv_cache_space_gib: int = Field(2, gt=0)
    """CPU only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE). Unset, vLLM asks for 92% of RAM."""
    cpu_threads: int | None = Field(None, gt=0)
    """CPU only: torch threads the engine compiles, warms up and serves with; None = this process's torch
    thread count (all cores unless OMP_NUM_THREADS says otherwise). Left to itself vLLM 0.32 compiles on
    one thread; an A/B on 2 cores found no speed difference (docs/performance.md), so this is a knob for
    sharing cores (e.g. 1 for the engine beside the learner in local mode), not a speed-up."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """GPU only: fraction of GPU memory vLLM may take (leave room for a co-located learner)."""
    cache_root: str | None = None
    """vLLM's cache directory (VLLM_CACHE_ROOT: compiled graphs, keyed by vLLM on model config, shapes and
    code); None = `$VCPO_CACHE_DIR/vllm`, else `~/.cache/vcpo/vllm`, kept across runs so later starts
    skip compilation. vLLM compiles into a folder of it per CPU kernel set (`cpu-avx2`, `cpu-avx512-…`), so
    hosts that share it never read each other's graphs."""
    request_timeout_s: float = Field(3600.0, gt=0)
    """Longest a single generate may take before EngineTimeout (the request is aborted)."""
    step_timeout_s: float = Field(600.0, gt=0)
    """Longest one engine call (a step, a weight load, start-up excluded) may take."""
    start_timeout_s: float = Field(900.0, gt=0)
    """Longest engine start-up may take (model load, compilation)."""

    @model_validator(mode="after")
    def _check(self) -> VLLMEngineSettings:
        if not self.use_kv_recompute_on_update and self.use_prefix_caching:
            raise ValueError(
                "use_kv_recompute_on_update=False keeps stale KV blocks, but use_prefix_caching=True would "
                "let new requests reuse them after a weight load; set use_prefix_caching=False or "
                "use_kv_recompute_on_update=True"
            )
        return self


class SGLangEngineSettings(StrictFrozenModel):
    """An adapter to a running SGLang server (see rollout.engines.sglang_launcher to start one)."""

    backend: Literal["sglang"] = "sglang"
    """Backend name."""
    base_url: str = "http://127.0.0.1:30000"
    """The server's address."""
    weight_sync: Literal["disk", "tensor", "distributed"] = "disk"
    """How load_weights reaches the server: 'disk' writes safetensors to weights_dir and posts
    /update_weights_from_disk; 'tensor' posts /update_weights_from_tensor (same host, shared memory);
    'distributed' broadcasts over a process group set up by init_weights_update_group (NCCL)."""
    weights_dir: str | None = None
    """'disk' sync: a directory the server can read (shared filesystem or /dev/shm)."""
    tensor_parallel_size: int = Field(1, gt=0)
    """The server's TP size: 'tensor' sync sends one serialized copy per TP rank."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Timeout to open a connection."""
    request_timeout_s: float = Field(3600.0, gt=0)
    """Longest a single /generate may take before EngineTimeout."""
    control_timeout_s: float = Field(600.0, gt=0)
    """Longest a control call (pause, abort, weight update, flush) may take."""
    max_connections: int = Field(256, gt=0)
    """Size of the HTTP connection pool (concurrent requests)."""

    @model_validator(mode="after")
    def _check(self) -> SGLangEngineSettings:
        if self.weight_sync == "disk" and self.weights_dir is None:
            raise ValueError(
                "weight_sync='disk' writes weights where the server can read them, but weights_dir is "
                "not set; set weights_dir (e.g. /dev/shm/vcpo-weights) or choose weight_sync='tensor'"
            )
        return self


class SGLangLaunchSettings(StrictFrozenModel):
    """How rollout.engines.sglang_launcher starts `python -m sglang.launch_server` (GPU machines)."""

    model_path: str
    """HF model directory or hub id to serve."""
    host: str = "127.0.0.1"
    """Bind address; loopback unless the learner is on another host."""
    port: int = Field(30000, gt=0, lt=65536)
    """HTTP port."""
    tp_size: int = Field(1, gt=0)
    """Tensor-parallel GPUs."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Model dtype ('auto' = the checkpoint's)."""
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    """GPU memory fraction for weights + KV cache; None = SGLang's default."""
    context_length: int | None = Field(None, gt=0)
    """Max context length; None = the model's."""
    random_seed: int | None = 0
    """Server seed; None = SGLang's default."""
    startup_timeout_s: float = Field(900.0, gt=0)
    """Longest to wait for /health to answer after launch."""
    extra_args: tuple[str, ...] = ()
    """More launch_server arguments, passed verbatim (e.g. ('--attention-backend', 'fa3'))."""


class OpenAIEngineSettings(StrictFrozenModel):
    """Any OpenAI-compatible /v1/completions server, for evaluation (no weight loading)."""

    backend: Literal["openai"] = "openai"
    """Backend name."""
    base_url: str = "http://127.0.0.1:8000/v1"
    """The API root, ending in /v1."""
    model: str
    """The served model name sent in every request."""
    api_key: str | None = None
    """Bearer token, if the server wants one (the CLI reads it from the environment)."""
    prompt_format: Literal["token_ids", "text"] = "token_ids"
    """Send prompts as token id lists (vLLM, SGLang accept them) or as decoded text."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """Timeout to open a connection."""
    request_timeout_s: float = Field(3600.0, gt=0)
    """Longest a single completion may take before EngineTimeout."""
    max_connections: int = Field(256, gt=0)
    """Size of the HTTP connection pool (concurrent requests)."""


class AutoEngineSettings(StrictFrozenModel):
    """The best engine that runs here: vLLM when it imports and supports this machine, else HF."""

    backend: Literal["auto"] = "auto"
    """Backend name."""
    vllm: VLLMEngineSettings = Field(default_factory=VLLMEngineSettings)
    """Settings used when vLLM is chosen."""
    hf: HFEngineSettings = Field(default_factory=HFEngineSettings)
    """Settings used when HF is chosen."""


EngineSettings = Annotated[
    AutoEngineSettings | HFEngineSettings | VLLMEngineSettings | SGLangEngineSettings | OpenAIEngineSettings,
    Field(discriminator="backend"),
]
"""Any engine's settings, told apart by `backend`."""
