"""Fused elementwise kernels for the learner's gradient forward (`learner.fused_elementwise`).

Under bf16 autocast over fp32 weights a decoder layer of an HF Llama-family model runs its matrix
products in bf16 and everything between them as separate eager kernels, many in fp32: the RMSNorm
(six kernels forward, more backward), the rotary embedding of q and k (its output in fp32, cast again
per trajectory by the attention), SiLU(gate)·up. On a CPU those kernels stream activation-sized
tensors through memory one after another; at the default run's shape they cost about as much as the
attention. This module compiles each of the three (forward and backward) into fused kernels with
`torch.compile` (inductor: C++/OpenMP on CPU, Triton on CUDA) and installs them for the length of a
`with fused_elementwise(model):` block, as forwards of the module instances — not of their classes, and
never on other models (an in-process engine's model keeps HF's code).

Numerics (checked by tests/learner/forward/test_fused_layers.py):

* SiLU·up and the rotary embedding give HF's eager forward bit for bit, and under bf16 autocast (the
  fast path) its backward too: inductor computes in fp32 and is told to round wherever eager rounds
  (`emulate_precision_casts`). The rotary output is cast to q's dtype inside the kernel — the cast an
  autocast attention makes of HF's fp32 output anyway (a no-op without autocast) — and for the varlen
  attention the key's grouped-query heads are repeated before that cast, as HF's path does, so their
  gradients are summed in fp32 as there. In fp32 (no autocast) SiLU's backward is inductor's formula:
  gradients within fp32 rounding (~1e-7 relative) of eager's.
* RMSNorm is the same formula (`weight * (x·rsqrt(mean(x²)+ε)).to(input dtype)`, fp32 inside) with the
  mean reduced in another order: its output differs from eager by fp32 rounding (~1e-7 relative), which
  the bf16 cast of the next matrix product mostly absorbs.

Modules other than these (a different norm or activation, Qwen3's q/k norms, a subclass that changed
a forward) keep HF's forward; `FusedElementwise.installed` counts what was replaced. Only the gradient
forward uses this (`TorchLearner`): the proximal pass that gives log π_old — IS weights, ESS — stays
HF's eager code, so at lag 0 those stay what they were.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from learner.forward.varlen_attention import VARLEN_SDPA

RMS_NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
"""HF norms computing `weight * (x / sqrt(mean(x²) + variance_epsilon))` (the cast back to the input
dtype before the scale included). Another class with that exact forward can be added here."""

MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP"})
"""HF MLPs computing `down_proj(act_fn(gate_proj(x)) * up_proj(x))`."""

ATTENTION_SLIDING_WINDOW: dict[str, Callable[[nn.Module], int | None] | None] = {
    "LlamaAttention": None,
    "Qwen2Attention": lambda module: module.sliding_window,
    "MistralAttention": lambda module: getattr(module.config, "sliding_window", None),
}
"""HF attentions whose forward is q/k/v projections → rotary → the configured attention function →
o_proj, and what each passes as `sliding_window` (None: Llama passes nothing)."""

PARTS = ("rms_norm", "mlp", "rotary")
"""What can be fused; `FusedElementwise(model, parts)` takes a subset (tests compare them one by one)."""

_COMPILE_OPTIONS = {"emulate_precision_casts": True}
"""Round intermediates where eager rounds them (bf16 SiLU, bf16 products): bit-identical to eager."""


def _rms_norm(hidden: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return weight * (hidden * torch.rsqrt(variance + epsilon)).to(dtype)


def _silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return nn.functional.silu(gate) * up


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotary(query: Tensor, key: Tensor, cos: Tensor, sin: Tensor, key_repeats: int) -> tuple[Tensor, Tensor]:
    """HF's `apply_rotary_pos_emb` (heads on dim 1), the query cast to its input's dtype. With `key_repeats`
    > 0 the key's heads are also repeated that many times (grouped-query attention, HF's `repeat_kv`
    order) and then cast; with 0 the key is returned as HF returns it.

    The repeat comes before the cast, as in HF's code under autocast (the attention repeats the fp32
    rotary output, then casts): its backward then sums the repeated heads' gradients in fp32 as eager
    does, where repeating the cast output would sum them in bf16."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated_query = query * cos + _rotate_half(query) * sin
    rotated_key = key * cos + _rotate_half(key) * sin
    if key_repeats > 0:
        rotated_key = rotated_key.repeat_interleave(key_repeats, dim=1).to(key.dtype)
    return rotated_query.to(query.dtype), rotated_key


@functools.cache
def _compiled(name: str) -> Callable[..., Any]:
    """One compiled function per kernel and process (dynamic shapes: one graph for every length)."""
    function = {"rms_norm": _rms_norm, "mlp": _silu_mul, "rotary": _rotary}[name]
    return torch.compile(function, dynamic=True, options=_COMPILE_OPTIONS)


def compiler_problem(device: torch.device) -> str | None:
    """Why `torch.compile` cannot build kernels for `device` here (None: it can): inductor's own compiler
    search on CPU (its `cpp.cxx` candidates), Triton on CUDA."""
    if device.type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except Exception as exc:  # inductor raises InvalidCxxCompiler, naming what it tried
            return (f"torch.compile's CPU backend needs a C++ compiler ({exc}): install one (e.g. apt-get "
                    "install g++) or set learner.fused_elementwise: false")
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return ("torch.compile's CUDA backend needs Triton, which this torch cannot import: install the "
                    "triton that matches it or set learner.fused_elementwise: false")
    return None


def resolve(setting: bool | str, device: torch.device) -> tuple[bool, str | None]:
    """`learner.fused_elementwise` on `device`: (on?, why not where 'auto' turned it off). True/False as
    written; 'auto': on where `compiler_problem` finds none. One rule for the run and the bench."""
    if setting != "auto":
        return bool(setting), None
    problem = compiler_problem(device)
    return problem is None, problem


def _rms_norm_forward(module: nn.Module, hidden: Tensor) -> Tensor:
    return _compiled("rms_norm")(hidden, module.weight, float(module.variance_epsilon))


def _mlp_forward(module: nn.Module, hidden: Tensor) -> Tensor:
    return module.down_proj(_compiled("mlp")(module.gate_proj(hidden), module.up_proj(hidden)))


def _attention_forward(module: nn.Module, hidden_states: Tensor,
                       position_embeddings: tuple[Tensor, Tensor] | None = None,
                       attention_mask: Tensor | None = None, past_key_values: object | None = None,
                       **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """HF's Llama/Qwen2/Mistral attention forward with the fused rotary (training forwards: no KV cache)."""
    if past_key_values is not None or position_embeddings is None:
        raise ValueError("fused_elementwise serves training forwards only (no KV cache, rotary given)")
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    query = module.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    key = module.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    value = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    implementation = module.config._attn_implementation
    # Varlen attention repeats a key only where it has fewer heads than the query: its heads are repeated
    # and cast here (see `_rotary`). HF's own attentions repeat by the config's ratio, so they get HF's key.
    key_repeats = query.shape[1] // key.shape[1] if implementation == VARLEN_SDPA else 0
    query, key = _compiled("rotary")(query, key, *position_embeddings, key_repeats)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    sliding_window = ATTENTION_SLIDING_WINDOW[type(module).__name__]
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window(module)
    output, weights = attention(module, query, key, value, attention_mask,
                                dropout=0.0 if not module.training else module.attention_dropout,
                                scaling=module.scaling, **kwargs)
    return module.o_proj(output.reshape(*input_shape, -1).contiguous()), weights


def _silu(module: nn.Module) -> bool:
    """The MLP's activation is plain SiLU (HF's `SiLUActivation` or torch's `nn.SiLU`)."""
    act = getattr(module, "act_fn", None)
    return type(act).__name__ in ("SiLU", "SiLUActivation")


def _fused_forward(module: nn.Module, parts: frozenset[str]) -> Callable[..., Any] | None:
    """The fused forward for `module`, or None where it keeps its own."""
    name = type(module).__name__
    if "rms_norm" in parts and name in RMS_NORM_CLASSES and hasattr(module, "variance_epsilon"):
        return _rms_norm_forward
    if "mlp" in parts and name in MLP_CLASSES and _silu(module):
        return _mlp_forward
    if "rotary" in parts and name in ATTENTION_SLIDING_WINDOW:
        return _attention_forward
    return None


class FusedElementwise:
    """Context manager: the fused forwards on `model`'s supported modules while active (module docstring).

    Re-entering while active (a forward nested in the gradient pass) does nothing; leaving the outer
    block — also after an exception — gives every module back its own forward."""

    def __init__(self, model: nn.Module, parts: tuple[str, ...] = PARTS) -> None:
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown fused parts {sorted(unknown)}; choose from {list(PARTS)}")
        self.model = model
        self.parts = frozenset(parts)
        self.installed: dict[str, int] = {}
        """Per module class, how many instances got a fused forward (last `__enter__`)."""
        self._replaced: list[nn.Module] = []
        self._depth = 0

    def __enter__(self) -> FusedElementwise:
        self._depth += 1
        if self._depth > 1:
            return self
        self.installed = {}
        try:
            for module in self.model.modules():
                forward = _fused_forward(module, self.parts)
                if forward is None or "forward" in module.__dict__:
                    continue  # an instance-level forward is someone else's: leave it
                module.forward = types.MethodType(forward, module)
                self._replaced.append(module)
                self.installed[type(module).__name__] = self.installed.get(type(module).__name__, 0) + 1
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._restore()

    def _restore(self) -> None:
        for module in self._replaced:
            module.__dict__.pop("forward", None)
        self._replaced = []
        self._depth = 0
