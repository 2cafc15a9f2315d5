"""Token sampling with exact behaviour logprobs, and stop-string detection on token ids.

Used by our own decode loop (HF engine). Pure functions on tensors plus one small stateless
matcher; no model, no threads.

Sampling follows vLLM's `processed_logprobs` semantics (see rollout/types.py): scale by 1/T, apply
top-k then top-p (mask the rest to -inf), log-softmax in fp32, draw from that distribution with
the row's own `torch.Generator`, and report the drawn token's log-probability. Greedy rows (T = 0)
take the argmax and report log softmax(logits) (T = 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from rollout.types import SamplingParams


class SampledTokens(NamedTuple):
    """token_ids: (B,) long; logprobs: (B,) float32 — log p of each drawn token."""

    token_ids: Tensor
    logprobs: Tensor


def truncate_logits(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """Mask all but the top-k, then all but the smallest set of mass ≥ top_p, to -inf.

    `scaled`: (V,) temperature-scaled logits. Returns a new (V,) tensor; the most likely token is
    always kept.
    """
    out = scaled.clone()
    if 0 < top_k < out.numel():
        kth_largest = torch.topk(out, top_k).values[-1]
        out.masked_fill_(out < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(out, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of the more likely tokens
        out[order[mass_before >= top_p]] = float("-inf")  # already reached: not needed (vLLM's rule)
    return out


def sample_next_tokens(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> SampledTokens:
    """Draw one token per row.

    `logits`: (B, V) any float dtype; `params[b]` / `generators[b]`: row b's settings and generator
    (on the logits' device). Cost: one (B, V) fp32 log-softmax plus a per-row draw; top-p sorts V.
    """
    logits = logits.float()
    temperatures = torch.tensor(
        [p.temperature if p.temperature > 0 else 1.0 for p in params], device=logits.device
    )
    scaled = logits / temperatures[:, None]
    for row, p in enumerate(params):
        if p.is_truncated:
            scaled[row] = truncate_logits(scaled[row], p.top_k, p.top_p)
    logprobs = torch.log_softmax(scaled, dim=-1)
    token_ids = torch.argmax(logprobs, dim=-1)
    for row, p in enumerate(params):
        if p.temperature > 0:
            token_ids[row] = torch.multinomial(logprobs[row].exp(), 1, generator=generators[row])[0]
    return SampledTokens(token_ids, logprobs.gather(-1, token_ids[:, None])[:, 0])


class StopStringMatcher:
    """Finds a stop string completed by the newest token, decoding only a short tail of tokens.

    A stop string of B UTF-8 bytes spans at most B tokens, so if it ends in the newest token it lies
    inside the decoded last B + 1 tokens (the extra token keeps a leading space / a split character
    intact). Called after every token, a match is always new: an older one would have stopped the
    sequence earlier. Special tokens are skipped when decoding (as vLLM does), so stop strings match
    text only; use stop_token_ids for special tokens.
    """

    def __init__(self, stop: Sequence[str], tokenizer: object) -> None:
        self._stop = tuple(s for s in stop if s)
        self._tokenizer = tokenizer
        self._window = max((len(s.encode()) for s in self._stop), default=0) + 1

    def __bool__(self) -> bool:
        return bool(self._stop)

    def match(self, token_ids: Sequence[int]) -> str | None:
        """The stop string that the last token of `token_ids` completed, or None."""
        if not self._stop:
            return None
        tail = self._tokenizer.decode(list(token_ids[-self._window :]), skip_special_tokens=True)
        return next((s for s in self._stop if s in tail), None)
