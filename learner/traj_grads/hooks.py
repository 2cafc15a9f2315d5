"""Attach per-trajectory gradient handlers to an HF causal LM for one packed pass.

`PackedGradHooks` is a context manager. On entry it checks that every trainable parameter has a
handler (`nn.Linear`, the input `nn.Embedding`, the RMSNorms of `RMS_NORM_CLASSES`), sets
`requires_grad=False` on all of them and registers forward hooks (under autocast also pre-hooks that
hand layers reading one fp32 tensor one shared cast of it). The backward then starts at
a detached copy of the embedding output that requires grad: autograd computes only input
gradients (`δ`), never a weight gradient, and the handlers build the weight gradients
themselves — so the weight-gradient work is not done twice. On exit — also after an exception —
the hooks are removed and every `requires_grad` flag is restored.

Activation recompute (HF `gradient_checkpointing_enable`, reentrant or not): a hooked module inside a
checkpointed layer keeps nothing from the forward; its input is taken when the backward recomputes the
layer, its per-trajectory norms and weighted gradient are computed there and then (every group treated
as open, `MicroBatchState.all_open_plan`), so nothing of the layer outlives its backward — the norms are
the same, and the memory is recompute's. Modules called more than once per forward are not supported.

It does not decide coefficients or baselines (`learner/traj_grads/opob_grad.py` does).
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from learner.forward.fused_layers import RMS_NORM_CLASSES
from learner.forward.logprobs import autocast, chunkable_head, head_chunk_plan, packed_target_logprobs
from learner.forward.packing import PackedMicroBatch
from learner.traj_grads.handlers import (
    ApplyPlan,
    EmbeddingHandler,
    LinearHandler,
    MicroBatchState,
    RMSNormHandler,
)
from rollout.types import DEFAULT_TEMPERATURE

PER_TRAJECTORY_HINT = "freeze it (requires_grad=False) or use accumulate_opob_grad_per_trajectory"


class UnsupportedParameterError(ValueError):
    """A trainable parameter has no per-trajectory gradient handler in the packed path."""

    @classmethod
    def listing(cls, problems: list[str]) -> UnsupportedParameterError:
        """The error naming every trainable parameter without a handler (`problems`: one line each)."""
        return cls("the packed per-trajectory gradient path has no hook for these trainable parameters: "
                   + "; ".join(problems) + f". For each, {PER_TRAJECTORY_HINT}.")


def _is_plain(module: nn.Module, cls: type[nn.Module]) -> bool:
    """`module` is a `cls` whose forward was not overridden (quantised or LoRA layers are not)."""
    return isinstance(module, cls) and type(module).forward is cls.forward


def _embedding_problem(module: nn.Embedding) -> str | None:
    if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
        return "max_norm, scale_grad_by_freq and sparse embeddings are not supported"
    return None


def _recomputed_modules(model: nn.Module) -> set[int]:
    """ids of the modules inside a layer whose forward is recomputed in the backward (an HF
    `GradientCheckpointingLayer` with checkpointing on, in training mode)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    found: set[int] = set()
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer) and layer.gradient_checkpointing and layer.training:
            found.update(id(module) for module in layer.modules())
    return found


class PackedGradHooks:
    """Per-trajectory gradient hooks on `model` while the context is active (see module docstring)."""

    def __init__(self, model: nn.Module, autocast_dtype: torch.dtype | None = None,
                 temperature: float = DEFAULT_TEMPERATURE, logits_chunk_mib: float | None = None) -> None:
        self.model = model
        self.logits_chunk_mib = logits_chunk_mib
        """Run the output head in chunks of target rows where its `(K, V)` logits would pass this many MiB
        (`logprobs.head_chunk_plan`); the head's handler then takes its gradient chunk by chunk."""
        self.autocast_dtype = autocast_dtype
        """Run the forward under `torch.autocast` in this dtype (None: in the weights' dtype)."""
        self.temperature = temperature
        """Sampling temperature T: the log-probs are of softmax(logits / T), as the proximal pass's."""
        self.embedding_module: nn.Embedding = model.get_input_embeddings()
        self.hooked: list[tuple[nn.Module, LinearHandler | RMSNormHandler]] = []
        self.embedding: EmbeddingHandler | None = None
        self._scan(model)
        self.params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
        self._handles: list[RemovableHandle] = []
        self._saved_flags: list[tuple[nn.Parameter, bool]] = []
        self._masters: list[tuple[nn.Module, nn.Parameter]] = []

    def _scan(self, model: nn.Module) -> None:
        """Give every module owning a trainable parameter a handler; report all misfits at once."""
        embedding_weight = self.embedding_module.weight
        problems = []
        for name, module in model.named_modules():
            own = [(p_name, p) for p_name, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            where = f"{name or '<root>'} ({type(module).__name__}): "
            if module is self.embedding_module and _is_plain(module, nn.Embedding):
                problem = _embedding_problem(module)
                if problem is None:
                    self.embedding = EmbeddingHandler(name, module.weight, module.padding_idx, tied=False)
                    continue
                problems.append(where + problem)
            elif _is_plain(module, nn.Linear):
                tied = module.weight is embedding_weight and module.weight.requires_grad
                self.hooked.append((module, LinearHandler(name, module.weight, module.bias, tied=tied)))
            elif type(module).__name__ in RMS_NORM_CLASSES and [p_name for p_name, _ in own] == ["weight"]:
                epsilon = float(module.variance_epsilon)
                self.hooked.append((module, RMSNormHandler(name, module.weight, epsilon)))
            else:
                problems.extend(f"{where}parameter {name}.{p_name}" for p_name, _ in own)
        if problems:
            raise UnsupportedParameterError.listing(problems)
        tied = any(handler.tied for _, handler in self.hooked if isinstance(handler, LinearHandler))
        if self.embedding is not None:
            self.embedding.tied = tied

    def _recomputed_modules(self) -> set[int]:
        """ids of the modules whose forward the backward recomputes (inside a checkpointed layer)."""
        return _recomputed_modules(self.model)

    def __enter__(self) -> PackedGradHooks:
        recomputed = self._recomputed_modules()
        for module, handler in self.hooked:
            handler.recomputed = id(module) in recomputed
        try:
            for param in self.params:
                self._saved_flags.append((param, param.requires_grad))
                param.requires_grad_(False)
            for module, handler in self.hooked:
                self._handles.append(module.register_forward_hook(handler.forward_hook))
                if self.autocast_dtype is not None and isinstance(handler, LinearHandler):
                    self._handles.append(module.register_forward_pre_hook(handler.forward_pre_hook))
                if handler.recomputed:  # after the cast pre-hook: it sees the input the layer computes on
                    self._handles.append(module.register_forward_pre_hook(handler.recompute_input_hook))
            self._cast_linear_weights()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._restore()

    def _cast_linear_weights(self) -> None:
        """Under autocast, give every hooked `nn.Linear` a compute-dtype copy of its weight for the pass.

        Autocast casts a weight at every use, and caches the cast only for parameters that require
        grad — which these do not here (the handlers build the weight gradients). So each forward cast
        every linear weight again (~0.4 GB of copies per micro-batch for a 135M model). One cast per
        step instead: the same rounding, hence the same forward and gradient; the handlers keep the
        fp32 master parameters (`handler.weight`), which the gradients go to."""
        if self.autocast_dtype is None:
            return
        for module, handler in self.hooked:
            master = module._parameters.get("weight")
            if (isinstance(handler, LinearHandler) and master is not None
                    and master.dtype != self.autocast_dtype):
                module._parameters["weight"] = nn.Parameter(master.detach().to(self.autocast_dtype),
                                                            requires_grad=False)
                self._masters.append((module, master))

    def _restore(self) -> None:
        for module, master in self._masters:  # the fp32 masters back (a tied lm_head re-tied)
            module._parameters["weight"] = master
        self._masters = []
        for handle in self._handles:
            handle.remove()
        for param, flag in self._saved_flags:
            param.requires_grad_(flag)
        self._handles, self._saved_flags = [], []
        self._bind(None)

    def _bind(self, state: MicroBatchState | None) -> None:
        for _, handler in self.hooked:
            handler.bind(state)
        if self.embedding is not None:
            self.embedding.bind(state)

    def backward(self, state: MicroBatchState,
                 after_forward: Callable[[Tensor], None] | None = None) -> None:
        """Forward + one backward of `Σ_j ℓ_j` for `state.batch`; fills `state.sq_norms`.

        Saved inputs and output gradients stay alive until the next `backward` or exit, for
        `apply`. A micro-batch without targets has `g_j = 0` and runs no model at all.
        `after_forward(log_probs)` (detached, (K,) as `packed_target_logprobs`) runs between the
        forward and the backward — where coefficients that need this forward's log-probs are set.
        """
        self._bind(state)
        batch = state.batch
        if batch.target_positions.numel() == 0:
            return
        chunks = head_chunk_plan(self.model, batch, self.logits_chunk_mib)
        head = self._head_handler() if chunks is not None else None
        with torch.enable_grad():
            embedded = self._graph_start(batch)
            with autocast(self.device, self.autocast_dtype):
                logprobs = packed_target_logprobs(self.model, batch, inputs_embeds=embedded,
                                                  temperature=self.temperature, chunks=chunks,
                                                  head_grad=None if head is None else head.on_chunk)
            if after_forward is not None:
                after_forward(logprobs.detach())
            loss = (logprobs * batch.target_weights[batch.target_positions]).sum()
            loss.backward()
        if head is not None:
            head.finish_chunks()
        stuck = [handler.name for _, handler in self.hooked if handler.pending]
        if stuck:
            raise RuntimeError(f"{', '.join(stuck)}: the output gradient arrived but the checkpointed layer "
                               "was never recomputed; use accumulate_opob_grad_per_trajectory for this model")
        self._after_backward(state)
        if self.embedding is not None and embedded is not None and embedded.grad is not None:
            self.embedding.on_backward(embedded.grad)

    def _graph_start(self, batch: PackedMicroBatch) -> Tensor | None:
        """Where the pass's autograd graph starts: the embedding's output for `batch`, detached, requiring
        grad (so no weight gradient is computed by autograd). None: the model starts from `input_ids`
        (a model part without the embedding — a later pipeline stage)."""
        return self.embedding_module(batch.input_ids).detach().requires_grad_(True)

    def _after_backward(self, state: MicroBatchState) -> None:
        """Between the backward and the embedding's handler: where a split model brings the embedding what
        another part of it computed (nothing on one process)."""

    def _head_handler(self) -> LinearHandler | None:
        """The handler of the chunked output head's weight (`chunkable_head`: the model's own or HF's plain
        head; None when the head is frozen or not hooked here)."""
        head = chunkable_head(self.model)
        return next((handler for module, handler in self.hooked if module is head), None)

    def apply(self, plan: ApplyPlan) -> None:
        """Add the deferred coefficient-weighted gradients of the last `backward` (see `ApplyPlan`)."""
        for _, handler in self.hooked:
            handler.apply_deferred(plan)
        if self.embedding is not None:
            self.embedding.apply(plan)
        self._bind(None)

    @property
    def vocab_size(self) -> int:
        return self.embedding_module.num_embeddings

    @property
    def device(self) -> torch.device:
        """The model's device (where micro-batches and coefficients must live)."""
        return self.embedding_module.weight.device
