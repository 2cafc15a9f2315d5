"""Per-token target log-probabilities from one packed forward pass.

Only the `K` target positions of a micro-batch go through `lm_head` (HF `logits_to_keep` with
an index tensor), so the `(K, V)` logits are the only vocabulary-sized tensor; prompt and
tool-output positions never produce logits. `log π(y) = logit_y − logsumexp(logits)` in fp32
(no `(K, V)` log-softmax output is materialised beyond the fp32 upcast of bf16 logits).

This module does not build losses or touch gradients; the OPOB paths and a plain GRPO step
both call `packed_target_logprobs` and weight its output themselves.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

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


def packed_target_logprobs(
    model: nn.Module, batch: PackedMicroBatch, inputs_embeds: Tensor | None = None,
    temperature: float = DEFAULT_TEMPERATURE, *, layout: SharedPrefixLayout | None = None,
) -> Tensor:
    """Log-probabilities of the targets of `batch` under `model`, one forward pass.

    `model`: an HF causal LM. `inputs_embeds`: (1, N, H) to feed instead of `batch.input_ids`
    (the fast per-trajectory gradient path starts its graph there). Returns (K,) float32,
    aligned with `batch.target_positions`. Gradients flow if grad mode is on. `temperature`: the
    sampling temperature T of the behaviour policy; log-probs are of softmax(logits / T), as the
    engines report them. `layout`: forward `share_prefixes(batch)` instead, each group's common prompt
    once (needs `can_share_prompts(model)`): the same values up to the rounding of another summation
    order, and as differentiable — but not for hooks that attribute a token's gradient to one trajectory.
    """
    logits = _target_logits(model, batch, inputs_embeds, temperature, layout)
    return token_logprobs(logits, batch.target_ids[batch.target_positions])


def can_share_prompts(model: nn.Module) -> bool:
    """Whether `model`'s attention understands `share_prefixes`' branches (`VARLEN_SDPA`)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == VARLEN_SDPA


def _target_logits(model: nn.Module, batch: PackedMicroBatch, inputs_embeds: Tensor | None,
                   temperature: float, layout: SharedPrefixLayout | None = None) -> Tensor:
    """(K, V) logits / T at the target positions of `batch`, from one packed forward."""
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
    output = model(**token_inputs, position_ids=position_ids, use_cache=False, logits_to_keep=targets)
    # squeeze, not [0]: select's backward would allocate and copy a zero (1, K, V) gradient.
    logits = output.logits.squeeze(0)
    return logits / temperature if temperature != 1.0 else logits


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
