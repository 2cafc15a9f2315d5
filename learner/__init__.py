"""Training backends, per-trajectory gradient norms, the trainer loop, and the CLI (the composition
root: the only place that reads config files and wires objects)."""

import importlib

# Public names, resolved lazily (PEP 562) so that `import learner` — and with it `vcpo --help` —
# does not pull in torch and transformers.
_EXPORTS = {
    "TrajectoryTokens": "learner.packing",
    "PackedMicroBatch": "learner.packing",
    "build_microbatch": "learner.packing",
    "plan_microbatches": "learner.packing",
    "pack_trajectories": "learner.packing",
    "aggregation_weights": "learner.packing",
    "token_logprobs": "learner.logprobs",
    "packed_target_logprobs": "learner.logprobs",
    "trajectory_logliks": "learner.logprobs",
    "VARLEN_SDPA": "learner.varlen_attention",
    "register_varlen_sdpa": "learner.varlen_attention",
    "BaselineFn": "learner.opob_grad",
    "OpobGradResult": "learner.opob_grad",
    "accumulate_opob_grad_packed": "learner.opob_grad",
    "accumulate_opob_grad_per_trajectory": "learner.opob_grad",
    "UnsupportedParameterError": "learner.traj_grad_hooks",
    "reference_opob_gradient": "learner.grad_reference",
    "MegatronLearner": "learner.megatron_learner",
    "init_model_parallel": "learner.megatron_learner",
    "bench_learner": "learner.bench_learner",
    "synthetic_microbatches": "learner.grad_bench",
    "time_grad_paths": "learner.grad_bench",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'learner' has no attribute {name!r}")
