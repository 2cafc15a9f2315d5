"""The data that crosses the engine seam: sampling settings, a request, its result.

Token ids in, token ids out. Every result carries, per sampled token, the log-probability of the
distribution the token was actually drawn from and the policy version whose weights produced it,
so a generation that spans a weight update stays exact.

Log-probability semantics (all backends): with temperature T > 0 the engine samples from
softmax(logits / T) and reports log softmax(logits / T)[token] — the quantity the learner
recomputes at the same temperature. With top_p < 1 or top_k > 0 the distribution is truncated to
the kept tokens and renormalised first (vLLM's `processed_logprobs`), which the learner's
full-vocabulary recomputation does not reproduce; engines log a warning once. With T = 0 (greedy)
the reported value is log softmax(logits)[token] (T taken as 1).
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Literal

from pydantic import Field, model_validator

from rollout.settings import StrictFrozenModel

_LOGPROB_SLACK = 1e-3  # rounding of a probability-1 token's log-prob, e.g. from a server's float text

FinishReason = Literal["stop", "length", "abort", "error"]
"""stop: a stop string, stop token or EOS; length: max_new_tokens or the context limit; abort: asked
to stop (abort, cancel, a server-side abort); error: recorded by callers that keep failed requests
as data (engines raise typed errors instead)."""


DEFAULT_TEMPERATURE = 1.0
"""The sampling temperature T where none is given, in every signature that takes one: the engine samples
from softmax(logits / T) and the learner must recompute log-probs at the same T, so a default that
differed anywhere on the way would silently train on the wrong log-probs."""


class SamplingParams(StrictFrozenModel):
    """How to sample one request."""

    max_new_tokens: int = Field(256, gt=0)
    """Most tokens to generate (finish_reason='length' when reached)."""
    temperature: float = Field(DEFAULT_TEMPERATURE, ge=0)
    """Softmax temperature; 0 = greedy (argmax)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1 = off. Below 1 the behaviour logprobs are of the truncated distribution."""
    top_k: int = Field(0, ge=0)
    """Sample among the k most likely tokens; 0 = off. On, behaviour logprobs are of the truncated one."""
    stop: tuple[str, ...] = ()
    """Stop strings; the result ends with the token that completes one (it is included)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the generation (included in the result)."""
    use_eos: bool = True
    """Stop at the model's EOS token(s) (included). False generates through EOS (benchmarks)."""
    seed: int | None = None
    """Seed of this request's sampler; None = drawn from the engine's seeded generator."""

    @property
    def is_truncated(self) -> bool:
        """True when top-p/top-k make behaviour logprobs differ from the learner's recomputation."""
        return self.temperature > 0 and (self.top_p < 1 or self.top_k > 0)


class GenerationRequest(StrictFrozenModel):
    """One generation: a prompt as token ids and how to sample its continuation."""

    request_id: str = Field(min_length=1)
    """Unique among the requests in flight on one engine; abort() takes it."""
    prompt_token_ids: tuple[int, ...] = Field(min_length=1)
    """The prompt exactly as the model sees it (chat template applied, never re-tokenised)."""
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    """Sampling settings."""


class GenerationTimings(StrictFrozenModel):
    """Wall-clock seconds of one request, measured by the engine."""

    queue_s: float = Field(0.0, ge=0)
    """From generate() until the request's first forward pass started."""
    first_token_s: float = Field(0.0, ge=0)
    """From generate() until the first token was sampled (0 when none was)."""
    total_s: float = Field(0.0, ge=0)
    """From generate() until the result was ready."""


class GenerationResult(StrictFrozenModel):
    """What one request produced. `token_ids`, `logprobs` and `versions` have one entry per sampled
    token and contain no padding."""

    request_id: str
    """The request's id."""
    token_ids: tuple[int, ...]
    """Sampled tokens, including the stop token / the token that completed a stop string."""
    logprobs: tuple[float, ...]
    """log p(token) under the distribution it was sampled from (see the module docstring). Empty only
    from the OpenAI-compatible evaluation adapter when its server returns none (`has_logprobs`)."""
    versions: tuple[int, ...]
    """Policy version of the weights that produced each token (non-decreasing)."""
    finish_reason: FinishReason
    """Why generation ended."""
    stop_reason: str | int | None = None
    """The stop string or token id (stop/EOS) that ended it; None otherwise."""
    version_start: int
    """Engine version when the request started (≤ versions[0])."""
    version_end: int
    """Engine version when the request ended (≥ versions[-1])."""
    timings: GenerationTimings = Field(default_factory=GenerationTimings)
    """Wall-clock timings."""

    @model_validator(mode="after")
    def _check(self) -> GenerationResult:
        n = len(self.token_ids)
        if len(self.logprobs) not in (0, n) or len(self.versions) != n:
            raise ValueError(
                f"token_ids ({n}), logprobs ({len(self.logprobs)}) and versions ({len(self.versions)}) "
                "must have one entry per sampled token"
            )
        if any(math.isnan(value) or value > _LOGPROB_SLACK for value in self.logprobs):
            raise ValueError("logprobs must be log-probabilities (≤ 0, no NaN)")
        bounds = (self.version_start, *self.versions, self.version_end)
        if any(later < earlier for earlier, later in itertools.pairwise(bounds)):
            raise ValueError(
                f"versions must not decrease: version_start={self.version_start}, "
                f"versions={self.versions[:3]}…, version_end={self.version_end}"
            )
        return self

    @property
    def has_logprobs(self) -> bool:
        return len(self.logprobs) == len(self.token_ids)


class TruncationWarning:
    """Logs, once per engine, that top-p/top-k make behaviour logprobs differ from the learner's."""

    def __init__(self, engine: str, logger: logging.Logger) -> None:
        self._engine = engine
        self._logger = logger
        self._has_warned = False

    def check(self, sampling: SamplingParams) -> None:
        if self._has_warned or not sampling.is_truncated:
            return
        self._has_warned = True
        self._logger.warning(
            "%s: top_p=%s / top_k=%s truncate the sampling distribution; behaviour logprobs are of the "
            "truncated, renormalised distribution, which the learner's full-vocabulary recomputation does "
            "not reproduce (importance ratios ≠ 1 even on-policy). Use top_p=1, top_k=0 for RL.",
            self._engine,
            sampling.top_p,
            sampling.top_k,
        )
