"""An adapter to any OpenAI-compatible `/v1/completions` server, for evaluation.

Prompts go as token-id lists when `prompt_format="token_ids"` (vLLM and SGLang accept them) or as
text decoded with the model's tokenizer. Sampled token ids come from the response's `token_ids`
(vLLM's `return_token_ids` extension); a server that does not send them needs a tokenizer, and
the text is re-tokenised — approximate, fine for scoring answers, never for training.
Log-probabilities come from `logprobs.token_logprobs` when the server gives them (which
distribution they describe is the server's choice: vLLM needs `--logprobs-mode processed_logprobs`
to report the tempered one); otherwise results carry no logprobs.

Not supported (UnsupportedOperation): load_weights, pause/resume — an evaluation server's weights
are fixed. `abort` closes the request's connection (vLLM aborts a request whose client left).
Every request has a connect and a total timeout. `served_models` lists what a server serves
(`GET /models`): the names, for choosing the one to send, and each model's context length where the
server says it (vLLM's `max_model_len`), so a caller can refuse a token budget the server would
reject mid-run.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rollout.base import InferenceEngine
from rollout.engines.http_client import PROBE_TIMEOUT_S, JSONClient, field
from rollout.errors import EngineUnavailable, MalformedResponse, UnsupportedOperation
from rollout.settings import OpenAIEngineSettings
from rollout.types import (
    GenerationRequest,
    GenerationResult,
    GenerationTimings,
    SamplingParams,
    TruncationWarning,
)

if TYPE_CHECKING:
    from torch import Tensor
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort", "cancelled": "abort"}


class OpenAIEngine(InferenceEngine):
    """OpenAI-compatible completions (see the module docstring)."""

    name = "openai"

    def __init__(
        self, settings: OpenAIEngineSettings, tokenizer: PreTrainedTokenizerBase | None = None
    ) -> None:
        if settings.prompt_format == "text" and tokenizer is None:
            raise ValueError(
                "prompt_format='text' decodes prompts with the model's tokenizer; pass tokenizer= "
                "or use prompt_format='token_ids'"
            )
        self._settings = settings
        self._tokenizer = tokenizer
        self._truncation = TruncationWarning(self.name, log)
        self._client: JSONClient | None = None
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self._aborted: set[str] = set()

    async def start(self) -> None:
        if self._client is not None:
            return
        settings = self._settings
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else None
        self._client = await JSONClient.connect(self.name, settings, "/models", headers)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        if self._client is not None:
            await self._client.close()
            self._client = None

    @property
    def version(self) -> int:
        return 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if self._client is None:
            raise EngineUnavailable(self.name, "the adapter is not started; use `async with engine:`")
        self._truncation.check(request.sampling)
        started = time.perf_counter()
        task = asyncio.ensure_future(self._client.post("/completions", self._payload(request)))
        self._tasks[request.request_id] = task
        try:
            data = await task
        except asyncio.CancelledError:
            if request.request_id not in self._aborted:
                raise
            return GenerationResult(
                request_id=request.request_id,
                token_ids=(),
                logprobs=(),
                versions=(),
                finish_reason="abort",
                version_start=0,
                version_end=0,
            )
        finally:
            self._tasks.pop(request.request_id, None)
            self._aborted.discard(request.request_id)
        choice = field(data, "choices", 0, engine=self.name, kind=dict)
        token_ids = self._token_ids(choice)
        reason = choice.get("finish_reason") or "stop"
        if reason not in _FINISH_REASONS:
            raise MalformedResponse(self.name, f"unknown finish_reason {reason!r}", str(choice)[:2000])
        stop_reason = choice.get("stop_reason")
        if reason == "stop" and stop_reason is None and token_ids:
            stop_reason = token_ids[-1]
        elapsed = time.perf_counter() - started
        return GenerationResult(
            request_id=request.request_id,
            token_ids=tuple(token_ids),
            logprobs=tuple(self._logprobs(choice, len(token_ids))),
            versions=(0,) * len(token_ids),
            finish_reason=_FINISH_REASONS[reason],
            stop_reason=stop_reason,
            version_start=0,
            version_end=0,
            timings=GenerationTimings(total_s=elapsed),
        )

    def _payload(self, request: GenerationRequest) -> dict[str, Any]:
        sampling: SamplingParams = request.sampling
        ids = list(request.prompt_token_ids)
        payload: dict[str, Any] = {
            "model": self._settings.model,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 0,
            "prompt": ids if self._settings.prompt_format == "token_ids" else self._tokenizer.decode(ids),
        }
        if self._settings.prompt_format == "token_ids":
            payload["return_token_ids"] = True  # vLLM extension; token-id servers know it
        optional = {
            "stop": list(sampling.stop),
            "seed": sampling.seed,
            "top_k": sampling.top_k,
            "stop_token_ids": list(sampling.stop_token_ids),
            "ignore_eos": not sampling.use_eos,
        }
        payload.update({key: value for key, value in optional.items() if value})  # extensions only when used
        return payload

    def _token_ids(self, choice: dict[str, Any]) -> list[int]:
        if isinstance(choice.get("token_ids"), list):
            return [int(t) for t in choice["token_ids"]]
        if self._tokenizer is None:
            raise MalformedResponse(
                self.name,
                "the server returned no token_ids; pass a tokenizer to re-tokenise "
                "the text (evaluation only)",
                str(choice)[:2000],
            )
        return list(
            self._tokenizer.encode(
                field(choice, "text", engine=self.name, kind=str), add_special_tokens=False
            )
        )

    def _logprobs(self, choice: dict[str, Any], num_tokens: int) -> list[float]:
        values = (choice.get("logprobs") or {}).get("token_logprobs")
        if not values:
            return []
        if len(values) != num_tokens or any(v is None for v in values):
            log.warning("openai engine: %d logprobs for %d tokens; dropping them", len(values), num_tokens)
            return []
        return [float(v) for v in values]

    async def abort(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            self._aborted.add(request_id)
            task.cancel()

    async def pause(self) -> None:
        raise UnsupportedOperation(
            self.name, "an OpenAI-compatible server cannot be paused; use it for evaluation"
        )

    async def resume(self) -> None:
        raise UnsupportedOperation(
            self.name, "an OpenAI-compatible server cannot be paused; use it for evaluation"
        )

    async def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        raise UnsupportedOperation(
            self.name,
            "an OpenAI-compatible server's weights are fixed; train with the hf, vllm or sglang backend",
        )


@dataclass(frozen=True)
class ServedModel:
    """One entry of a server's `GET /models`."""

    id: str
    """The name to send as `model`."""
    max_model_len: int | None = None
    """Prompt + completion tokens the server allows this model (vLLM lists it); None when not said."""


async def served_models(
    base_url: str, api_key: str | None = None, connect_timeout_s: float = 5.0
) -> list[ServedModel]:
    """The models an OpenAI-compatible server serves (`GET {base_url}/models`), in its order.

    Raises EngineUnavailable when the server cannot be reached, an EngineError with `http` set when
    it answers an HTTP error, MalformedResponse when the answer is not a model list.
    """
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    client = JSONClient(OpenAIEngine.name, base_url, connect_timeout_s, PROBE_TIMEOUT_S, 1, headers)
    try:
        data = await client.get("/models")
    finally:
        await client.close()
    models = field(data, "data", engine=OpenAIEngine.name, kind=list)
    served = []
    for model in models:
        length = model.get("max_model_len") if isinstance(model, dict) else None
        # a bool is an int to isinstance; only a positive whole number is a context length
        is_length = isinstance(length, int) and not isinstance(length, bool) and length > 0
        served.append(ServedModel(str(field(model, "id", engine=OpenAIEngine.name)),
                                  length if is_length else None))
    return served


async def served_model_ids(
    base_url: str, api_key: str | None = None, connect_timeout_s: float = 5.0
) -> list[str]:
    """The model ids of `served_models`, in the server's order."""
    return [model.id for model in await served_models(base_url, api_key, connect_timeout_s)]
