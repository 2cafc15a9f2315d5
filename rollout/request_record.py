"""The mutable record of one request while an engine works on it; frozen into a GenerationResult.

Engines append tokens as they come (one or many at a time, each with its logprob and the policy
version that produced it) and freeze the record when the request ends. Not thread-safe: an
engine mutates a record from one thread at a time (its worker between steps, or the event loop).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rollout.types import FinishReason, GenerationRequest, GenerationResult, GenerationTimings


class TokenTally:
    """A running count of tokens sampled in this process, by every engine that records its requests
    in `GenerationProgress` (HF, vLLM, SGLang, the fakes). It is what a live display shows while
    episodes are still in flight — a result only arrives when a whole turn is done, and one turn of
    a long-horizon task can take minutes on a CPU. Thread-safe: engines extend from worker threads."""

    def __init__(self) -> None:
        self._count = 0
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        with self._lock:
            self._count += count

    @property
    def count(self) -> int:
        return self._count


SAMPLED_TOKENS = TokenTally()
"""Tokens sampled in this process so far (display only: never part of a result or a metric)."""


@dataclass(eq=False)
class GenerationProgress:
    """Tokens, logprobs and versions sampled so far for one request, plus its timestamps."""

    request: GenerationRequest
    version_start: int
    submitted_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    first_token_at: float | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    is_aborted: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def extend(self, token_ids: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        """Record newly sampled tokens, all produced by the weights of `version`."""
        if not token_ids:
            return
        now = time.perf_counter()
        self.started_at = self.started_at or now
        self.first_token_at = self.first_token_at or now
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        self.versions.extend([version] * len(token_ids))
        SAMPLED_TOKENS.add(len(token_ids))

    def finish(self, finish_reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """Mark the request ended; a stop without a reason (EOS) reports the last token id."""
        self.finish_reason = finish_reason
        if finish_reason == "stop" and stop_reason is None and self.token_ids:
            stop_reason = self.token_ids[-1]
        self.stop_reason = stop_reason

    def result(self, version_end: int, finish_reason: FinishReason | None = None) -> GenerationResult:
        """Freeze into a result; `finish_reason` overrides the recorded one (e.g. 'abort')."""
        now = time.perf_counter()
        return GenerationResult(
            request_id=self.request_id,
            token_ids=tuple(self.token_ids),
            logprobs=tuple(self.logprobs),
            versions=tuple(self.versions),
            finish_reason=finish_reason or self.finish_reason or "abort",
            stop_reason=self.stop_reason if finish_reason in (None, "stop") else None,
            version_start=self.version_start,
            version_end=version_end,
            timings=GenerationTimings(
                queue_s=(self.started_at or now) - self.submitted_at,
                first_token_s=(self.first_token_at - self.submitted_at) if self.first_token_at else 0.0,
                total_s=now - self.submitted_at,
            ),
        )
