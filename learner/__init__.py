"""The learner: trajectories in, one optimizer step out. It knows nothing of engines, agent loops, the
training loop or Ray (those are the run's, in `run/`). Subpackages by concern, each importing only
those listed before it:

* `forward/` — packing trajectories into rows, varlen attention, target log-probs
* `distributed/` — data-parallel collectives, weight transport to rollout workers
* `traj_grads/` — exact per-trajectory gradient norms and VCPO's two-buffer gradient
* `backends/` — the torch learner and the objective mapping; `backends/megatron/` — megatron-core

May import: `vcpo`, `rollout` (the trajectory and request types, the model loader, the weight-push
group), `configs`. tests/test_architecture.py enforces the direction, reading each package's own list.
"""

import importlib

# Public names, resolved lazily (PEP 562) so that `import learner` — and with it `vcpo --help` —
# does not pull in torch and transformers.
_EXPORTS = {
    "TrajectoryTokens": "learner.forward.packing",
    "PackedMicroBatch": "learner.forward.packing",
    "build_microbatch": "learner.forward.packing",
    "plan_microbatches": "learner.forward.packing",
    "pack_trajectories": "learner.forward.packing",
    "aggregation_weights": "learner.forward.packing",
    "token_logprobs": "learner.forward.logprobs",
    "packed_target_logprobs": "learner.forward.logprobs",
    "trajectory_logliks": "learner.forward.logprobs",
    "VARLEN_SDPA": "learner.forward.varlen_attention",
    "register_varlen_sdpa": "learner.forward.varlen_attention",
    "BaselineFn": "learner.traj_grads.opob_grad",
    "OpobGradResult": "learner.traj_grads.opob_grad",
    "accumulate_opob_grad_packed": "learner.traj_grads.opob_grad",
    "accumulate_opob_grad_per_trajectory": "learner.traj_grads.opob_grad",
    "UnsupportedParameterError": "learner.traj_grads.hooks",
    "reference_opob_gradient": "learner.traj_grads.reference",
    "MegatronLearner": "learner.backends.megatron.learner",
    "init_model_parallel": "learner.backends.megatron.learner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'learner' has no attribute {name!r}")
