"""Launching a training run: in this process or across a Ray cluster (`run.run_training` picks), with the
Ray driver (`ray_launcher`) and its actors (`ray_actors`: rollout workers, learner ranks, sandboxes), and
the process's memory allocator (`allocator`: tcmalloc for the heavy commands) and the machine it runs on
(`host`: written into every run's summary.json and every benchmark's JSON).

May import: `learner.train`, `learner.backends`, `learner.backends.megatron`, `learner.traj_grads`,
`learner.forward`, `learner.distributed`, `learner.observability`.
"""
