"""Variable-length causal attention for packed micro-batches without an `N × N` mask.

HF's sdpa/eager kernels isolate packed trajectories through a dense `(N, N)` block-diagonal
mask, so attention costs `N²` per layer instead of `Σ_j T_j²` — on CPU, for 8 × 512 tokens,
about as much as all the linear layers together. This attention function (registered under
`VARLEN_SDPA`) instead runs `F.scaled_dot_product_attention(is_causal=True)` once per
trajectory, finding the boundaries where `position_ids` restart at 0 — the role flash-attention's
varlen kernel plays on GPU.

Shared prompts (`learner/forward/packing.py` `share_prefixes`): a segment may also start at a position
`p > 0` that does not continue the token before it. It is a *branch* of the last segment that started
at 0 (its *root*): its queries attend to the root's first `p` tokens and causally to their own, as if
the root's prefix stood in front of them. A group's eight trajectories then need their common prompt
computed once instead of eight times. Layouts built by the packer never branch.

Learner-only: it needs a packed training forward (`position_ids` given, no KV cache, query and
key of the same length) and raises otherwise; models that generate keep `sdpa`. Registering is
an explicit call (HF's attention registry is process-global), never an import side effect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

VARLEN_SDPA = "vcpo_varlen_sdpa"
"""`attn_implementation` name of `varlen_sdpa_attention` after `register_varlen_sdpa()`."""


@dataclass(frozen=True)
class AttentionSegment:
    """Packed positions `[start, end)` that attend causally to themselves and, for a branch
    (`prefix > 0`), to the first `prefix` tokens of the root segment starting at `root`."""

    start: int
    end: int
    root: int
    prefix: int


def attention_segments(position_ids: Tensor) -> list[AttentionSegment]:
    """The segments of a packed row: a new one starts wherever the position does not continue the one
    before it; it is a root where the position is 0, else a branch of the last root.

    `position_ids`: (1, N). Two host syncs. Raises for a row that does not start at 0 or a branch
    longer than its root."""
    positions = position_ids[0]
    if positions.numel() == 0 or int(positions[0]) != 0:
        raise ValueError("packed position_ids must start at 0 and restart at 0 at every trajectory")
    breaks = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    starts = [0, *breaks.tolist()]
    first_positions = positions[breaks].tolist()
    ends = [*starts[1:], positions.numel()]
    segments: list[AttentionSegment] = []
    root = root_length = 0
    for start, end, prefix in zip(starts, ends, [0, *first_positions], strict=True):
        if prefix == 0:
            root, root_length = start, end - start
        elif prefix > root_length:
            raise ValueError(f"the segment at packed position {start} continues position {prefix - 1}, but "
                             f"its root segment (from packed position {root}) has only {root_length} tokens")
        segments.append(AttentionSegment(start, end, root, prefix))
    return segments


def branch_mask(queries: int, prefix: int, device: torch.device) -> Tensor:
    """(queries, prefix + queries) bool: every prefix key, then causal within the branch."""
    own = torch.ones(queries, queries, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(queries, prefix, dtype=torch.bool, device=device), own], dim=1)


def varlen_sdpa_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    position_ids: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """HF attention-interface function: causal attention within each packed trajectory.

    `query`: (1, H_q, N, d); `key`/`value`: (1, H_kv, N, d) (grouped-query heads are repeated
    here). Returns ((1, N, H_q, d), None) like HF's `sdpa_attention_forward`.
    """
    if (
        attention_mask is not None
        or position_ids is None
        or query.shape[0] != 1
        or key.shape[2] != query.shape[2]
    ):
        raise ValueError(
            f"{VARLEN_SDPA} handles only packed training forwards (batch 1, position_ids, no mask, no KV "
            "cache); use attn_implementation='sdpa' for generation or padded batches"
        )
    # HF's repeat_kv order: each KV head serves consecutive query heads. Key and value each by their own
    # count: the fused rotary (learner/forward/fused_layers.py) hands over a key already repeated.
    if key.shape[1] < query.shape[1]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    if value.shape[1] < query.shape[1]:
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    segments = attention_segments(position_ids)
    # Split, not slice: the backward of a split is one concatenation of the segments' gradients, while
    # every slice's backward fills a zero tensor of the whole row and adds it in (per segment, per layer).
    lengths = [segment.end - segment.start for segment in segments]
    queries, keys, values = (t.split(lengths, dim=2) for t in (query, key, value))
    index_of = {segment.start: i for i, segment in enumerate(segments)}
    outputs = []
    for i, segment in enumerate(segments):
        if segment.prefix == 0:
            outputs.append(F.scaled_dot_product_attention(
                queries[i], keys[i], values[i], dropout_p=dropout, is_causal=True, scale=scaling))
            continue
        root = index_of[segment.root]
        outputs.append(F.scaled_dot_product_attention(
            queries[i],
            torch.cat([keys[root][:, :, :segment.prefix], keys[i]], dim=2),
            torch.cat([values[root][:, :, :segment.prefix], values[i]], dim=2),
            attn_mask=branch_mask(lengths[i], segment.prefix, query.device),
            dropout_p=dropout, scale=scaling))
    # Concatenated along the token dimension of the (1, T, H, d) layout HF expects: one copy, where a
    # concatenation in (1, H, T, d) and then `.transpose(1, 2).contiguous()` would make two.
    return torch.cat([output.transpose(1, 2) for output in outputs], dim=1), None


def register_varlen_sdpa() -> str:
    """Register `varlen_sdpa_attention` with HF (idempotent) and return its name; then load the
    model with `attn_implementation=VARLEN_SDPA` or call `model.set_attn_implementation(VARLEN_SDPA)`.

    HF builds no attention mask for an implementation without a mask function, so nothing `N²`
    is allocated."""
    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    return VARLEN_SDPA
