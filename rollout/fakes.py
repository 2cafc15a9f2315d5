"""A scripted engine for testing control logic (scheduling, staleness, cancellation, weight sync)
without a model. Never use it in a test that claims a real engine works.

`ScriptedEngine` emits a scripted token sequence one token at a time, `token_delay_s` apart, and
honours the protocol's control semantics like a real engine: per-token versions (a load_weights
during a generation splits its versions), pause/resume at token boundaries, abort and task
cancellation (finish_reason='abort' with the tokens so far), stop_token_ids, use_eos and
max_new_tokens. Stop strings are matched only when it is given `decode` (token ids -> text): then,
like vLLM with include_stop_str_in_output, a reply stops at the first token whose text completes a
stop string, keeps that text, and reports the string as its stop_reason. It records every request
and every weight load for assertions. Besides tests, it is the voice of a scripted solver writing
warm-start demonstrations through the real loop (agent_env/demonstrations.py) — a policy, not an engine
that is claimed to work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout.base import InferenceEngine
from rollout.errors import EngineUnavailable, InvalidRequest
from rollout.request_record import GenerationProgress
from rollout.types import GenerationRequest, GenerationResult

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class ScriptedReply:
    """What the fake samples for one request: token ids, and optionally their logprobs (default
    `default_logprob` each)."""

    token_ids: Sequence[int]
    logprobs: Sequence[float] | None = None


def count_up(request: GenerationRequest) -> ScriptedReply:
    """Default script: last prompt token + 1, + 2, ... (mod 1000), enough for max_new_tokens."""
    last = request.prompt_token_ids[-1]
    return ScriptedReply([(last + i) % 1000 for i in range(1, request.sampling.max_new_tokens + 1)])


@dataclass(frozen=True)
class WeightLoad:
    """One recorded load_weights call."""

    names: tuple[str, ...]
    version: int


class ScriptedEngine(InferenceEngine):
    """A fake engine driven by `script(request) -> ScriptedReply` (see the module docstring)."""

    name = "scripted"

    def __init__(
        self,
        script: Callable[[GenerationRequest], ScriptedReply] = count_up,
        token_delay_s: float = 0.0,
        eos_token_id: int = 2,
        default_logprob: float = -1.0,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        self._script = script
        self._decode = decode
        self._token_delay_s = token_delay_s
        self._eos_token_id = eos_token_id
        self._default_logprob = default_logprob
        self._version = 0
        self._is_started = False
        self._is_running = asyncio.Event()
        self._in_flight: dict[str, GenerationProgress] = {}
        self._aborted: dict[str, asyncio.Event] = {}
        self.requests: list[GenerationRequest] = []
        self.weight_loads: list[WeightLoad] = []

    @property
    def version(self) -> int:
        return self._version

    async def start(self) -> None:
        self._is_started = True
        self._is_running.set()

    async def close(self) -> None:
        self._is_started = False
        for request_id in list(self._in_flight):
            await self.abort(request_id)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if not self._is_started:
            raise EngineUnavailable(self.name, "not started; use `async with engine:`")
        if request.request_id in self._in_flight:
            raise InvalidRequest(self.name, f"request_id {request.request_id!r} is already in flight")
        self.requests.append(request)
        reply = self._script(request)
        progress = GenerationProgress(request=request, version_start=self._version)
        self._in_flight[request.request_id] = progress
        self._aborted[request.request_id] = asyncio.Event()
        try:
            await self._emit(progress, reply)
        finally:
            self._in_flight.pop(request.request_id, None)
            self._aborted.pop(request.request_id, None)
        return progress.result(self._version)

    async def _emit(self, progress: GenerationProgress, reply: ScriptedReply) -> None:
        sampling = progress.request.sampling
        stop_ids = set(sampling.stop_token_ids) | ({self._eos_token_id} if sampling.use_eos else set())
        logprobs = reply.logprobs or [self._default_logprob] * len(reply.token_ids)
        aborted = self._aborted[progress.request_id]
        for token_id, logprob in zip(reply.token_ids, logprobs, strict=True):
            if not self._is_running.is_set():  # paused: wait for resume() or abort()
                waits = [
                    asyncio.ensure_future(self._is_running.wait()),
                    asyncio.ensure_future(aborted.wait()),
                ]
                _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for task in pending:
                    task.cancel()
            if progress.is_aborted:
                progress.finish("abort")
                return
            progress.extend([token_id], [logprob], self._version)
            if token_id in stop_ids:
                progress.finish("stop", token_id)
                return
            fired = self._fired_stop_string(progress.token_ids, sampling.stop)
            if fired is not None:
                progress.finish("stop", fired)
                return
            if len(progress.token_ids) >= sampling.max_new_tokens:
                progress.finish("length")
                return
            await asyncio.sleep(self._token_delay_s)
        progress.finish("stop")  # the script ran out: like EOS

    def _fired_stop_string(self, token_ids: Sequence[int], stops: Sequence[str]) -> str | None:
        if self._decode is None or not stops:
            return None
        text = self._decode(token_ids)
        return next((stop for stop in stops if text.endswith(stop)), None)

    async def abort(self, request_id: str) -> None:
        if request_id in self._in_flight:
            self._in_flight[request_id].is_aborted = True
            self._aborted[request_id].set()

    async def pause(self) -> None:
        self._is_running.clear()

    async def resume(self) -> None:
        self._is_running.set()

    async def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        self.weight_loads.append(WeightLoad(tuple(name for name, _ in named_tensors), version))
        self._version = version
