"""The synchronous half of the HF engine: a left-padded batch of sequences over one KV cache.

`DecodeBatch.step` is one engine iteration: drop aborted rows, prefill newcomers and merge their
KV into the batch, run one decode forward for every row, sample, and return the rows that
finished. Everything here runs on the engine's single worker thread; the asyncio side
(rollout/engines/hf_engine.py) only touches a `Row` between steps.

Layout: all rows share the KV cache's columns; a row's tokens are right-aligned (left padding) and
`attention_mask` marks its real columns. Every row keeps "all of its context but the last token"
in the cache and feeds that last token to the next decode forward, so a fresh prompt, a sequence
re-prefilled after a weight load, and a running row go through the same decode step, and every
sampled token comes from that step. Joining rows are left-padded to the batch's width (or the
batch to theirs); when rows leave, columns that are padding in every remaining row are trimmed.
Returned tokens never contain padding.

Cost: the decode forward sees B × (T + 1) attention columns; HF's DynamicCache grows by
concatenation, i.e. copies the cache once per step (as HF `generate` does).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from rollout.engines.sampling import StopStringMatcher, sample_next_tokens
from rollout.request_record import GenerationProgress


@dataclass(eq=False)
class Row(GenerationProgress):
    """One sequence: its progress plus how to sample and stop it. The worker thread mutates it during
    a step; the event loop reads it and sets `is_aborted` between steps."""

    generator: torch.Generator = field(default_factory=torch.Generator)
    stop_matcher: StopStringMatcher | None = None
    stop_token_ids: frozenset[int] = frozenset()
    max_new_tokens: int = 1

    @property
    def context(self) -> list[int]:
        return [*self.request.prompt_token_ids, *self.token_ids]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1] if self.token_ids else self.request.prompt_token_ids[-1]

    def append(self, token_id: int, logprob: float, version: int) -> None:
        """Record a sampled token and decide whether the row is finished."""
        self.extend((token_id,), (logprob,), version)
        if token_id in self.stop_token_ids:
            self.finish("stop", token_id)
        elif self.stop_matcher and (stop := self.stop_matcher.match(self.token_ids)) is not None:
            self.finish("stop", stop)
        elif len(self.token_ids) >= self.max_new_tokens:
            self.finish("length")


class DecodeBatch:
    """Rows decoded together over one KV cache (see the module docstring)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        self._device = next(model.parameters()).device
        self.rows: list[Row] = []
        self.steps = 0
        self.peak_rows = 0
        self._cache: DynamicCache | None = None  # per layer (B, H, T, D) keys and values; None = no columns
        self._mask = torch.zeros(0, 0, dtype=torch.long, device=self._device)  # (B, T)

    @torch.inference_mode()
    def step(self, admit: list[Row], drop: list[Row], version: int) -> list[Row]:
        """Drop `drop`, prefill and add `admit`, decode one token for every row; returns the rows
        that finished (already removed)."""
        if drop:
            self._keep([row not in drop for row in self.rows])
        if admit:
            started = time.perf_counter()
            for row in admit:
                row.started_at = started
            self._add(admit)
        if not self.rows:
            return []
        self.steps += 1
        self.peak_rows = max(self.peak_rows, len(self.rows))
        last_tokens = torch.tensor([[row.last_token] for row in self.rows], device=self._device)
        positions = self._mask.sum(dim=1, keepdim=True)  # real tokens in the cache = the input's position
        mask = torch.cat([self._mask, torch.ones_like(positions)], dim=1)
        if self._cache is None:
            self._cache = _to_cache([], self._model)
        logits = self._forward(last_tokens, mask, positions, self._cache)
        self._mask = mask
        sampled = sample_next_tokens(
            logits, [row.request.sampling for row in self.rows], [row.generator for row in self.rows]
        )
        for row, token_id, logprob in zip(
            self.rows, sampled.token_ids.tolist(), sampled.logprobs.tolist(), strict=True
        ):
            row.append(token_id, logprob, version)
        finished = [row for row in self.rows if row.finish_reason is not None]
        if finished:
            self._keep([row.finish_reason is None for row in self.rows])
        return finished

    @torch.inference_mode()
    def recompute(self) -> None:
        """Rebuild the whole KV cache with the current weights (after a weight load)."""
        rows = self.rows
        self.rows, self._cache = [], None
        self._mask = self._mask[:0, :0]
        if rows:
            self._add(rows)

    def _forward(self, input_ids: Tensor, mask: Tensor, positions: Tensor, cache: DynamicCache) -> Tensor:
        """One model forward; `cache` grows by `input_ids`' columns; returns the (B, V) logits of the
        last position."""
        output = self._model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return output.logits[:, -1, :]

    def _add(self, rows: list[Row]) -> None:
        """Prefill every row's context but its last token, then merge into the batch."""
        contexts = [row.context[:-1] for row in rows]
        width = max(len(c) for c in contexts)
        new_cache = _to_cache([], self._model)
        new_mask = torch.zeros(len(rows), width, dtype=torch.long, device=self._device)
        if width:
            ids = torch.zeros(len(rows), width, dtype=torch.long, device=self._device)
            for i, context in enumerate(contexts):
                if context:
                    ids[i, width - len(context) :] = torch.tensor(context, device=self._device)
                    new_mask[i, width - len(context) :] = 1
            positions = (new_mask.cumsum(dim=1) - 1).clamp(min=0)
            self._forward(ids, new_mask, positions, new_cache)
        merged = _merge_caches(
            _layers(self._cache), self._mask.shape[0], _layers(new_cache), len(rows), width - self.width
        )
        self._cache = _to_cache(merged, self._model) if merged else None
        self._mask = torch.cat(_left_pad_pair(self._mask, new_mask), dim=0)
        self.rows = [*self.rows, *rows]

    @property
    def width(self) -> int:
        return self._mask.shape[1]

    def _keep(self, keep: list[bool]) -> None:
        """Keep the rows flagged True; trim columns that are padding in every remaining row."""
        self.rows = [row for row, flag in zip(self.rows, keep, strict=True) if flag]
        if not self.rows:
            self._cache, self._mask = None, self._mask[:0, :0]
            return
        index = torch.tensor(
            [i for i, flag in enumerate(keep) if flag], dtype=torch.long, device=self._device
        )
        mask = self._mask.index_select(0, index)
        start = int(mask.any(dim=0).long().argmax())  # first column some remaining row uses
        self._mask = mask[:, start:]
        self._cache = _to_cache(
            [
                (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
                for k, v in _layers(self._cache)
            ],
            self._model,
        )


def check_cache_layout(model: PreTrainedModel) -> None:
    """Raise ValueError unless every KV-cache layer of `model` is a full-attention DynamicLayer (the
    only layout DecodeBatch knows how to pad, merge and trim)."""
    layers = DynamicCache(config=model.config).layers
    kinds = {type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer}
    if kinds:
        raise ValueError(
            f"the HF engine batches full-attention KV caches only; this model uses {sorted(kinds)} "
            "layers — serve it with vLLM or SGLang"
        )


def _layers(cache: DynamicCache | None) -> list[tuple[Tensor, Tensor]]:
    """Per-layer (keys, values) of a cache; [] for no cache or one that holds no columns yet."""
    if cache is None or not cache.layers or not cache.layers[0].is_initialized:
        return []
    return [(layer.keys, layer.values) for layer in cache.layers]


def _to_cache(layers: list[tuple[Tensor, Tensor]], model: PreTrainedModel) -> DynamicCache:
    """A DynamicCache holding these tensors without copying them (HF's constructor would concatenate
    them onto empty tensors, i.e. copy the whole cache)."""
    cache = DynamicCache(config=model.config)
    for layer, (keys, values) in zip(cache.layers, layers, strict=False):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache


def _left_pad_pair(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Left-pad the narrower of two (B, T) masks with zeros to the wider one's width."""
    width = max(a.shape[1], b.shape[1])
    return F.pad(a, (width - a.shape[1], 0)), F.pad(b, (width - b.shape[1], 0))


def _merge_caches(
    old: list[tuple[Tensor, Tensor]],
    old_rows: int,
    new: list[tuple[Tensor, Tensor]],
    new_rows: int,
    width_gap: int,
) -> list[tuple[Tensor, Tensor]]:
    """Stack two per-layer caches along the batch, left-padding the narrower one with zeros.

    `width_gap` = new width − old width. Either side may be empty (no columns yet): it becomes all
    padding of the other's shape.
    """
    if not old and not new:
        return []
    merged = []
    for layer in range(len(old) or len(new)):
        pair = []
        for source, rows, pad in ((old, old_rows, max(width_gap, 0)), (new, new_rows, max(-width_gap, 0))):
            if source:
                keys, values = source[layer]
                pair.append((F.pad(keys, (0, 0, pad, 0)), F.pad(values, (0, 0, pad, 0))))
            else:
                template = (new or old)[layer][0]
                empty = template.new_zeros(rows, *template.shape[1:])
                pair.append((empty, empty))
        merged.append((torch.cat([pair[0][0], pair[1][0]]), torch.cat([pair[0][1], pair[1][1]])))
    return merged
