"""The `vcpo bench` benchmarks that measure the learner side: `async` (`asynchrony`), `learner`
(`learner_step`), `opob` (`opob_step`, with `grad_paths`) and `staleness` (`staleness`, with its
synthetic tasks and pre-taught policies in `staleness_tasks`). Each prints JSON; none is a test.

May import: `learner.launch`, `learner.train`, `learner.backends`, `learner.backends.megatron`,
`learner.traj_grads`, `learner.forward`, `learner.distributed`, `learner.observability`.
"""
