"""Launching a training run: in this process (`local`) or across a Ray cluster (`training.run_training`
picks), with the Ray driver (`ray_launcher`) and its actors (`ray_actors`: rollout workers, learner
ranks, sandboxes), the evaluations during training that both launchers build alike (`evaluators`), the
process's memory allocator (`allocator`: tcmalloc for the heavy commands) and the machine it runs on
(`host`: written into every run's summary.json and every benchmark's JSON).

May import: `run.train`, `run.observability`.
"""
