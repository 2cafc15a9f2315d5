"""Variable-length causal attention for packed micro-batches without an `N × N` mask.

HF's sdpa/eager kernels isolate packed trajectories through a dense `(N, N)` block-diagonal
mask, so attention costs `N²` per layer instead of `Σ_j T_j²` — on CPU, for 8 × 512 tokens,
about as much as all the linear layers together. This attention function (registered under
`VARLEN_SDPA`) instead runs `F.scaled_dot_product_attention(is_causal=True)` once per
trajectory, finding the boundaries where `position_ids` restart at 0 — the role flash-attention's
varlen kernel plays on GPU.

Learner-only: it needs a packed training forward (`position_ids` given, no KV cache, query and
key of the same length) and raises otherwise; models that generate keep `sdpa`. Registering is
an explicit call (HF's attention registry is process-global), never an import side effect.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

VARLEN_SDPA = "vcpo_varlen_sdpa"
"""`attn_implementation` name of `varlen_sdpa_attention` after `register_varlen_sdpa()`."""


def trajectory_bounds(position_ids: Tensor) -> list[tuple[int, int]]:
    """`[start, end)` of each packed trajectory: a new one starts wherever the position is 0.

    `position_ids`: (1, N). One host sync (the boundaries are needed as Python ints).
    """
    starts = torch.nonzero(position_ids[0] == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        raise ValueError("packed position_ids must start at 0 and restart at 0 at every trajectory")
    ends = [*starts[1:], position_ids.shape[1]]
    return list(zip(starts, ends, strict=True))


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
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # HF's repeat_kv order: each KV head serves `groups` consecutive query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout_p=dropout,
            is_causal=True,
            scale=scaling,
        )
        for start, end in trajectory_bounds(position_ids)
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def register_varlen_sdpa() -> str:
    """Register `varlen_sdpa_attention` with HF (idempotent) and return its name; then load the
    model with `attn_implementation=VARLEN_SDPA` or call `model.set_attn_implementation(VARLEN_SDPA)`.

    HF builds no attention mask for an implementation without a mask function, so nothing `N²`
    is allocated."""
    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
    return VARLEN_SDPA
