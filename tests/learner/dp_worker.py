"""torchrun worker of tests/learner/distributed/test_data_parallel.py: one torch-learner
step per objective as a
data-parallel replica (gloo, CPU) on the parity batch of tests/learner/megatron_parity.py. Each rank
saves to OUT.RANK: per objective, the step's metrics, the weights after the step and its own
(partial) ‖∇ℓ_i‖² for VCPO.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/learner/dp_worker.py OUT
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from learner.backends.torch_learner import StepInput, TorchLearner
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
    "vcpo_degenerate": {"objective": {"type": "vcpo"}, "group_size": 3},
    "vcpo_reuse_degenerate": {"objective": {"type": "vcpo"}, "group_size": 3},
    "grpo_corrected": {"objective": {"type": "grpo"}, "group_size": 3,
                       "corrections": [{"type": "token_reject", "lower": 0.95, "upper": 1.05},
                                       {"type": "opsm", "delta": 0.0}, {"type": "token_tis", "cap": 1.02}]},
    "vcpo_corrected": {"objective": {"type": "vcpo", "is_cap": 2.0}, "group_size": 3,
                       "corrections": [{"type": "token_reject", "lower": 0.93, "upper": 1.07}]},
    "vcpo_lora": {"objective": {"type": "vcpo", "is_cap": 2.0}, "group_size": 3},
    "vcpo_kl_lora": {"objective": {"type": "vcpo", "is_cap": 2.0}, "group_size": 3, "kl_coef": 0.1},
}
"""GRPO (group mean and σ), VCPO (per-trajectory norms, OPOB, ESS step size), OTB (the Σπ² statistics
are shared across ranks too), and the objectives whose loss takes statistics of the whole minibatch
across groups — REINFORCE's mean, Dr. GRPO's constant N, M2PO's mask (τ small enough to mask tokens of
this batch), TBA's trajectory count — which a rank holding some of the groups must take from the whole
minibatch. (BAPO's bounds cannot matter here: this batch's ratios lie inside every candidate bound;
tests/learner/backends/test_torch_learner.py covers them on a noisier batch.) The KL terms (OTB, VCPO's
separate KL pass, Dr. GRPO) use the reference model's log-probs, shared across ranks; `learner` moves the
reference away from the policy so that they have a gradient at the first step. The `*_corrected` entries
run correction stages (OPSM needs whole groups): every rank must reject the same tokens and re-pack alike.
The `*_lora` entries train LoRA adapters (`LORA`): every rank draws the same adapters from the run's seed,
sums the adapters' gradients alone, and pushes the same merged weights."""

LORA = {"rank": 4, "alpha": 8.0}
"""The adapters of the `*_lora` entries."""


DEGENERATE_GROUP = 102
"""In the `*_degenerate` entries this group scores 0 three times. The ranks hold groups 100 / 101 + 102, so
one rank leaves one of its two groups out of the gradient pass — with the separate proximal pass, and with
`learner.proximal: reuse` (`vcpo_reuse_degenerate`: its log π_old from a no-grad forward)."""


def batch(name: str) -> StepInput:
    """The parity batch of entry `name` (megatron_parity.parity_batch; a degenerate group where named so)."""
    step = megatron_parity.parity_batch(KIND)
    if not name.endswith("_degenerate"):
        return step
    pairs = zip(step.trajectories, step.group_ids, strict=True)
    trajectories = [t.model_copy(update={"reward": 0.0}) if g == DEGENERATE_GROUP else t for t, g in pairs]
    return dataclasses.replace(step, trajectories=trajectories)


def learner(name: str, data_parallel: object, micro_batch_tokens: int = megatron_parity.MICRO_BATCH_TOKENS
            ) -> TorchLearner:
    from configs.schema import AlgoConfig, LoraSettings

    model = tiny_model(KIND, attn_implementation=register_varlen_sdpa()).train()
    lora = LoraSettings.model_validate(LORA) if name.endswith("_lora") else None
    built = TorchLearner(model, AlgoConfig.model_validate(ALGOS[name]), megatron_parity.OPTIM,
                         micro_batch_tokens=micro_batch_tokens, data_parallel=data_parallel,  # type: ignore[arg-type]
                         lora=lora, lora_seed=7)
    if name == "vcpo_reuse_degenerate":
        built.proximal = "reuse"
    # the same move on every rank and in the single process: the reference away from the policy (with LoRA
    # the reference is the base, so the adapters move off zero instead)
    moved = ([p for n, p in model.named_parameters() if ".lora_B." in n] if lora is not None
             else list(built.reference.parameters()) if built.reference is not None else [])
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for parameter in moved:
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return built


def main(out: str) -> None:
    torch.set_num_threads(1)
    data_parallel = join_data_parallel_from_env(torch.device("cpu"))
    assert data_parallel is not None and data_parallel.world_size == 2
    results = {}
    for name in ALGOS:
        record = megatron_parity.run_step(learner(name, data_parallel), batch(name))
        results[name] = {"metrics": record.metrics, "weights": record.weights, "sq_norms": record.sq_norms}
    torch.save(results, f"{out}.{data_parallel.rank}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
