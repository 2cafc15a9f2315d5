"""Megatron-core GPT models built from HF Llama/Qwen2 checkpoints, called the way the learner calls HF.

`load_megatron_gpt` builds this rank's shard of a `GPTModel` from an HF directory's config and loads
its weights through mbridge (pure-Python name and layout tables; tensor-parallel rank 0 reads the
safetensors and scatters the shards). `MegatronCausalLM` presents the one call `learner/forward/logprobs.py`
makes of an HF model,

    model(input_ids=(1, N), position_ids=(1, N), use_cache=False, logits_to_keep=(K,) positions).logits
        -> (1, K, V)

(or `inputs_embeds=(1, N, H)` word embeddings for `input_ids`, where VCPO's fast norm path starts its
graph), so the torch learner's step runs on it unchanged:

* packed trajectories (position_ids restart at 0 at each one) stay apart: with megatron's local layers
  through a block-diagonal causal mask and RoPE at each trajectory's own positions (exactly HF's
  numbers); with TransformerEngine through `thd` `PackedSeqParams` (cu_seqlens, no mask);
* only the K target positions reach the vocabulary-parallel output layer; their (K, V/TP) logits are
  all-gathered over the TP ranks (the backward hands each rank its vocabulary shard's gradient);
* with pipeline parallelism (PP > 1) each stage holds a contiguous slice of the layers (the first the
  embedding, the last the final norm and output layer). The call runs the stages in turn — the hidden
  states go to the next stage by point-to-point send, the last stage broadcasts the (K, V) logits to the
  whole pipeline group — so every rank returns the same logits, and the learner's step runs unchanged
  on every rank. The backward runs in reverse through autograd functions that receive the gradient of a
  stage's output from the next stage and send the gradient of its input to the previous one. One
  trajectory batch at a time, no micro-batch interleaving: PP here splits the model's memory, with a
  (PP − 1)/PP bubble, not a 1F1B schedule;
* with context parallelism (CP > 1, local layers) each CP rank runs a contiguous chunk of the row's
  tokens; attention gathers the keys and values of the whole row
  (learner/backends/megatron/context_parallel.py)
  and the chunks' target logits are gathered to every CP rank.

`export_hf_weights` yields (HF name, full tensor) with the TP shards gathered and the PP stages'
weights broadcast — what engines load.

Collective calls: the load, the export and (with TP, PP or CP > 1) every forward must be made by all
model-parallel and context-parallel ranks in the same order (and, with PP or CP > 1, every backward
of its outputs). megatron's parallel state must be initialised first
(`learner.backends.megatron.learner.init_model_parallel`).
Not here: context parallelism with TransformerEngine
layers, virtual pipeline stages, MoE, RoPE scaling, vocabularies that TP does not divide, layer counts
that PP does not divide. megatron-core and mbridge are imported lazily, inside functions, so the
project imports without them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from configs.schema import MegatronConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
"""HF `model_type`s with an mbridge table and a megatron layout that matches the HF computation."""

_LOCAL_SPEC_NAMES = {
    # mbridge's tables name the TransformerEngine layout, where the two RMSNorm weights are fused into
    # linear_qkv / linear_fc1; megatron's local layers keep them as modules of their own.
    "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"],
    "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
}


@dataclass(frozen=True)
class MegatronGPT:
    """This rank's GPTModel and the mbridge bridge that maps its weights to and from HF names."""

    gpt: nn.Module
    bridge: Any
    hf_config: Any
    uses_transformer_engine: bool


@dataclass(frozen=True)
class CausalLMOutput:
    """The part of an HF `CausalLMOutput` the learner reads."""

    logits: Tensor
    """(1, K, V) logits at the requested positions, the whole vocabulary on every TP rank."""


def _rope_theta(hf_config: Any) -> float:
    """RoPE base of an HF config (transformers ≥5 keeps it in `rope_parameters`); plain RoPE only."""
    parameters = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = parameters.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"the megatron learner supports plain RoPE only, but the checkpoint uses "
                         f"rope_type={rope_type!r}; use learner.backend='torch' for this model")
    theta = parameters.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return float(theta if theta is not None else 10000.0)


def _check_checkpoint(hf_config: Any, tensor_parallel: int, pipeline_parallel: int) -> None:
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"learner.backend='megatron' supports HF model types {SUPPORTED_MODEL_TYPES}, not "
                         f"{hf_config.model_type!r}; use learner.backend='torch' for this model")
    if hf_config.vocab_size % tensor_parallel:
        raise ValueError(f"vocab_size={hf_config.vocab_size} is not divisible by "
                         f"learner.megatron.tensor_model_parallel_size={tensor_parallel}; pick a size that "
                         "divides it")
    if hf_config.num_hidden_layers % pipeline_parallel:
        raise ValueError(f"num_hidden_layers={hf_config.num_hidden_layers} is not divisible by "
                         f"learner.megatron.pipeline_model_parallel_size={pipeline_parallel}; pick a size "
                         "that divides it (every stage holds the same number of layers)")


def load_megatron_gpt(hf_dir: str | Path, megatron: MegatronConfig, dtype: torch.dtype,
                      device: torch.device) -> MegatronGPT:
    """This rank's GPTModel for the HF checkpoint at `hf_dir`, its weights loaded, on `device` in `dtype`.

    Dropout is off (log-probs must be deterministic) and the fused kernels are off (they need
    TransformerEngine/Apex). Parameters are created (and randomly initialised: megatron marks the
    tensor-parallel ones only on that path) directly on the GPU, or on the CPU for a CPU device; the load
    then overwrites them.
    """
    from mbridge import AutoBridge
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf_dir)
    _check_checkpoint(hf_config, parallel_state.get_tensor_model_parallel_world_size(),
                      parallel_state.get_pipeline_model_parallel_world_size())
    uses_te = megatron.transformer_impl == "transformer_engine"
    bridge = AutoBridge.from_config(hf_config, dtype=dtype)
    bridge.set_extra_args(
        sequence_parallel=megatron.sequence_parallel, use_cpu_initialization=device.type == "cpu",
        attention_dropout=0.0, hidden_dropout=0.0,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        **recompute_args(megatron))
    if uses_te:
        layer_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        layer_spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
        if parallel_state.get_context_parallel_world_size() > 1:
            from learner.backends.megatron.context_parallel import context_parallel_layer_spec

            layer_spec = context_parallel_layer_spec(layer_spec)
        bridge._OTHER_MAPPING = {**bridge._OTHER_MAPPING,
                                 "input_layernorm.weight": _LOCAL_SPEC_NAMES["input_layernorm.weight"]}
        bridge._MLP_MAPPING = {"pre_mlp_layernorm.weight": _LOCAL_SPEC_NAMES["pre_mlp_layernorm.weight"],
                               **bridge._MLP_MAPPING}
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    # A tied checkpoint has no lm_head.weight: the last stage's copy of the embedding (PP > 1) loads
    # embed_tokens. Set on the instance — mbridge's Qwen2 bridge writes this into the class-wide table,
    # which would then also apply to a later untied checkpoint in the same process.
    output_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    bridge._DIRECT_MAPPING = {**bridge._DIRECT_MAPPING, "output_layer.weight": output_name}
    gpt = GPTModel(config=bridge.config, transformer_layer_spec=layer_spec, vocab_size=hf_config.vocab_size,
                   max_sequence_length=hf_config.max_position_embeddings, position_embedding_type="rope",
                   rotary_base=_rope_theta(hf_config), share_embeddings_and_output_weights=tied,
                   pre_process=parallel_state.is_pipeline_first_stage(),
                   post_process=parallel_state.is_pipeline_last_stage())
    gpt.to(device)
    bridge.load_weights([gpt], str(hf_dir))
    return MegatronGPT(gpt, bridge, hf_config, uses_te)


def recompute_args(megatron: MegatronConfig) -> dict[str, Any]:
    """megatron's `TransformerConfig` fields for `MegatronConfig`'s activation recompute ('selective': the
    core attention alone, megatron's default `recompute_modules`)."""
    if megatron.recompute_granularity is None:
        return {}
    if megatron.recompute_granularity == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    return {"recompute_granularity": "full", "recompute_method": megatron.recompute_method,
            "recompute_num_layers": megatron.recompute_num_layers}


def export_hf_weights(model: MegatronGPT) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) of every weight, TP shards all-gathered and PP stages broadcast to every
    rank (collective; views where TP = PP = 1). A tied checkpoint's output layer — the last stage's copy
    of the embedding when PP > 1 — is not exported: HF ties `lm_head` to `embed_tokens`."""
    exported = model.bridge.export_weights([model.gpt])
    tied = bool(getattr(model.hf_config, "tie_word_embeddings", False))
    seen = set()
    while True:
        # no_grad around each resumption only (a `with` around `yield` would leak into the caller):
        # mbridge broadcasts the parameters themselves, which autograd would otherwise record
        with torch.no_grad():
            item = next(exported, None)
        if item is None:
            return
        name = item[0]
        if not (tied and (name == "lm_head.weight" or name in seen)):  # the output layer's copy, after
            seen.add(name)                                             # the embedding (stage order)
            yield name, item[1].detach()


def packed_causal_mask(position_ids: Tensor) -> Tensor:
    """(1, 1, N, N) bool, True where attention is masked: token t sees tokens s ≤ t of its own
    trajectory only. `position_ids`: (1, N), restarting at 0 where a trajectory starts."""
    segments = torch.cumsum(position_ids[0] == 0, dim=0)
    same = segments[:, None] == segments[None, :]
    causal = torch.ones_like(same).tril_()
    return ~(same & causal)[None, None]


def packed_seq_params(position_ids: Tensor) -> Any:
    """megatron `PackedSeqParams` in `thd` layout for the trajectories packed in `position_ids` (1, N)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    starts = torch.nonzero(position_ids[0] == 0).flatten()
    ends = torch.cat([starts[1:], starts.new_tensor([position_ids.shape[1]])])
    lengths = ends - starts
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=position_ids.device)
    cu_seqlens[1:] = torch.cumsum(lengths, dim=0)
    longest = int(lengths.max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


class MegatronCausalLM(nn.Module):
    """A megatron GPTModel behind the HF causal-LM call of `learner/forward/logprobs.py` (module docstring).

    Runs the GPT's own submodules (embedding, decoder, output weight) rather than `GPTModel.forward`,
    which would compute (N, V) logits for every position and apply RoPE at packed offsets.
    """

    is_packing_aware = True
    """Packed trajectories never attend to each other (mask or cu_seqlens); see `check_packing_aware`."""

    def __init__(self, model: MegatronGPT) -> None:
        super().__init__()
        self.gpt = model.gpt
        self.uses_transformer_engine = model.uses_transformer_engine
        self.padding_idx: int | None = getattr(model.hf_config, "pad_token_id", None)
        """HF's Llama/Qwen2 embedding never updates the pad token's row from its lookups (nn.Embedding
        padding_idx); the same here, so both backends train the same model."""
        self.output_projection = OutputProjection(self._output_weight)
        """The (K, H) → (K, V/TP) product with the output weight, as a module so per-trajectory gradient
        hooks see its input and output gradient (it owns no parameter)."""

    def get_input_embeddings(self) -> nn.Module | None:
        """The word embedding (HF's accessor): a `VocabParallelEmbedding` on the first pipeline stage, None on
        the others (they hold none)."""
        return self.gpt.embedding.word_embeddings if self.gpt.pre_process else None

    def forward(self, input_ids: Tensor | None = None, position_ids: Tensor | None = None,
                use_cache: bool = False, logits_to_keep: Tensor | None = None,
                inputs_embeds: Tensor | None = None) -> CausalLMOutput:
        """`input_ids`, `position_ids`: (1, N) one packed row; `logits_to_keep`: (K,) long positions
        (None: all N). `use_cache` must be False (training has no KV cache). `inputs_embeds`: (1, N, H) word
        embeddings of the row to start from instead of `input_ids` (the per-trajectory gradient hooks start
        the graph there) — on the first pipeline stage only, no sequence parallelism."""
        if (inputs_embeds is None) == (input_ids is None) or position_ids is None:
            raise ValueError("MegatronCausalLM takes position_ids and one of input_ids or inputs_embeds")
        rows = inputs_embeds if input_ids is None else input_ids
        if rows.shape[0] != 1 or use_cache:
            raise ValueError("MegatronCausalLM takes one packed row (1, N) and use_cache=False")
        length = rows.shape[1]
        positions = (logits_to_keep if logits_to_keep is not None
                     else torch.arange(length, device=rows.device))
        if not isinstance(positions, Tensor):
            raise TypeError("logits_to_keep must be a tensor of positions (an int 'last k' is not supported)")
        hidden = self._decode(input_ids, position_ids, inputs_embeds)
        if not self.gpt.post_process:  # (N, 1, H) [N/TP with SP, N/CP with CP] for the next stage
            shape = (positions.numel(), self.gpt.vocab_size)
            return CausalLMOutput(_SendToNextStage.apply(hidden, shape).unsqueeze(0))
        if self.gpt.config.context_parallel_size > 1:
            logits = self._context_parallel_logits(hidden, positions, length)
        else:
            logits = self._logits(hidden[positions, 0])  # hidden: (N, 1, H), the whole row on every TP rank
        if self.gpt.config.pipeline_model_parallel_size > 1:
            _broadcast_from_last_stage(logits.detach())
        return CausalLMOutput(logits.unsqueeze(0))

    def chunkable_head(self) -> nn.Module | None:
        """The output product, which the learner may run in chunks of target rows (`logits_chunk_mib`;
        learner/forward/chunked_head.py) where this rank holds the whole vocabulary and the whole row
        (TP = PP = CP = 1); None elsewhere (the logits are all-gathered over TP, broadcast from the last
        stage, gathered over CP)."""
        config = self.gpt.config
        split = (config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
                 config.context_parallel_size)
        return self.output_projection if split == (1, 1, 1) else None

    def target_hidden(self, input_ids: Tensor | None = None, position_ids: Tensor | None = None,
                      use_cache: bool = False, logits_to_keep: Tensor | None = None,
                      inputs_embeds: Tensor | None = None) -> Tensor:
        """(K, H) final hidden states at `logits_to_keep`: what `chunkable_head` reads (arguments as
        `forward`'s; one stage, the whole row)."""
        if self.chunkable_head() is None or logits_to_keep is None or position_ids is None or use_cache:
            raise ValueError("target_hidden needs TP = PP = CP = 1, position_ids and logits_to_keep")
        return self._decode(input_ids, position_ids, inputs_embeds)[logits_to_keep, 0]

    def _output_weight(self) -> Tensor:
        gpt = self.gpt
        return (gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights
                else gpt.output_layer.weight)

    def _context_parallel_logits(self, hidden: Tensor, positions: Tensor, length: int) -> Tensor:
        """(K, V) logits at `positions` of the row from this CP rank's chunk of final hidden states
        (N/CP, 1, H): each rank computes its chunk's targets, all ranks get all of them, in order."""
        from learner.backends.megatron.context_parallel import context_chunk, gather_rows_over_context

        padded, start, end = context_chunk(length)
        size = end - start
        chunk_of = torch.div(positions, size, rounding_mode="floor")
        order = torch.argsort(chunk_of, stable=True)  # rank order, each chunk's targets in their order
        counts = tuple(int(n) for n in torch.bincount(chunk_of, minlength=padded // size))
        mine = positions[order][chunk_of[order] == start // size] - start
        gathered = gather_rows_over_context(self._logits(hidden[mine, 0]), counts)
        return gathered[torch.argsort(order)]

    def _anchor(self) -> Tensor:
        """A parameter of this stage: the input of the pipeline's autograd functions, so that autograd —
        `torch.autograd.grad` over the parameters included — runs their backward (which communicates) on
        every stage. They give it no gradient. With every parameter frozen (the fast norm path's pass, whose
        hooks build the weight gradients) a scalar leaf that requires grad plays that part."""
        trainable = next((p for p in self.gpt.parameters() if p.requires_grad), None)
        if trainable is not None:
            return trainable
        return torch.zeros((), device=next(self.gpt.parameters()).device, requires_grad=True)

    def _decode(self, input_ids: Tensor | None, position_ids: Tensor, inputs_embeds: Tensor | None = None
                ) -> Tensor:
        """This stage's decoder output: the final hidden states (N, 1, H) on the last stage, the hidden
        states for the next stage (N, 1, H) [N/TP with SP] on the others. With context parallelism, the
        same for this CP rank's chunk of the row (N/CP rows, the row padded to a multiple of CP).
        `inputs_embeds` (1, N, H), the word embeddings of the whole row, in place of `input_ids` on the first
        stage: what megatron's embedding does after its lookup follows (to (N, 1, H); no position embedding
        with RoPE, no dropout here); its pad token's rows get their zero gradient from whoever built it."""
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        gpt, config = self.gpt, self.gpt.config
        if inputs_embeds is not None and (not gpt.pre_process or config.sequence_parallel):
            raise ValueError("inputs_embeds needs the first pipeline stage (it holds the embedding; the "
                             "others take input_ids) and no sequence parallelism")
        length = position_ids.shape[1]
        # the sequence is split over TP ranks (SP) or CP ranks: pad it with a dummy trajectory
        split = (config.tensor_model_parallel_size if config.sequence_parallel
                 else config.context_parallel_size)
        if split > 1:
            pad = -length % split
            if inputs_embeds is None:
                input_ids = F.pad(input_ids, (0, pad))
            else:
                inputs_embeds = F.pad(inputs_embeds, (0, 0, 0, pad))
            dummy_positions = torch.arange(pad, device=position_ids.device)[None]
            position_ids = torch.cat([position_ids, dummy_positions], dim=1)
        if config.context_parallel_size > 1:  # this rank's chunk, attending to the whole row (gathered K/V)
            from learner.backends.megatron.context_parallel import chunk_causal_mask, context_chunk

            _, start, end = context_chunk(length)
            mask: Tensor | None = chunk_causal_mask(position_ids, start, end)
            position_ids = position_ids[:, start:end]
            if inputs_embeds is None:
                input_ids = input_ids[:, start:end]
            else:
                inputs_embeds = inputs_embeds[:, start:end]
        else:
            mask = None if self.uses_transformer_engine else packed_causal_mask(position_ids)
        if inputs_embeds is not None:
            hidden = inputs_embeds.transpose(0, 1).contiguous()
            if config.fp32_residual_connection:
                hidden = hidden.float()
        elif gpt.pre_process:
            hidden = self._embed(input_ids, position_ids)  # (N, 1, H) [N/TP with SP]
        else:
            shards = config.tensor_model_parallel_size if config.sequence_parallel else 1
            shape = (position_ids.shape[1] // shards, 1, config.hidden_size)
            received = _ReceiveFromPreviousStage.apply(self._anchor(), shape, config.params_dtype)
            gpt.decoder.set_input_tensor(received)
            hidden = None  # the decoder reads its input tensor
        hidden = self._run_decoder(hidden, position_ids, mask)
        if not gpt.post_process or config.context_parallel_size > 1:
            return hidden
        if config.sequence_parallel:
            # every TP rank then holds the same full sequence and gets the same gradient: the backward
            # keeps this rank's slice (no reduction)
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return hidden[:length]

    def _embed(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """The embedding lookup, with no gradient into the pad token's row (HF's padding_idx)."""
        from megatron.core import parallel_state

        hidden = self.gpt.embedding(input_ids=input_ids, position_ids=position_ids)
        if self.padding_idx is None:
            return hidden
        is_pad = input_ids[0] == self.padding_idx
        if self.gpt.config.sequence_parallel:  # this rank holds one contiguous slice of the sequence
            rank = parallel_state.get_tensor_model_parallel_rank()
            is_pad = is_pad.view(self.gpt.config.tensor_model_parallel_size, -1)[rank]
        return torch.where(is_pad[:, None, None], hidden.detach(), hidden)

    def _run_decoder(self, hidden: Tensor | None, position_ids: Tensor, mask: Tensor | None) -> Tensor:
        """This stage's layers on `hidden` (None: the input tensor received from the previous stage)."""
        gpt = self.gpt
        if self.uses_transformer_engine:
            params = packed_seq_params(position_ids)
            rotary = gpt.rotary_pos_emb(params.max_seqlen_q, packed_seq=True)  # applied per cu_seqlens
            return gpt.decoder(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rotary,
                               packed_seq_params=params)
        # RoPE at each token's own position: (N, 1, 1, D) rows of the (max position + 1) table
        # (packed_seq: the whole table, which megatron would otherwise cut for its own CP layout)
        rotary = gpt.rotary_pos_emb(int(position_ids.max()) + 1, packed_seq=True)[position_ids[0]]
        return gpt.decoder(hidden_states=hidden, attention_mask=mask, rotary_pos_emb=rotary)

    def _logits(self, hidden: Tensor) -> Tensor:
        """(K, H) final hidden states → (K, V) logits: this rank's vocabulary shard, all-gathered."""
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_tensor_model_parallel_region,
        )

        # copy: identity forward, all-reduce of the (K, H) gradient backward (each rank's vocab shard
        # contributes part of it)
        local = self.output_projection(copy_to_tensor_model_parallel_region(hidden), self._output_weight())
        return gather_from_tensor_model_parallel_region(local)


class OutputProjection(nn.Module):
    """`F.linear(hidden, weight)` with the output weight passed in: the output layer's own weight, or the
    embedding's when they are tied — no parameter of its own. `weight` reads it (what a chunked head
    multiplies by)."""

    def __init__(self, output_weight: Callable[[], Tensor]) -> None:
        super().__init__()
        self._output_weight = output_weight

    @property
    def weight(self) -> Tensor:
        return self._output_weight()

    def forward(self, hidden: Tensor, weight: Tensor) -> Tensor:
        return F.linear(hidden, weight)


# --- pipeline stages: point-to-point activations and gradients, logits broadcast -----------------------


def _broadcast_from_last_stage(tensor: Tensor) -> None:
    """Broadcast `tensor` (in place on the receivers) from the last pipeline stage to the whole pipeline
    group of this rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())


class _ReceiveFromPreviousStage(torch.autograd.Function):
    """Forward: the previous stage's output hidden states (received). Backward: sends their gradient
    back to it. `anchor` (a parameter of this stage, given no gradient) only ties the function into
    autograd's graph."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        import torch.distributed as dist
        from megatron.core import parallel_state

        received = torch.empty(shape, dtype=dtype, device=anchor.device)
        dist.recv(received, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        return received

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:
        import torch.distributed as dist
        from megatron.core import parallel_state

        dist.send(grad.contiguous(), dst=parallel_state.get_pipeline_model_parallel_prev_rank())
        return None, None, None


class _SendToNextStage(torch.autograd.Function):
    """Forward (every stage but the last): sends this stage's output hidden states to the next stage and
    returns the (K, V) logits the last stage broadcasts. Backward: the gradient of the sent hidden states,
    received from the next stage (the logits' gradient here is this rank's copy of the last stage's, which
    that stage applies)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, logits_shape: tuple[int, int]) -> Tensor:
        import torch.distributed as dist
        from megatron.core import parallel_state

        dist.send(hidden.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
        logits = torch.empty(logits_shape, dtype=hidden.dtype, device=hidden.device)
        _broadcast_from_last_stage(logits)
        ctx.hidden_shape, ctx.hidden_dtype = hidden.shape, hidden.dtype
        return logits

    @staticmethod
    def backward(ctx: Any, grad_logits: Tensor) -> tuple[Tensor, None]:
        import torch.distributed as dist
        from megatron.core import parallel_state

        grad = torch.empty(ctx.hidden_shape, dtype=ctx.hidden_dtype, device=grad_logits.device)
        dist.recv(grad, src=parallel_state.get_pipeline_model_parallel_next_rank())
        return grad, None
