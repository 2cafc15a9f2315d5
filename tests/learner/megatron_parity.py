"""Shared by the megatron learner tests and their torchrun worker: one tiny checkpoint, one batch, one
step recorded the same way for the torch and the megatron learner."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from configs.schema import AlgoConfig, OptimConfig
from learner.backends.torch_learner import StepInput, TorchLearner
from learner.forward.varlen_attention import register_varlen_sdpa
from rollout.trajectory import Trajectory, TrajectoryVersions
from tests.learner.conftest import random_trajectories, tiny_model

OPTIM = OptimConfig(lr=1e-3, eps=1e-6)
"""Adam divides each coordinate by its own |g| + eps: with eps = 1e-8 a coordinate whose gradient is
~1e-8 turns the backends' ~1e-7 relative rounding differences into ~1e-5 weight differences (seen on
Qwen2); eps = 1e-6 keeps the comparison about the gradients, not Adam's amplification of noise."""
MICRO_BATCH_TOKENS = 96
"""Small enough that VCPO's groups span micro-batches (its two-buffer path), plain groups stay whole."""

ALGOS = {
    "grpo": {"objective": {"type": "grpo"}, "group_size": 3},
    "vcpo": {"objective": {"type": "vcpo", "is_cap": 2.0}, "group_size": 3},
    "vcpo_reference": {"objective": {"type": "vcpo", "is_cap": 2.0, "opob": {"form": "reference"}},
                       "group_size": 3},
}
PER_TRAJECTORY = {"vcpo_per_trajectory": {"objective": {"type": "vcpo", "is_cap": 2.0,
                                                        "opob": {"grad_norm_path": "per_trajectory"}},
                                          "group_size": 3}}
"""VCPO on the per-trajectory norm path: the fast path's reference on the same layout."""


def algo(name: str) -> AlgoConfig:
    return AlgoConfig.model_validate({**ALGOS, **PER_TRAJECTORY}[name])


def write_checkpoint(kind: str, out_dir: Path, layers: int = 2) -> Path:
    """The conftest's tiny random model ('llama_tied' or 'qwen2') as an HF directory."""
    tiny_model(kind, layers=layers).save_pretrained(out_dir)
    return out_dir


def parity_batch(kind: str, layers: int = 2) -> StepInput:
    """3 groups × 3 trajectories (~200 tokens) of model `kind`, random rewards, lags 0–2, behaviour
    log-probs = the model's own + N(0, 0.05²) noise per token (sequence IS weights near 1, so VCPO's
    coefficients are far from 0 and its update is a real test)."""
    rng = random.Random(7)
    tokens = random_trajectories(num_groups=3, per_group=3, seed=1)
    model = tiny_model(kind, layers=layers)
    trajectories = []
    for i, t in enumerate(tokens):
        ids = torch.tensor([t.token_ids])
        with torch.no_grad():
            own = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        own = own.gather(-1, ids[0, 1:, None]).squeeze(-1).tolist()
        # behaviour log-prob of sampled token j (j ≥ 1) comes from the logits at position j − 1
        logprobs = tuple(own[j - 1] + rng.gauss(0.0, 0.05) if m else 0.0 for j, m in enumerate(t.loss_mask))
        trajectories.append(Trajectory(
            trajectory_id=f"t{i}", group_id=str(t.group_id), token_ids=tuple(t.token_ids),
            loss_mask=tuple(t.loss_mask), behavior_logprobs=logprobs,
            versions=TrajectoryVersions(start=0, end=0), reward=float(rng.random() < 0.5)))
    return StepInput(trajectories, [t.group_id for t in tokens], [i % 3 for i in range(len(tokens))],
                     [True] * len(tokens))


def torch_learner(kind: str, algo_name: str, layers: int = 2) -> TorchLearner:
    model = tiny_model(kind, attn_implementation=register_varlen_sdpa(), layers=layers).train()
    return TorchLearner(model, algo(algo_name), OPTIM, micro_batch_tokens=MICRO_BATCH_TOKENS)


@dataclass
class StepRecord:
    """What a parity test compares: the step's metrics, VCPO's ‖∇ℓ_i‖² and the weights after it."""

    metrics: dict
    sq_norms: torch.Tensor | None
    weights: dict[str, torch.Tensor]


def run_step(learner: TorchLearner, batch: StepInput) -> StepRecord:
    """One `learner.step(batch)`, recording the per-trajectory squared norms `_accumulate_opob` returns.
    Wall-clock timings (`time/...`) are left out of the record: they differ run to run by nature."""
    recorded: list[torch.Tensor] = []
    accumulate = learner._accumulate_opob

    def spy(*args: object) -> torch.Tensor:
        sq_norms = accumulate(*args)
        recorded.append(sq_norms.detach().clone())
        return sq_norms

    learner._accumulate_opob = spy  # type: ignore[method-assign]
    metrics = {key: value for key, value in learner.step(batch).items() if not key.startswith("time/")}
    weights = {name: tensor.clone() for name, tensor in learner.named_weights()}
    return StepRecord(metrics, recorded[0] if recorded else None, weights)


REPO_ROOT = Path(__file__).resolve().parents[2]
TP_WORKER = Path(__file__).with_name("megatron_tp_worker.py")


def run_tp_worker(args: list[str], timeout: float, env: dict[str, str] | None = None, ranks: int = 2) -> dict:
    """Run megatron_tp_worker.py on `ranks` processes under torchrun; returns what it saved to `args[2]`
    (the output path). Fails with the workers' stderr when they fail."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               str(TP_WORKER), *args]
    run = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout,
                         check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(args[2], weights_only=False)
