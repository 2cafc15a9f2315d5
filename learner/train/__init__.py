"""The training loop of one process: wiring a run's parts from its config (`compose`), building the
learner (`build`), the step loop with metrics and checkpoints (`trainer`), the learner step's process
resources (`process`: CPU seconds, heap and OpenMP threads handed back), atomic checkpoints
(`checkpointing`) and the cold-start SFT (`warm_start`).

May import: `learner.backends`, `learner.backends.megatron`, `learner.traj_grads`, `learner.forward`,
`learner.distributed`, `learner.observability`.
"""
