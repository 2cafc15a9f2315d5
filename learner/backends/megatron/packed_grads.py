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

With pipeline stages every stage hooks its own layers and the pass runs the stages in turn as any forward
and backward does (learner/backends/megatron/model.py): the first stage starts the graph at its
embedding's output, the others at the hidden states they receive (anchored on a leaf of their own, every
parameter being frozen for the pass). A trajectory's squared norm is the sum of its stages' — but for a
tied embedding, whose two copies (the first stage's lookup, the last stage's output layer) are one
weight: `‖E_j + G_j‖² = ‖E_j‖² + ‖G_j‖² + 2⟨E_j, G_j⟩`, so the last stage sends the first its rows of
`G_j` at the trajectory's input tokens (what the cross term reads; a (unique tokens, H) fp32 tensor).

Activation recompute ('full', megatron's reentrant checkpoint of whole layers): the modules of the
checkpointed layers take their input when the backward recomputes them (`PackedGradHooks`), which
happens once per layer however the layers are chunked; 'selective' recomputes the core attention alone,
which owns no parameter.

With context parallelism each CP rank's hooks see its chunk of the row (and the target positions in it);
a trajectory that crosses a chunk boundary has a partial gradient on each rank, summed over the CP ranks
before its norm is taken (learner/traj_grads/split_rows.py). The learner sums the ranks' norms over CP too.

Not here (`fast_path_problem` says which; the learner then takes the per-trajectory path): sequence
parallelism (which needs TransformerEngine layers here), a row-parallel bias (replicated, added after the
reduction), TransformerEngine layers (they fuse the RMSNorms into the linears). Data parallelism is no
obstacle: each replica runs whole groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from learner.forward.packing import PackedMicroBatch
from learner.traj_grads.handlers import EmbeddingHandler, LinearHandler, MicroBatchState, RMSNormHandler
from learner.traj_grads.hooks import PackedGradHooks, UnsupportedParameterError
from rollout.types import DEFAULT_TEMPERATURE


def fast_path_problem(model: nn.Module) -> str | None:
    """Why the fast path cannot run on this `MegatronCausalLM`'s layout (None: it can)."""
    from megatron.core.tensor_parallel import RowParallelLinear

    config = model.gpt.config
    if config.sequence_parallel:
        return ("sequence_parallel=true shards the activations between the layers over the tensor-parallel "
                "ranks, and needs TransformerEngine layers here")
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
        gpt = model.gpt
        shared = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        self._pipelined_tie = (gpt.config.pipeline_model_parallel_size > 1 and shared is not None
                               and shared.requires_grad)
        """A tied embedding whose copies sit on the first and the last stage (module docstring)."""

    def _scan(self, model: nn.Module) -> None:
        from megatron.core.tensor_parallel import (
            ColumnParallelLinear,
            RowParallelLinear,
            param_is_not_tensor_parallel_duplicate,
        )

        gpt, embedding = model.gpt, self.embedding_module
        tied = bool(gpt.share_embeddings_and_output_weights)
        output_weight = None  # the output product runs on the last stage only
        if gpt.post_process:
            output_weight = gpt.shared_embedding_or_output_weight() if tied else gpt.output_layer.weight
        vocab = _vocab_range(gpt)
        problems = []
        for name, module in model.named_modules():
            if module is model.output_projection:
                if output_weight is not None and output_weight.requires_grad:
                    head = LinearHandler(name, output_weight, None, tied=tied, vocab_range=vocab)
                    head.reads_targets = True
                    self.hooked.append((module, head))
                continue
            own = [(p_name, p) for p_name, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not own or module is getattr(gpt, "output_layer", None):  # read through the projection
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

    def _recomputed_modules(self) -> set[int]:
        """The modules of the layers megatron checkpoints ('full' recompute, in training mode — as
        `TransformerBlock` decides): every layer ('uniform'), or the first `recompute_num_layers` of this
        stage ('block'). The final norm is never inside."""
        decoder = self.model.gpt.decoder
        config = decoder.config
        if config.recompute_granularity != "full" or not decoder.training:
            return set()
        layers = list(decoder.layers)
        if config.recompute_method == "block":
            layers = layers[:config.recompute_num_layers]
        return {id(module) for layer in layers for module in layer.modules()}

    def backward(self, state: MicroBatchState,
                 after_forward: Callable[[Tensor], None] | None = None) -> None:
        """`PackedGradHooks.backward`; with context parallelism on this rank's chunk of the row, the norms of
        the trajectories that cross a chunk boundary summed over the CP ranks (`SplitRows`)."""
        if self.model.gpt.config.context_parallel_size > 1:
            from learner.backends.megatron.context_parallel import split_rows

            state.split = split_rows(state.batch)
        super().backward(state, after_forward)

    def _graph_start(self, batch: PackedMicroBatch) -> Tensor | None:
        """The first stage starts at its embedding's output; a later one from `input_ids` (it receives the
        previous stage's hidden states)."""
        return None if self.embedding_module is None else super()._graph_start(batch)

    def _after_backward(self, state: MicroBatchState) -> None:
        """With a tied embedding split over the pipeline, the last stage sends its output layer's rows of
        every `G_j` at the trajectory's input tokens to the first stage, for the cross term."""
        if not self._pipelined_tie:
            return
        import torch.distributed as dist
        from megatron.core import parallel_state

        gpt = self.model.gpt
        if gpt.post_process:
            assert state.tied_rows is not None, "the tied output layer's handler did not run"
            dist.send(torch.cat(state.tied_rows).contiguous(),
                      dst=parallel_state.get_pipeline_model_parallel_first_rank())
        elif gpt.pre_process:
            rows = torch.empty(len(state.unique_inputs().tokens), gpt.config.hidden_size, dtype=torch.float32,
                               device=self.device)
            dist.recv(rows, src=parallel_state.get_pipeline_model_parallel_last_rank())
            state.tied_rows = [rows]

    @property
    def vocab_size(self) -> int:
        return int(self.model.gpt.vocab_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def _vocab_range(gpt: nn.Module) -> tuple[int, int] | None:
    """This tensor-parallel rank's vocabulary shard `[start, end)` (None: one rank holds it whole)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.utils import VocabUtility

    size = gpt.config.tensor_model_parallel_size
    if size == 1:
        return None
    rank = parallel_state.get_tensor_model_parallel_rank()
    return tuple(VocabUtility.vocab_range_from_global_vocab_size(gpt.vocab_size, rank, size))
