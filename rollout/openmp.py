"""Hand a thread's idle OpenMP workers back, so that the thread that computes now runs at full speed.

Why (measured in docs/log.md): in one process the engine's thread and the learner's
thread each own an OpenMP team (torch's intra-op threads; libgomp keeps a thread's team docked after its
last parallel region). libgomp counts every thread it manages, docked ones included, and once that count
exceeds the CPUs it *throttles* its spin-wait: a worker spins ~100 iterations instead of ~300,000 before
it sleeps on a futex, so each of a step's thousands of short parallel regions wakes a sleeping worker.
On a 2-core machine the learner step ran 25–30% slower beside an *idle* engine's docked team than alone
(the same step, the same process, `omp_pause_resource` taking the other team away restored its speed).
While both compute at once the short spin is what one wants (four threads on two cores); while one of
them idles, its docked team only slows the other.

`release_openmp_threads()` ends the calling thread's idle team (OpenMP 5.0 `omp_pause_resource` on the
host: libgomp joins the docked workers and stops counting them); its next parallel region starts a new
team, which costs tens of microseconds. Call it only on a thread that runs no parallel region at that
moment — the engines' worker thread between steps, the learner's thread after a step. The arithmetic
does not change: thread counts, work splits and reductions are the same in a new team.

Where torch is not loaded, or its OpenMP runtime has no `omp_pause_resource` (an older one, or none:
torch built without OpenMP), this is a no-op.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1
"""`omp_pause_soft`: release the threads, keep what a later region needs to start again."""

_TORCH_LIBRARY = "/libtorch_cpu.so"
"""torch's CPU library: its intra-op parallel regions run on the OpenMP runtime it links. A process may
hold several runtimes (sentencepiece bundles its own libgomp), so the one torch uses is looked up through
torch's library — pausing another runtime would release nothing."""

_pause: functools.partial[int] | None = None
_unavailable = False
"""Set once torch's library is loaded and its runtime has no `omp_pause_resource`: no point looking again."""


def _pause_function() -> functools.partial[int] | None:
    """`omp_pause_resource(soft, host)` of the OpenMP runtime torch's CPU library uses, or None (looked up
    again next time: torch may not be loaded yet)."""
    global _pause, _unavailable
    if _pause is not None or _unavailable:
        return _pause
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if line.endswith(_TORCH_LIBRARY)}
    for path in sorted(paths):
        try:
            # dlsym through torch's handle searches torch's library and its dependencies: its runtime
            library = ctypes.CDLL(path)
            pause, initial_device = library.omp_pause_resource, library.omp_get_initial_device
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        initial_device.argtypes, initial_device.restype = [], ctypes.c_int
        _pause = functools.partial(pause, OMP_PAUSE_SOFT, initial_device())
        return _pause
    _unavailable = bool(paths)  # torch loaded without a usable runtime; not loaded yet: look again later
    return None


def release_openmp_threads() -> bool:
    """End the calling thread's docked OpenMP team (see the module docstring). True if the runtime did
    (or had nothing to end); False where it cannot here."""
    pause = _pause_function()
    if pause is None:
        return False
    status = pause()
    if status != 0:
        log.debug("omp_pause_resource returned %d (the thread is inside a parallel region?)", status)
    return status == 0
