"""Per-token target log-probabilities from one packed forward pass.

Only the `K` target positions of a micro-batch go through `lm_head` (HF `logits_to_keep` with
an index tensor), so the `(K, V)` logits are the only vocabulary-sized tensor; prompt and
tool-output positions never produce logits. `log π(y) = logit_y − logsumexp(logits)` in fp32
(no `(K, V)` log-softmax output is materialised beyond the fp32 upcast of bf16 logits).

Where the `(K, V)` logits would pass a memory budget (`head_chunk_plan`, `learner.logits_chunk_mib`), the
model's body gives the `(K, H)` hidden states at the targets instead and the head runs a chunk of rows at
a time (`learner/forward/chunked_head.py`): the same values within fp32 rounding, memory independent of
`K × V`.

This module does not build losses or touch gradients; the OPOB paths and a plain GRPO step
both call `packed_target_logprobs` and weight its output themselves.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from learner.forward.chunked_head import HeadGrad, chunk_rows, chunked_target_logprobs, head_chunks
from learner.forward.packing import PackedMicroBatch, SharedPrefixLayout
from learner.forward.varlen_attention import VARLEN_SDPA
from rollout.types import DEFAULT_TEMPERATURE

PACKING_AWARE_ATTENTION = frozenset({"sdpa", "eager", "flash_attention_2", "flash_attention_3", VARLEN_SDPA})
"""Attention implementations that keep packed trajectories apart given restarting `position_ids`
and `attention_mask=None`: sdpa/eager through the dense block-diagonal mask HF builds in
`masking_utils.find_packed_sequence_indices`; flash through varlen `cu_seqlens` derived from
`position_ids`; `VARLEN_SDPA` by construction. sdpa, eager and `VARLEN_SDPA` are tested on CPU."""


def native_bf16(device: torch.device) -> bool:
    """Whether `device` does bf16 matmuls in hardware (CUDA with bf16; a CPU with AVX-512-BF16 or AMX).
    Elsewhere bf16 is emulated and slower than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        capabilities = torch.cpu.get_capabilities()
        return any(capabilities.get(flag) for flag in ("avx512_bf16", "amx_bf16", "bf16"))
    return False


def autocast_dtype(spec: str, device: torch.device) -> torch.dtype | None:
    """`learner.autocast` on `device`: 'bfloat16' → bf16; 'auto' → bf16 where `native_bf16`, else None;
    'none' → None."""
    if spec == "bfloat16" or (spec == "auto" and native_bf16(device)):
        return torch.bfloat16
    return None


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[object]:
    """`torch.autocast` on `device` in `dtype` (bf16 matmuls over fp32 weights); a no-op for None.

    Only forwards run inside it: the backward replays the forward's dtypes, and the log-softmax of the
    targets is fp32 either way (`token_logprobs` upcasts the logits)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class _TargetLogprobs(torch.autograd.Function):
    """`logit_y − logsumexp(logits)` with a one-buffer backward.

    Autograd of the two-op formula allocates a zero (K, V) tensor for the gather, another for
    `exp(x − lse)` and a third for their sum; here the backward writes `g·(onehot − softmax)`
    into a single fp32 (K, V) buffer (fp64 for fp64 logits). Saves the logits (as autograd
    would) and the (K,) lse.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logits: Tensor, target_ids: Tensor) -> Tensor:
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        lse = torch.logsumexp(wide, dim=-1)
        ctx.save_for_backward(logits, target_ids, lse)
        return wide.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1) - lse

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        logits, target_ids, lse = ctx.saved_tensors
        grad_logits = torch.sub(logits.to(lse.dtype), lse.unsqueeze(-1)).exp_().mul_(-grad.unsqueeze(-1))
        grad_logits.scatter_add_(-1, target_ids.unsqueeze(-1), grad.unsqueeze(-1))
        return grad_logits.to(logits.dtype), None


def token_logprobs(logits: Tensor, target_ids: Tensor) -> Tensor:
    """`log softmax(logits)[target]` in fp32, differentiable w.r.t. `logits`.

    `logits`: (K, V) any float dtype; `target_ids`: (K,) long. Returns (K,) float32 (float64
    for float64 logits).
    """
    return _TargetLogprobs.apply(logits, target_ids)


def check_packing_aware(model: nn.Module) -> None:
    """Raise unless the model's attention isolates packed trajectories (see `PACKING_AWARE_ATTENTION`;
    a non-HF model with the same call signature says so with a true `is_packing_aware` attribute)."""
    if getattr(model, "is_packing_aware", False):
        return
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation not in PACKING_AWARE_ATTENTION:
        raise ValueError(
            f"attention implementation {implementation!r} is not known to isolate packed trajectories; "
            f"load the model with attn_implementation in {sorted(PACKING_AWARE_ATTENTION)} or pack one "
            "trajectory per micro-batch"
        )


def chunkable_head(model: nn.Module) -> nn.Module | None:
    """`model`'s output head where its logits are exactly `decoder(x) · Wᵀ` (a plain bias-free `nn.Linear`
    after `get_decoder()`, no logit scaling or soft-capping), so it can run in chunks; else None. A model of
    another kind says so itself: its `chunkable_head()` (a module with the head's `weight`, or None) and its
    `target_hidden(**inputs, logits_to_keep=positions)` (the (K, H) inputs of that head)."""
    own = getattr(model, "chunkable_head", None)
    if own is not None:
        return own()
    get_head, get_decoder = getattr(model, "get_output_embeddings", None), getattr(model, "get_decoder", None)
    if get_head is None or get_decoder is None:
        return None
    head, config = get_head(), getattr(model, "config", None)
    if type(head) is not nn.Linear or head.bias is not None or get_decoder() is None:
        return None
    scaled = getattr(config, "logit_scale", None) not in (None, 1.0)
    if scaled or getattr(config, "final_logit_softcapping", None):
        return None
    return head


def head_chunk_plan(model: nn.Module, batch: PackedMicroBatch, chunk_mib: float | None
                    ) -> list[tuple[int, int]] | None:
    """The target rows of `batch` in chunks whose fp32 `(rows, V)` block takes at most `chunk_mib` MiB
    (`chunked_head.head_chunks`: whole short trajectories together, a long one in pieces); None where one
    pass fits (or `chunk_mib` is None, or the head cannot be chunked): the plain path, as before."""
    head = chunkable_head(model) if chunk_mib is not None else None
    if head is None:
        return None
    rows = chunk_rows(head.weight.shape[0], chunk_mib)
    if int(batch.target_positions.numel()) <= rows:
        return None
    return head_chunks(batch.target_counts, rows)


def packed_target_logprobs(
    model: nn.Module, batch: PackedMicroBatch, inputs_embeds: Tensor | None = None,
    temperature: float = DEFAULT_TEMPERATURE, *, layout: SharedPrefixLayout | None = None,
    chunks: list[tuple[int, int]] | None = None, head_grad: HeadGrad | None = None,
) -> Tensor:
    """Log-probabilities of the targets of `batch` under `model`, one forward pass.

    `model`: an HF causal LM. `inputs_embeds`: (1, N, H) to feed instead of `batch.input_ids`
    (the fast per-trajectory gradient path starts its graph there). Returns (K,) float32,
    aligned with `batch.target_positions`. Gradients flow if grad mode is on. `temperature`: the
    sampling temperature T of the behaviour policy; log-probs are of softmax(logits / T), as the
    engines report them. `layout`: forward `share_prefixes(batch)` instead, each group's common prompt
    once (needs `can_share_prompts(model)`): the same values up to the rounding of another summation
    order, and as differentiable — but not for hooks that attribute a token's gradient to one trajectory.
    `chunks` (`head_chunk_plan`): run the output head in these chunks of target rows; `head_grad` then
    takes the head's weight gradient chunk by chunk (the per-trajectory path's handler).
    """
    targets = batch.target_ids[batch.target_positions]
    if chunks is not None:
        hidden = _target_hidden(model, batch, inputs_embeds, layout)
        return chunked_target_logprobs(hidden, chunkable_head(model), targets, temperature, chunks, head_grad)
    logits = _target_logits(model, batch, inputs_embeds, temperature, layout)
    return token_logprobs(logits, targets)


def can_share_prompts(model: nn.Module) -> bool:
    """Whether `model`'s attention understands `share_prefixes`' branches (`VARLEN_SDPA`)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == VARLEN_SDPA


def _target_logits(model: nn.Module, batch: PackedMicroBatch, inputs_embeds: Tensor | None,
                   temperature: float, layout: SharedPrefixLayout | None = None) -> Tensor:
    """(K, V) logits / T at the target positions of `batch`, from one packed forward."""
    inputs, targets = _forward_inputs(model, batch, inputs_embeds, layout)
    output = model(**inputs, logits_to_keep=targets)
    # squeeze, not [0]: select's backward would allocate and copy a zero (1, K, V) gradient.
    logits = output.logits.squeeze(0)
    return logits / temperature if temperature != 1.0 else logits


def _target_hidden(model: nn.Module, batch: PackedMicroBatch, inputs_embeds: Tensor | None,
                   layout: SharedPrefixLayout | None) -> Tensor:
    """(K, H) the decoder's last hidden states at the target positions: what the head reads."""
    inputs, targets = _forward_inputs(model, batch, inputs_embeds, layout)
    if hasattr(model, "target_hidden"):
        return model.target_hidden(**inputs, logits_to_keep=targets)
    hidden = model.get_decoder()(**inputs).last_hidden_state
    return hidden.squeeze(0).index_select(0, targets)


def _forward_inputs(model: nn.Module, batch: PackedMicroBatch, inputs_embeds: Tensor | None,
                    layout: SharedPrefixLayout | None) -> tuple[dict[str, Tensor | bool], Tensor]:
    """The packed forward's keyword arguments and the positions whose next token is a target."""
    if layout is not None:
        if inputs_embeds is not None or not can_share_prompts(model):
            raise ValueError("a shared-prompt layout needs input ids and attn_implementation "
                             f"{VARLEN_SDPA!r}: no other attention lets a trajectory read another's prompt")
        token_inputs = {"input_ids": layout.input_ids(batch)}
        position_ids, targets = layout.position_ids(batch), layout.target_positions
    else:
        if batch.num_trajectories > 1:  # a single sequence is isolated by any causal attention
            check_packing_aware(model)
        token_inputs = (
            {"input_ids": batch.input_ids} if inputs_embeds is None else {"inputs_embeds": inputs_embeds}
        )
        position_ids, targets = batch.position_ids, batch.target_positions
    # use_cache=False matters: with a cache HF skips the packed-sequence mask and trajectories
    # would attend to each other.
    return {**token_inputs, "position_ids": position_ids, "use_cache": False}, targets


def trajectory_logliks(target_logprobs: Tensor, batch: PackedMicroBatch) -> Tensor:
    """Aggregated log-likelihoods `ℓ_j = Σ_t c_t log π(y_t | y_<t)` of the packed trajectories.

    `target_logprobs`: (K,) from `packed_target_logprobs`. Returns (n,) float32.
    """
    positions = batch.target_positions
    weighted = target_logprobs * batch.target_weights[positions]
    sums = torch.zeros(batch.num_trajectories, dtype=torch.float32, device=weighted.device)
    return sums.index_add(0, batch.token_trajectory[positions], weighted)


def packed_target_stats(
    model: nn.Module, batch: PackedMicroBatch, temperature: float = DEFAULT_TEMPERATURE, *,
    layout: SharedPrefixLayout | None = None,
) -> tuple[Tensor, Tensor]:
    """(log π(target), Σ_v π(v)²) at the targets of `batch`, one forward pass, no gradients: the
    proximal pass of objectives that need full-vocabulary statistics (OTB's logit-gradient energy
    ‖e_y − π‖² = 1 − 2π(y) + Σ_v π(v)²). Returns two (K,) float32 tensors. `layout` as in
    `packed_target_logprobs`."""
    with torch.no_grad():
        logits = _target_logits(model, batch, None, temperature, layout).float()
        log_probs = torch.log_softmax(logits, dim=-1)
        targets = batch.target_ids[batch.target_positions]
        chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        sum_sq = log_probs.mul(2).exp().sum(dim=-1)
    return chosen, sum_sq
