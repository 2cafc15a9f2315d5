"""A training run, composed: the composition root that wires a run's objects from its config (the
`vcpo` command above it, in `cli/`, reads the files) and drives them. Subpackages by concern, each
importing only those listed before it:

* `observability/` — metric names, metrics.jsonl / TensorBoard / W&B, trajectories.jsonl, the progress
  line, plot, trend
* `train/` — wiring a run's parts, building the learner from its config, the step loop, checkpoints,
  the warm start
* `launch/` — one run in this process or across Ray (the driver and its actors), the heavy commands'
  memory allocator, the host description

May import: `vcpo`, `rollout`, `tools`, `agent_env`, `configs`, `learner`. tests/test_architecture.py
enforces the direction, reading each package's own list.
"""
