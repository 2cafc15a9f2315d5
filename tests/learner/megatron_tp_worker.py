"""torchrun worker of tests/learner/backends/megatron/test_megatron_learner.py: one megatron
learner step per objective at
tensor parallel size = world size, or with --layout=TP,PP,CP that layout (the rest of the world
data-parallel: --layout=1,1,1 makes world-size replicas), on the CPU (gloo, the test-only CUDA shim).
Rank 0 saves, per objective: the step's metrics, whether VCPO took the fast norm path, VCPO's ‖∇ℓ_i‖²
(summed over the model-parallel ranks)
and every rank's partial sums, the weights after the step (HF names, shards gathered), and per rank:
its embedding (or output layer) shard shape, its layer count, its weights and its ‖∇ℓ_i‖².

    python -m torch.distributed.run --nproc_per_node 2 tests/learner/megatron_tp_worker.py HF_DIR KIND OUT \
        [--cuda-sequence-parallel | --layout=TP,PP,CP] [--recompute=full|selective] [--per-trajectory]

`--recompute`: megatron's activation recompute ('full': every layer, one at a time); `--per-trajectory`:
also VCPO on the per-trajectory norm path ('vcpo_per_trajectory'), the fast path's reference on the same
layout.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist

from configs.schema import MegatronConfig
from tests.learner import megatron_parity
from tests.learner.megatron_cpu import cuda_on_cpu


def _partial_sq_norms(learner: object) -> list[torch.Tensor]:
    """Record the per-rank partial sums handed to `_sum_over_shards` (per group, the (B,) vector, the
    squared gradient norm)."""
    seen: list[torch.Tensor] = []
    reduce = learner._sum_over_shards  # type: ignore[attr-defined]

    def spy(partial: torch.Tensor, *args: object) -> torch.Tensor:
        seen.append(partial.clone())
        return reduce(partial, *args)

    learner._sum_over_shards = spy  # type: ignore[attr-defined]
    return seen


def main(hf_dir: str, kind: str, out: str, *flags: str) -> None:
    """`flags`: '--cuda-sequence-parallel' runs on this rank's GPU (NCCL) with TransformerEngine layers and
    sequence parallelism instead of on the CPU shim."""
    torch.set_num_threads(1)
    on_gpu = "--cuda-sequence-parallel" in flags
    world = int(os.environ["WORLD_SIZE"])  # set by torchrun
    layout = next((flag.removeprefix("--layout=") for flag in flags if flag.startswith("--layout=")),
                  f"{world},1,1")
    tp, pp, cp = (int(size) for size in layout.split(","))  # the rest of the world is data-parallel
    recompute = next((flag.removeprefix("--recompute=") for flag in flags if flag.startswith("--recompute=")),
                     None)
    megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                              context_parallel_size=cp, recompute_granularity=recompute)
    runs = [("grpo", False), ("vcpo", True), ("vcpo_reference", False)]
    if "--per-trajectory" in flags:
        runs.append(("vcpo_per_trajectory", False))
    device = torch.device("cpu")
    if on_gpu:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        megatron = megatron.model_copy(update={"sequence_parallel": True,
                                               "transformer_impl": "transformer_engine"})
    with contextlib.nullcontext() if on_gpu else cuda_on_cpu():
        from learner.backends.megatron.learner import MegatronLearner, init_model_parallel

        init_model_parallel(megatron, backend="nccl" if on_gpu else "gloo")
        from transformers import AutoConfig

        layers = AutoConfig.from_pretrained(hf_dir).num_hidden_layers
        batch = megatron_parity.parity_batch(kind, layers=layers)
        results = {}
        for name, use_distributed_optimizer in runs:
            config = megatron.model_copy(update={"use_distributed_optimizer": use_distributed_optimizer})
            learner = MegatronLearner(hf_dir, megatron_parity.algo(name), megatron_parity.OPTIM, config,
                                      micro_batch_tokens=megatron_parity.MICRO_BATCH_TOKENS, device=device)
            partials = _partial_sq_norms(learner)
            record = megatron_parity.run_step(learner, batch)
            # the first stage's embedding shard (the last stage's output layer; None on a middle stage)
            vocabulary_weight = learner.gpt.gpt.shared_embedding_or_output_weight()
            shard = None if vocabulary_weight is None else tuple(vocabulary_weight.shape)
            gathered: list[object] = [None] * dist.get_world_size()
            vectors = [partial.cpu() for partial in partials if partial.ndim == 1]  # not the grad-norm scalar
            weights = {k: v.cpu() for k, v in record.weights.items()}
            dist.all_gather_object(gathered, {"partial": vectors[-1] if vectors else None, "shard": shard,
                                              "layers": len(learner.gpt.gpt.decoder.layers),
                                              "weights": weights, "sq_norms": _cpu(record.sq_norms)})
            results[name] = {"metrics": record.metrics, "sq_norms": _cpu(record.sq_norms), "weights": weights,
                             "partials": [g["partial"] for g in gathered],
                             "shards": [g["shard"] for g in gathered],
                             "layers": [g["layers"] for g in gathered],
                             "rank_weights": [g["weights"] for g in gathered],
                             "rank_sq_norms": [g["sq_norms"] for g in gathered],
                             "fast_norms": bool(getattr(learner, "fast_norms", False))}
        if dist.get_rank() == 0:
            torch.save(results, out)
        dist.barrier()
        dist.destroy_process_group()


def _cpu(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.cpu()


if __name__ == "__main__":
    main(*sys.argv[1:])
