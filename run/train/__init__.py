"""The training loop of one process: wiring a run's parts from its config (`wiring`), building the
learner from its config (`learner_setup`), the step loop with metrics and checkpoints (`trainer`), the
learner step's process resources (`step_resources`: CPU seconds, heap and OpenMP threads handed back),
atomic checkpoints (`checkpointing`) and the cold-start SFT (`warm_start`).

May import: `run.observability`.
"""
