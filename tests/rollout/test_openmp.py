"""`release_openmp_threads` ends the calling thread's docked OpenMP team — the team torch uses, even with a
second OpenMP runtime in the process — and a later parallel region works as before (rollout/openmp.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.openmp_probe import ROOT, needs_an_openmp_team, run_team_probe

_PROBE = textwrap.dedent("""
    import json, os, threading
    import sentencepiece  # noqa: F401  (bundles a libgomp of its own: the wrong one to pause)
    import torch
    from rollout.openmp import release_openmp_threads

    torch.set_num_threads(2)

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    out = {}

    def worker() -> None:
        x = torch.arange(4_000_000, dtype=torch.float64)
        first = float(x.sum())  # a parallel region: this thread's team of 2 starts
        out["with_team"] = threads()
        out["released"] = release_openmp_threads()
        out["after_release"] = threads()
        out["same_sum"] = float(x.sum()) == first  # a new team, the same arithmetic
        out["with_new_team"] = threads()
        out["released_again"] = release_openmp_threads()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    print(json.dumps(out))
""")


@needs_an_openmp_team
def test_a_threads_team_is_ended_and_the_next_region_starts_a_new_one() -> None:
    out = run_team_probe(_PROBE)
    assert out["released"] and out["released_again"]
    assert out["after_release"] == out["with_team"] - 1  # the docked worker joined and exited
    assert out["with_new_team"] == out["with_team"]
    assert out["same_sum"]


def test_without_torch_loaded_it_is_a_no_op() -> None:
    code = ("import sys\nfrom rollout.openmp import release_openmp_threads\n"
            "assert 'torch' not in sys.modules\nprint(release_openmp_threads())")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


_IDLE_ENGINE_PROBE = textwrap.dedent("""
    import asyncio, json, os
    import torch
    from rollout.engines.step_runtime import StepRuntime

    torch.set_num_threads(2)

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    async def main() -> dict:
        runtime = StepRuntime("probe", step_timeout_s=60, request_timeout_s=60)
        await runtime.call(lambda: None)  # the worker thread exists from the first call
        out = {"idle_worker": threads()}
        todo = [3]

        async def step() -> None:  # an engine step: a parallel region on the worker thread
            await runtime.call(lambda: float(torch.arange(4_000_000, dtype=torch.float64).sum()))
            todo[0] -= 1

        runtime.start_scheduler(step, lambda: todo[0] > 0)
        runtime.wake()
        for _ in range(200):
            await asyncio.sleep(0.05)
            if todo[0] == 0:
                break
        await asyncio.sleep(0.5)  # the scheduler has gone idle and released the worker's team
        out["after_idle"] = threads()
        async with runtime.boundary("a weight load"):  # work inside a boundary starts a team again
            await runtime.call(lambda: float(torch.arange(4_000_000, dtype=torch.float64).sum()))
            out["inside_boundary"] = threads()
        await asyncio.sleep(0.5)
        out["after_boundary"] = threads()
        runtime.is_closing = True
        runtime.wake()
        return out

    print(json.dumps(asyncio.run(main())))
""")


@needs_an_openmp_team
def test_an_idle_engine_runtime_ends_its_worker_threads_team() -> None:
    """The engines' StepRuntime: once there is no work (and after a boundary such as a weight load), the
    worker thread's OpenMP team is ended, so a learner computing meanwhile is not throttled."""
    out = run_team_probe(_IDLE_ENGINE_PROBE)
    assert out["inside_boundary"] == out["idle_worker"] + 1  # a team: one more thread
    assert out["after_idle"] == out["idle_worker"]
    assert out["after_boundary"] == out["idle_worker"]
