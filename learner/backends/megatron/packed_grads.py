"""The fast exact per-trajectory gradient path (learner/traj_grads/) on a megatron GPT.

`PackedGradHooks` finds an HF model's layers by their classes (`nn.Linear`, `nn.Embedding`, HF's RMSNorms);
`MegatronPackedGradHooks` hands the same handlers megatron's: its column- and row-parallel linears (whose
output is `(x Wᵀ [+ b], bias added later)`, the bias's gradient the same either way), the word embedding,
`torch.nn.RMSNorm`, and the output layer's product (`OutputProjection`, whose weight — the output layer's,
or the embedding's when tied — is passed in). With the weights frozen for the pass, megatron's linears run
their frozen-weight path and compute input gradients only, as the hooks need.

With tensor parallelism each rank's handlers see its shards: a column-parallel linear its slice of the
output (`δ`) and the whole input, a row-parallel one its slice of the input and the whole output gradient,
the vocabulary-parallel embedding and output product their rows of the vocabulary — so `G_j` restricted to
the shard is again `δ xᵀ` and the shards' squared norms sum to the whole. The RMSNorm weights, the same on
every TP rank, are counted on rank 0 only. The learner sums the ranks' norms before each baseline.

Not here (`fast_path_problem` says which; the learner then takes the per-trajectory path): pipeline stages,
context parallelism and sequence parallelism (a trajectory's tokens or layers on several ranks), a
row-parallel bias (replicated, added after the reduction), TransformerEngine layers (they fuse the
RMSNorms into the linears). Data parallelism is no obstacle: each replica runs whole groups.
"""

from __future__ import annotations

import torch
from torch import nn

from learner.traj_grads.handlers import EmbeddingHandler, LinearHandler, RMSNormHandler
from learner.traj_grads.hooks import PackedGradHooks, UnsupportedParameterError
from rollout.types import DEFAULT_TEMPERATURE


def fast_path_problem(model: nn.Module) -> str | None:
    """Why the fast path cannot run on this `MegatronCausalLM`'s layout (None: it can)."""
    from megatron.core.tensor_parallel import RowParallelLinear

    config = model.gpt.config
    sizes = {"pipeline_model_parallel_size": config.pipeline_model_parallel_size,
             "context_parallel_size": config.context_parallel_size}
    split = [f"{name}={size}" for name, size in sizes.items() if size > 1]
    if config.sequence_parallel:
        split.append("sequence_parallel=true")
    if split:
        return f"{', '.join(split)} puts a trajectory's layers or tokens on several ranks"
    if model.uses_transformer_engine:
        return ("TransformerEngine layers fuse the RMSNorms into the linears (the fast path needs local "
                "layers)")
    if config.tensor_model_parallel_size > 1 and any(
            isinstance(module, RowParallelLinear) and module.bias is not None and module.bias.requires_grad
            for module in model.modules()):
        return "a row-parallel layer has a bias, replicated over the tensor-parallel ranks"
    return None


class MegatronPackedGradHooks(PackedGradHooks):
    """`PackedGradHooks` on a `MegatronCausalLM` whose layout `fast_path_problem` accepts."""

    def __init__(self, model: nn.Module, autocast_dtype: torch.dtype | None = None,
                 temperature: float = DEFAULT_TEMPERATURE, logits_chunk_mib: float | None = None) -> None:
        problem = fast_path_problem(model)
        if problem is not None:
            raise ValueError(f"the fast per-trajectory gradient path cannot run here: {problem}")
        super().__init__(model, autocast_dtype, temperature, logits_chunk_mib)

    def _scan(self, model: nn.Module) -> None:
        from megatron.core.tensor_parallel import (
            ColumnParallelLinear,
            RowParallelLinear,
            param_is_not_tensor_parallel_duplicate,
        )

        gpt, embedding = model.gpt, self.embedding_module
        tied = bool(gpt.share_embeddings_and_output_weights)
        output_weight = gpt.shared_embedding_or_output_weight() if tied else gpt.output_layer.weight
        vocab = ((embedding.vocab_start_index, embedding.vocab_end_index)
                 if gpt.config.tensor_model_parallel_size > 1 else None)
        problems = []
        for name, module in model.named_modules():
            if module is model.output_projection:
                if output_weight.requires_grad:
                    self.hooked.append((module, LinearHandler(name, output_weight, None, tied=tied,
                                                              vocab_range=vocab)))
                continue
            own = [(p_name, p) for p_name, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own or module is gpt.output_layer:  # its weight reaches the logits through the projection
                continue
            names = [p_name for p_name, _ in own]
            if module is embedding and names == ["weight"]:
                self.embedding = EmbeddingHandler(name, module.weight, model.padding_idx, tied=tied,
                                                  vocab_range=vocab)
            elif isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                self.hooked.append((module, LinearHandler(name, module.weight, module.bias, tied=False)))
            elif isinstance(module, nn.RMSNorm) and names == ["weight"]:
                counted = param_is_not_tensor_parallel_duplicate(module.weight)
                self.hooked.append((module, RMSNormHandler(name, module.weight, module.eps, counted=counted)))
            else:
                problems.extend(f"{name} ({type(module).__name__}): parameter {p_name}" for p_name in names)
        if problems:
            raise UnsupportedParameterError.listing(problems)
