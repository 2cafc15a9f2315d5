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
    "vcpo_kl": {"objective": {"type": "vcpo", "is_cap": 2.0}, "group_size": 3, "kl_coef": 0.1},
    "reinforce": {"objective": {"type": "reinforce"}, "group_size": 3},
    "dr_grpo_kl": {"objective": {"type": "dr_grpo"}, "group_size": 3, "kl_coef": 0.1},
    "m2po": {"objective": {"type": "m2po", "tau": 0.001}, "group_size": 3},
    "tba": {"objective": {"type": "tba"}, "group_size": 3},
}
"""GRPO (group mean and σ), VCPO (per-trajectory norms, OPOB, ESS step size), OTB (the Σπ² statistics
are shared across ranks too), and the objectives whose loss takes statistics of the whole minibatch
across groups — REINFORCE's mean, Dr. GRPO's constant N, M2PO's mask (τ small enough to mask tokens of
this batch), TBA's trajectory count — which a rank holding some of the groups must take from the whole
minibatch. (BAPO's bounds cannot matter here: this batch's ratios lie inside every candidate bound;
tests/learner/backends/test_torch_learner.py covers them on a noisier batch.) The KL terms (OTB, VCPO's
separate KL pass, Dr. GRPO) use the reference model's log-probs, shared across ranks; `learner` moves the
reference away from the policy so that they have a gradient at the first step."""


def learner(name: str, data_parallel: object, micro_batch_tokens: int = megatron_parity.MICRO_BATCH_TOKENS
            ) -> TorchLearner:
    from configs.schema import AlgoConfig

    model = tiny_model(KIND, attn_implementation=register_varlen_sdpa()).train()
    built = TorchLearner(model, AlgoConfig.model_validate(ALGOS[name]), megatron_parity.OPTIM,
                         micro_batch_tokens=micro_batch_tokens, data_parallel=data_parallel)  # type: ignore[arg-type]
    if built.reference is not None:  # the same move on every rank and in the single process
        generator = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for parameter in built.reference.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return built


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
