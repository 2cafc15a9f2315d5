"""The inference-engine protocol: token ids in, token ids + per-token logprobs + versions out.

Every backend (HF, vLLM, SGLang, OpenAI-compatible, the scripted fake) implements this ABC and is
an async context manager: `async with engine:` starts it and always closes it. Many `generate`
calls run concurrently on one event loop; the engine batches them as it sees fit.

Concurrency contract (all backends):
* `generate` never blocks the event loop; heavy work runs on a worker thread or another process.
* `abort(request_id)` makes that request's `generate` return soon with `finish_reason="abort"`
  and the tokens sampled so far; cancelling the `generate` task aborts it the same way.
* `pause()` returns once no forward pass is running and none will start until `resume()`;
  requests stay in flight (new ones queue). `load_weights` may be called paused or not: it waits
  for a step boundary, swaps the weights, bumps `version`, and later tokens carry the new version.
* Every wait is bounded by a timeout from the backend's settings (EngineTimeout on expiry).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar

from rollout.errors import InvalidRequest
from rollout.types import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from torch import Tensor


class InferenceEngine(ABC):
    """One inference backend. Use as `async with engine: ...`."""

    name: ClassVar[str]
    """Short backend name used in errors and metrics ('hf', 'vllm', ...)."""

    async def __aenter__(self) -> InferenceEngine:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @abstractmethod
    async def start(self) -> None:
        """Load the model / connect. Raises EngineUnavailable (or EngineOOM) with the reason."""

    @abstractmethod
    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate the continuation of one prompt (see the module docstring for concurrency)."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop one request in flight; a no-op for unknown or finished ids."""

    @abstractmethod
    async def pause(self) -> None:
        """Stop stepping at the next step boundary; returns once the step in flight is done."""

    @abstractmethod
    async def resume(self) -> None:
        """Continue after `pause()`."""

    @abstractmethod
    async def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Replace (a subset of) the weights in place, by HF parameter name, and set `version`.

        Tokens sampled after this returns carry `version`; the prefix cache is invalidated.
        Raises WeightLoadError (nothing loaded) for unknown names or wrong shapes.
        """

    @property
    @abstractmethod
    def version(self) -> int:
        """Policy version of the weights currently loaded (0 until the first load_weights)."""

    @abstractmethod
    async def close(self) -> None:
        """Abort what is in flight and release everything; idempotent."""


def check_version_order(engine: str, current: int, new: int) -> None:
    """Versions never decrease: a result's per-token versions must be monotone."""
    if new < current:
        raise InvalidRequest(
            engine,
            f"load_weights version={new} is older than the loaded version {current}; "
            "versions must not decrease",
        )
