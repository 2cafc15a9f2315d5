"""The HF transformers engine: continuous batching of concurrent requests over our own decode loop.

Runs anywhere torch runs (CPU default, one GPU) and is the fallback when vLLM is unavailable.

What runs where: one asyncio task (the scheduler) owns the batch. Each iteration it admits queued
requests (up to `max_batch_size`), drops aborted ones and hands one `DecodeBatch.step` to the
engine's single worker thread, so the event loop stays responsive while the model runs and
exactly one thread ever touches the model. Requests arriving while a step runs join at the next
step boundary; an idle engine waits `batch_window_s` after the first arrival so requests sent
together start together.

Step boundaries are where control happens: `pause()` holds the step lock so no new step starts;
`load_weights` takes the same lock, copies the tensors in place, bumps the version and (by
default) recomputes the KV cache of in-flight rows, so every later token is sampled from the new
weights and carries the new version. Aborting (or cancelling a `generate`) marks the row; it
leaves the batch at the next boundary and its `generate` returns `finish_reason="abort"` with the
tokens sampled so far. A failed step (OOM, a bug) stops the engine: every waiter gets the typed
error and later calls raise EngineUnavailable.

Not here: tensor parallelism, speculative decoding, a paged KV cache (that is vLLM's job).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rollout.base import InferenceEngine, check_version_order
from rollout.engines.hf_batch import DecodeBatch, Row, check_cache_layout
from rollout.engines.sampling import StopStringMatcher
from rollout.engines.step_runtime import StepRuntime
from rollout.errors import EngineUnavailable, InvalidRequest, WeightLoadError
from rollout.settings import HFEngineSettings
from rollout.types import GenerationRequest, GenerationResult, TruncationWarning

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


class HFEngine(InferenceEngine):
    """Continuous-batching HF engine (see the module docstring). `async with HFEngine(dir): ...`"""

    name = "hf"

    def __init__(self, model_dir: Path | str, settings: HFEngineSettings | None = None) -> None:
        self._model_dir = Path(model_dir)
        self._settings = settings or HFEngineSettings()
        self._version = 0
        self._seeds = random.Random(self._settings.seed)
        self._truncation = TruncationWarning(self.name, log)
        self._runtime: StepRuntime | None = None
        self._model: PreTrainedModel | None = None
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._batch: DecodeBatch | None = None
        self._eos_ids: frozenset[int] = frozenset()
        self._max_model_len = 0
        self._pending: list[Row] = []

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._runtime is not None:
            return
        settings = self._settings
        runtime = StepRuntime(
            self.name, step_timeout_s=settings.step_timeout_s, request_timeout_s=settings.request_timeout_s
        )
        try:
            self._model, self._tokenizer = await runtime.call(_load_model, self._model_dir, settings)
        except (OSError, ValueError) as exc:
            runtime.shutdown()
            raise EngineUnavailable(
                self.name,
                f"could not load the model from {self._model_dir}; point the "
                "engine at an HF model directory (config.json + safetensors)",
                str(exc),
            ) from exc
        self._eos_ids = _eos_token_ids(self._model)
        self._max_model_len = settings.max_model_len or getattr(
            self._model.config, "max_position_embeddings", 2048
        )
        self._batch = DecodeBatch(self._model)
        self._runtime = runtime
        runtime.start_scheduler(
            self._step, lambda: bool(self._pending or self._batch.rows), settings.batch_window_s
        )

    async def close(self) -> None:
        runtime = self._runtime
        if runtime is None or runtime.is_closing:
            return
        self._pending.clear()
        await runtime.stop(self._version)
        runtime.shutdown()
        self._batch = self._model = None

    # ------------------------------------------------------------------ the protocol

    @property
    def version(self) -> int:
        return self._version

    @property
    def stats(self) -> dict[str, int]:
        """Decode steps run so far and the most rows decoded together (batching efficiency)."""
        batch = self._batch
        return {"steps": batch.steps, "peak_batch_size": batch.peak_rows} if batch else {}

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        runtime = self._checked_runtime()
        self._validate(request)
        self._truncation.check(request.sampling)
        sampling = request.sampling
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
        row = Row(
            request=request,
            version_start=self._version,
            generator=torch.Generator(device=self._model.device).manual_seed(seed),
            stop_matcher=StopStringMatcher(sampling.stop, self._tokenizer),
            stop_token_ids=frozenset(sampling.stop_token_ids)
            | (self._eos_ids if sampling.use_eos else frozenset()),
            max_new_tokens=min(sampling.max_new_tokens, self._max_model_len - len(request.prompt_token_ids)),
        )
        future = runtime.register(row)
        self._pending.append(row)
        runtime.wake()
        return await runtime.wait(request.request_id, future, self.abort)

    async def abort(self, request_id: str) -> None:
        runtime = self._runtime
        entry = runtime.in_flight.get(request_id) if runtime is not None else None
        if entry is None:
            return
        row = entry[0]
        row.is_aborted = True  # leaves the batch at the next step
        if row in self._pending:
            self._pending.remove(row)
            runtime.resolve(row, self._version, "abort")
        elif not runtime.step_lock.locked():
            runtime.resolve(row, self._version, "abort")  # no step is writing to it: answer now
        runtime.wake()

    async def pause(self) -> None:
        await self._checked_runtime().pause()

    async def resume(self) -> None:
        self._checked_runtime().resume()

    async def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        runtime = self._checked_runtime()
        check_version_order(self.name, self._version, version)
        async with runtime.boundary("load_weights"):
            try:
                await runtime.call(_copy_weights, self._model, named_tensors)
            except ValueError as exc:
                raise WeightLoadError(self.name, "nothing was loaded", str(exc)) from exc
            self._version = version
            if self._settings.use_kv_recompute_on_update and self._batch.rows:
                await runtime.call(self._batch.recompute)

    # ------------------------------------------------------------------ helpers

    async def _step(self) -> None:
        """One scheduler iteration: admit queued rows, drop aborted ones, decode one token each."""
        runtime = self._runtime
        room = self._settings.max_batch_size - len(self._batch.rows)
        admit, self._pending = self._pending[:room], self._pending[room:]
        drop = [row for row in self._batch.rows if row.is_aborted]
        finished = await runtime.call(self._batch.step, admit, drop, self._version)
        for row in drop:
            runtime.resolve(row, self._version, "abort")
        for row in finished:
            runtime.resolve(row, self._version)

    def _checked_runtime(self) -> StepRuntime:
        return StepRuntime.checked(self._runtime, self.name, self._batch is not None)

    def _validate(self, request: GenerationRequest) -> None:
        n = len(request.prompt_token_ids)
        if n >= self._max_model_len:
            raise InvalidRequest(
                self.name,
                f"the prompt has {n} tokens but max_model_len is "
                f"{self._max_model_len}; shorten the prompt or raise max_model_len",
            )
        vocab = self._model.get_input_embeddings().num_embeddings
        if not all(0 <= t < vocab for t in request.prompt_token_ids):
            raise InvalidRequest(
                self.name, f"prompt_token_ids must lie in [0, {vocab}); tokenize with this model's tokenizer"
            )


def _load_model(
    model_dir: Path, settings: HFEngineSettings
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, settings.dtype))
    model = model.to(settings.device).eval()
    model.requires_grad_(False)
    check_cache_layout(model)
    with torch.inference_mode():  # the first forward on a thread pays one-off kernel set-up (seconds on CPU)
        model(torch.ones(1, 8, dtype=torch.long, device=model.device))
    return model, AutoTokenizer.from_pretrained(model_dir)


def _eos_token_ids(model: PreTrainedModel) -> frozenset[int]:
    ids: set[int] = set()
    for config in (model.config, getattr(model, "generation_config", None)):
        value = getattr(config, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else (value or []))
    return frozenset(ids)


@torch.no_grad()
def _copy_weights(model: PreTrainedModel, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Copy tensors into the model's parameters/buffers by HF name; validate all before copying any.

    Tied weights (lm_head ↔ embeddings) share storage, so either name updates both.
    """
    targets = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    items = list(named_tensors)
    unknown = [name for name, _ in items if name not in targets]
    mismatched = [
        f"{name}: {tuple(t.shape)} vs {tuple(targets[name].shape)}"
        for name, t in items
        if name in targets and t.shape != targets[name].shape
    ]
    if unknown or mismatched:
        raise ValueError(
            f"unknown names {unknown[:5]}{'…' if len(unknown) > 5 else ''}; shape mismatches {mismatched[:5]}"
        )
    for name, tensor in items:
        targets[name].copy_(tensor)
