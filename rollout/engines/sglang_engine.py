"""An adapter to a running SGLang server, over its documented native HTTP API (`/generate`).

Generation: `POST /generate` with `input_ids`, `return_logprob=true`, `logprob_start_len=-1` and the
request id as `rid`; the response's `output_ids` and `meta_info.output_token_logprobs`
(`[logprob, token_id, text]` per token) become the result. SGLang reports log softmax(logits / T)
by default (do not set SGLANG_RETURN_ORIGINAL_LOGPROB=1; the launcher keeps it off).

Weight updates keep per-token versions exact without streaming: `load_weights` pauses the server
with `mode="abort"` (every in-flight request returns what it has so far), pushes the weights with
`weight_version`, and continues. Each interrupted `generate` then resubmits prompt + tokens so far
as a new segment under the new version, so every token is tagged with the weights that produced
it and everything after the update is sampled from the new weights with a recomputed KV cache.
A stop string that straddles the interruption point is not detected (stop tokens are).

Weight transports (`weight_sync`): 'disk' writes safetensors into `weights_dir` and posts
`/update_weights_from_disk`; 'tensor' posts `/update_weights_from_tensor` with the tensors
serialized the way SGLang's MultiprocessingSerializer does (ForkingPickler + base64: shared memory
or CUDA IPC handles, so the server must be on this host); 'distributed' broadcasts over a process
group set up with `init_weights_update_group` (NCCL between a trainer and the server's GPUs).

Concurrency: `generate` calls are independent HTTP requests on one pooled client; a weight update
holds new submissions until it is done. Every call has a timeout.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout.base import InferenceEngine, check_version_order
from rollout.engines.checkpoint import check_named_tensors, checkpoint_shapes, write_checkpoint
from rollout.engines.http_client import JSONClient, field
from rollout.errors import (
    EngineTimeout,
    EngineUnavailable,
    InvalidRequest,
    MalformedResponse,
    UnsupportedOperation,
    WeightLoadError,
)
from rollout.request_record import GenerationProgress
from rollout.settings import SGLangEngineSettings
from rollout.types import GenerationRequest, GenerationResult, SamplingParams, TruncationWarning

if TYPE_CHECKING:
    from torch import Tensor

log = logging.getLogger(__name__)


class SGLangEngine(InferenceEngine):
    """SGLang over HTTP (see the module docstring). `model_dir`, when given, is the checkpoint the
    server started from: weight names are checked against it and 'disk' sync copies its config."""

    name = "sglang"

    def __init__(self, settings: SGLangEngineSettings, model_dir: Path | str | None = None) -> None:
        self._settings = settings
        self._model_dir = Path(model_dir) if model_dir is not None else None
        self._version = 0
        self._truncation = TruncationWarning(self.name, log)
        self._client: JSONClient | None = None
        self._shapes: dict[str, tuple[int, ...]] | None = None
        self._in_flight: dict[str, GenerationProgress] = {}
        self._segment_rids: dict[str, str] = {}
        self._weights_ready = asyncio.Event()
        self._weights_ready.set()
        self._update_lock = asyncio.Lock()
        self._update_epoch = 0  # bumped when a weight update starts: in-flight segments get interrupted
        self._is_paused = False
        self._weight_group: Any = None  # torch ProcessGroup for 'distributed' sync
        self._last_weights_dir: Path | None = None

    async def start(self) -> None:
        if self._client is not None:
            return
        self._client = await JSONClient.connect(self.name, self._settings, "/health")
        if self._model_dir is not None:
            self._shapes = checkpoint_shapes(self._model_dir)

    async def close(self) -> None:
        if self._client is None:
            return
        for request_id in list(self._in_flight):
            try:
                await self.abort(request_id)
            except EngineUnavailable:
                break
        await self._client.close()
        self._client = None

    @property
    def version(self) -> int:
        return self._version

    # ------------------------------------------------------------------ generation

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        client = self._checked_client()
        self._truncation.check(request.sampling)
        progress = GenerationProgress(request=request, version_start=self._version)
        self._in_flight[request.request_id] = progress
        try:
            segment = 0
            while True:
                await self._wait_for_weights()
                version, epoch = self._version, self._update_epoch
                rid = f"{request.request_id}#{segment}" if segment else request.request_id
                self._segment_rids[request.request_id] = rid
                try:
                    data = await client.post("/generate", self._generate_payload(progress, rid))
                except asyncio.CancelledError:  # the server would keep generating for nobody: abort it there
                    await asyncio.shield(self.abort(request.request_id))
                    raise
                interrupted = epoch != self._update_epoch or not self._weights_ready.is_set()
                finish_type, matched = self._append_segment(progress, data, version, interrupted)
                budget_left = request.sampling.max_new_tokens - len(progress.token_ids)
                if finish_type == "abort" and not progress.is_aborted and interrupted and budget_left > 0:
                    segment += 1  # interrupted by our own weight update: continue under the new weights
                    continue
                progress.finish(finish_type, matched)
                return progress.result(self._version)
        finally:
            self._in_flight.pop(request.request_id, None)
            self._segment_rids.pop(request.request_id, None)

    def _generate_payload(self, progress: GenerationProgress, rid: str) -> dict[str, Any]:
        sampling = progress.request.sampling
        return {
            "input_ids": [*progress.request.prompt_token_ids, *progress.token_ids],
            "sampling_params": sglang_sampling_params(
                sampling,
                sampling.max_new_tokens - len(progress.token_ids),
                seed_offset=len(progress.token_ids),
            ),
            "return_logprob": True,
            "logprob_start_len": -1,
            "rid": rid,
            "stream": False,
        }

    def _append_segment(
        self, progress: GenerationProgress, data: Any, version: int, is_update_overlap: bool
    ) -> tuple[str, str | int | None]:
        """Add one /generate response's tokens; returns (finish type, matched stop).

        Tokens carry `version` (ours at submission): an update aborts the segments it overlaps, so a
        segment never spans one. One race remains: a segment submitted just before an update's pause
        but queued behind it runs entirely after the update; such a segment overlapped an update
        without being aborted, and then the server's `weight_version` (when it sends one) decides.
        """
        token_ids = field(data, "output_ids", engine=self.name, kind=list)
        meta = field(data, "meta_info", engine=self.name, kind=dict)
        entries = meta.get("output_token_logprobs") or []
        if len(entries) != len(token_ids) or any(
            int(e[1]) != t for e, t in zip(entries, token_ids, strict=False)
        ):
            raise MalformedResponse(
                self.name,
                f"output_token_logprobs ({len(entries)} entries) do not match "
                f"output_ids ({len(token_ids)}); was return_logprob honoured?",
                str(meta)[:2000],
            )
        finish = field(meta, "finish_reason", engine=self.name, kind=dict)
        finish_type = field(finish, "type", engine=self.name, kind=str)
        if finish_type not in ("stop", "length", "abort"):
            raise MalformedResponse(self.name, f"unknown finish_reason type {finish_type!r}", str(finish))
        server_version = _as_int(meta.get("weight_version"))
        if is_update_overlap and finish_type != "abort" and server_version is not None:
            version = server_version
        progress.extend(token_ids, [float(e[0]) for e in entries], version)
        return finish_type, finish.get("matched")

    async def _wait_for_weights(self) -> None:
        try:
            await asyncio.wait_for(self._weights_ready.wait(), self._settings.control_timeout_s)
        except TimeoutError:
            raise EngineTimeout(
                self.name, "a weight update did not finish within control_timeout_s"
            ) from None

    # ------------------------------------------------------------------ control

    async def abort(self, request_id: str) -> None:
        progress = self._in_flight.get(request_id)
        if progress is None:
            return
        progress.is_aborted = True
        await self._checked_client().post(
            "/abort_request",
            {"rid": self._segment_rids.get(request_id, request_id)},
            timeout_s=self._settings.control_timeout_s,
        )

    async def pause(self) -> None:
        await self._control("/pause_generation", {"mode": "in_place"})
        self._is_paused = True

    async def resume(self) -> None:
        await self._control("/continue_generation", {})
        self._is_paused = False

    async def flush_cache(self) -> bool:
        """Drop the server's prefix cache; False when requests are running (SGLang answers 400)."""
        try:
            await self._checked_client().post(
                "/flush_cache", None, self._settings.control_timeout_s, is_json=False
            )
        except InvalidRequest:
            return False
        return True

    async def _control(self, path: str, payload: dict[str, Any] | None) -> Any:
        return await self._checked_client().post(path, payload, timeout_s=self._settings.control_timeout_s)

    # ------------------------------------------------------------------ weights

    async def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        self._checked_client()
        check_version_order(self.name, self._version, version)
        items = list(named_tensors)
        if self._shapes is not None:
            try:
                check_named_tensors(items, self._shapes)
            except ValueError as exc:
                raise WeightLoadError(self.name, "nothing was loaded", str(exc)) from exc
        async with self._update_lock:
            self._weights_ready.clear()
            self._update_epoch += 1
            try:
                await self._control("/pause_generation", {"mode": "abort"})
                await self._push(items, version)
                self._version = version
            finally:
                if not self._is_paused:
                    await self._control("/continue_generation", {})
                self._weights_ready.set()

    async def _push(self, items: list[tuple[str, Tensor]], version: int) -> None:
        mode = self._settings.weight_sync
        if mode == "disk":
            target = Path(self._settings.weights_dir or "") / f"v{version}"
            await asyncio.to_thread(write_checkpoint, items, target, self._model_dir)
            answer = await self._control(
                "/update_weights_from_disk",
                {
                    "model_path": str(target),
                    "abort_all_requests": False,
                    "weight_version": str(version),
                    "flush_cache": True,
                },
            )
            self._check_update(answer)
            if self._last_weights_dir is not None and self._last_weights_dir != target:
                shutil.rmtree(self._last_weights_dir, ignore_errors=True)
            self._last_weights_dir = target
        elif mode == "tensor":
            payload = await asyncio.to_thread(serialize_named_tensors, items)
            answer = await self._control(
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [payload] * self._settings.tensor_parallel_size,
                    "flush_cache": True,
                    "weight_version": str(version),
                },
            )
            self._check_update(answer)
        else:
            await self._push_distributed(items, version)

    async def _push_distributed(self, items: list[tuple[str, Tensor]], version: int) -> None:
        if self._weight_group is None:
            raise UnsupportedOperation(
                self.name, "weight_sync='distributed' needs init_weights_update_group() first"
            )
        from rollout.engines.weight_group import broadcast_tensors

        request = self._control(
            "/update_weights_from_distributed",
            {
                "names": [name for name, _ in items],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in items],
                "shapes": [list(t.shape) for _, t in items],
                "group_name": self._weight_group.name,
                "flush_cache": True,
                "weight_version": str(version),
            },
        )
        answer, _ = await asyncio.gather(
            request, asyncio.to_thread(broadcast_tensors, self._weight_group, items)
        )
        self._check_update(answer)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str = "vcpo-weights",
        backend: str = "nccl",
    ) -> None:
        """Create the trainer↔server group for 'distributed' sync: this process is rank 0, the server's
        TP ranks are 1..world_size-1 (`rank_offset=1`)."""
        from rollout.engines.weight_group import WeightGroup

        request = self._control(
            "/init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": 1,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )
        answer, group = await asyncio.gather(
            request,
            asyncio.to_thread(
                WeightGroup.join,
                backend,
                master_address,
                master_port,
                world_size,
                0,
                group_name,
                self._settings.control_timeout_s,
            ),
        )
        self._check_update(answer)
        self._weight_group = group

    def _check_update(self, answer: Any) -> None:
        if not isinstance(answer, dict) or answer.get("success") is not True:
            message = answer.get("message", "") if isinstance(answer, dict) else str(answer)
            raise WeightLoadError(self.name, "the server refused the weight update", str(message))

    def _checked_client(self) -> JSONClient:
        if self._client is None:
            raise EngineUnavailable(self.name, "the adapter is not started; use `async with engine:`")
        return self._client


def sglang_sampling_params(
    sampling: SamplingParams, max_new_tokens: int, seed_offset: int = 0
) -> dict[str, Any]:
    """Our SamplingParams as SGLang's `sampling_params` (top_k 0 → -1 = off; stop text kept)."""
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k or -1,
        "stop": list(sampling.stop),
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": not sampling.use_eos,
        "no_stop_trim": True,
    }
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed + seed_offset
    return params


def serialize_named_tensors(named_tensors: list[tuple[str, Tensor]]) -> str:
    """SGLang's MultiprocessingSerializer.serialize(..., output_str=True): ForkingPickler + base64.
    Tensors travel as shared-memory / CUDA IPC handles, so they must stay alive until the server
    has loaded them (the update call returns after that)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions with ForkingPickler)

    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(named_tensors)
    return base64.b64encode(buffer.getvalue()).decode("utf-8")


def _as_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
