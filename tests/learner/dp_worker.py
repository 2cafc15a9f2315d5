"""torchrun worker of tests/learner/distributed/test_data_parallel.py: one torch-learner
step per objective as a
data-parallel replica (gloo, CPU) on the parity batch of tests/learner/megatron_parity.py. Each rank
saves to OUT.RANK: per objective, the step's metrics, the weights after the step and its own
(partial) ‖∇ℓ_i‖² for VCPO.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/learner/dp_worker.py OUT
"""

from __future__ import annotations

import sys

import torch

from learner.backends.torch_learner import TorchLearner
from learner.distributed.data_parallel import join_data_parallel_from_env
from learner.forward.varlen_attention import register_varlen_sdpa
from tests.learner import megatron_parity
from tests.learner.conftest import tiny_model

KIND = "llama_tied"
ALGOS = {
    **megatron_parity.ALGOS,
    "otb_kl": {"objective": {"type": "otb"}, "group_size": 3, "kl_coef": 0.1},
}
"""GRPO (group mean and σ), VCPO (per-trajectory norms, OPOB, ESS step size), and OTB with a KL term
(the Σπ² statistics and the reference model's log-probs are shared across ranks too)."""


def learner(name: str, data_parallel: object) -> TorchLearner:
    from configs.schema import AlgoConfig

    model = tiny_model(KIND, attn_implementation=register_varlen_sdpa()).train()
    return TorchLearner(model, AlgoConfig.model_validate(ALGOS[name]), megatron_parity.OPTIM,
                        micro_batch_tokens=megatron_parity.MICRO_BATCH_TOKENS,
                        data_parallel=data_parallel)  # type: ignore[arg-type]


def main(out: str) -> None:
    torch.set_num_threads(1)
    data_parallel = join_data_parallel_from_env(torch.device("cpu"))
    assert data_parallel is not None and data_parallel.world_size == 2
    batch = megatron_parity.parity_batch(KIND)
    results = {}
    for name in ALGOS:
        record = megatron_parity.run_step(learner(name, data_parallel), batch)
        results[name] = {"metrics": record.metrics, "weights": record.weights, "sq_norms": record.sq_norms}
    torch.save(results, f"{out}.{data_parallel.rank}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
