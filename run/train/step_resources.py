"""This process's resources around the learner: the CPU seconds it has used so far (`time/cpu`), and a
learner step that hands back its freed heap pages and its OpenMP team when it ends (`step_and_trim`: on
the trainer's learner thread, and in the Ray launcher's learner actors)."""

from __future__ import annotations

import contextlib
import ctypes
import resource
from typing import TYPE_CHECKING, Any, Protocol

from rollout.openmp import release_openmp_threads

if TYPE_CHECKING:
    from learner.backends.torch_learner import StepInput


class Steppable(Protocol):
    """What `step_and_trim` needs of a learner (the trainer's `Learner` and every backend have it)."""

    def step(self, batch: StepInput) -> dict[str, Any]: ...


def process_cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this process's threads and its finished children
    (sandboxed tool calls): `time/cpu` per step, against `time/step` × cores, says how busy the
    machine was — what overlap (k > 0) can still gain (`vcpo bench async`)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def step_and_trim(learner: Steppable, batch: StepInput) -> dict[str, Any]:
    """One learner step, then hand freed heap pages back to the OS (glibc `malloc_trim`; a no-op
    elsewhere): a step's transient activations are GBs the engine may need before the next step; and end
    this thread's docked OpenMP team, which would throttle the engine's while the learner waits
    (rollout/openmp.py)."""
    try:
        return learner.step(batch)
    finally:
        _malloc_trim()
        release_openmp_threads()


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)

