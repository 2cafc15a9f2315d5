"""The trainer's learner thread ends its OpenMP team after every step (run/train/step_resources.py
`step_and_trim`, rollout/openmp.py): an engine generating while the learner waits is not throttled."""

from __future__ import annotations

import textwrap

from tests.openmp_probe import needs_an_openmp_team, run_team_probe

_PROBE = textwrap.dedent("""
    import json, os
    from concurrent.futures import ThreadPoolExecutor
    import torch
    from run.train.step_resources import step_and_trim

    torch.set_num_threads(2)

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    class Learner:  # a step that runs parallel regions on the learner thread
        def step(self, batch):
            total = float(torch.arange(4_000_000, dtype=torch.float64).sum())
            return {"total": total, "threads_in_step": threads()}

    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(lambda: None).result()
        idle = threads()
        metrics = pool.submit(step_and_trim, Learner(), None).result()
        after = threads()
    print(json.dumps({"idle": idle, "in_step": metrics["threads_in_step"], "after": after}))
""")


@needs_an_openmp_team
def test_the_learner_thread_ends_its_team_after_a_step() -> None:
    out = run_team_probe(_PROBE)
    assert out["in_step"] == out["idle"] + 1
    assert out["after"] == out["idle"]
