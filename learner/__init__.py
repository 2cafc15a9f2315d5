"""The learner: trajectories in, one optimizer step out. It knows nothing of engines, agent loops, the
training loop or Ray (those are the run's, in `run/`). Subpackages by concern, each importing only
those listed before it:

* `forward/` — packing trajectories into rows, varlen attention, target log-probs
* `distributed/` — data-parallel collectives, weight transport to rollout workers
* `traj_grads/` — exact per-trajectory gradient norms and VCPO's two-buffer gradient
* `backends/` — the torch learner and the objective mapping; `backends/megatron/` — megatron-core

The package holds no re-exports: import from the module that defines a name (importing it stays light).

May import: `vcpo`, `rollout` (the trajectory and request types, the model loader, the weight-push
group), `configs`. tests/test_architecture.py enforces the direction, reading each package's own list.
"""
