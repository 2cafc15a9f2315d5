"""The heavy `vcpo` commands run on tcmalloc where the machine has it.

Why: a CPU learner step allocates and frees several GB of activations, casts and gradients. glibc's
malloc serves blocks above its mmap threshold (at most 32 MB, usually far less) with fresh `mmap`s and
unmaps them on free, so every step faults its working set in again, page by page, and the kernel
zeroes each page. Measured at the default run's shape (`vcpo bench learner`, bf16 autocast, Intel
Xeon with AMX, 2 threads): 0.7–0.9 M minor page faults per step with glibc, ~40 k with tcmalloc, and
the gradient pass 13.6–14.4 s → 9.4 s; elementwise kernels such as the MLP's `silu(g) * u` ran 8×
slower inside the step than in isolation. vLLM's CPU backend preloads tcmalloc for the same reason.

`prefer_tcmalloc()` runs first in the console entry point (never in library code or tests that
call `main()`): if the command is a heavy one, tcmalloc is not loaded yet and a `libtcmalloc_minimal`
is found, it re-executes the same command line with the library in `LD_PRELOAD` (the only way to
swap the allocator of a running process). Without tcmalloc it tunes glibc instead (no trimming, no
mmap for large blocks: memory, once faulted in, stays mapped), which recovers part of the gap.
`VCPO_ALLOCATOR=system` turns both off. Children (the sandbox's bubblewrap launcher clears its
environment) inherit the preload; `active_allocator()` says what a process runs on.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from collections.abc import Sequence
from pathlib import Path

HEAVY_COMMANDS = frozenset({"train", "bench", "eval", "model"})
"""Subcommands that run models (the others — config, plot, trend, sandbox — start no learner)."""

ENV_CHOICE = "VCPO_ALLOCATOR"
"""`auto` (default): tcmalloc if found, else tuned glibc; `system`: leave the allocator alone."""
ENV_DONE = "VCPO_ALLOCATOR_CHECKED"
"""Set before the re-exec so the new process never re-executes again."""

TCMALLOC_PATTERNS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4*",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4*",
    "/usr/lib64/libtcmalloc_minimal.so.4*",
    "/usr/lib/libtcmalloc_minimal.so.4*",
    "/usr/local/lib/libtcmalloc_minimal.so.4*",
)
"""Where distributions put gperftools' tcmalloc (Debian/Ubuntu: `apt-get install libtcmalloc-minimal4`)."""

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def find_tcmalloc(patterns: Sequence[str] = TCMALLOC_PATTERNS) -> str | None:
    """The first tcmalloc shared library found, or None."""
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            if Path(path).is_file():
                return path
    return None


def active_allocator() -> str:
    """What this process allocates with: `tcmalloc`, `jemalloc`, `glibc` or `glibc (tuned)`."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in maps:
            return name
    return "glibc (tuned)" if _glibc_tuned else "glibc"


_glibc_tuned = False


def tune_glibc() -> bool:
    """Keep freed memory in the process: no trimming of the heap top, no mmap for large blocks.

    The process's resident size then stays at its peak instead of following each step's working set —
    the trade every caching allocator makes. False where this is not glibc on Linux.
    """
    global _glibc_tuned
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = (libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**40) == 1
                and libc.mallopt(_M_TOP_PAD, 2**28) == 1)
    except (OSError, AttributeError):
        return False
    _glibc_tuned = done
    return done


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand of a `vcpo` command line (None for `vcpo`, `vcpo --help`)."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def prefer_tcmalloc(argv: Sequence[str] | None = None) -> None:
    """Re-execute a heavy command on tcmalloc if found; else tune glibc (see the module docstring).

    Returns normally unless it re-executes (then it never returns). Call it before torch is imported.
    """
    argv = sys.argv[1:] if argv is None else argv
    if (not sys.platform.startswith("linux") or _command(argv) not in HEAVY_COMMANDS
            or os.environ.get(ENV_CHOICE, "auto") == "system"
            or active_allocator() in ("tcmalloc", "jemalloc")):
        return
    library = None if os.environ.get(ENV_DONE) else find_tcmalloc()
    if library is None:
        tune_glibc()
        return
    env = dict(os.environ)
    env[ENV_DONE] = "1"
    env["LD_PRELOAD"] = ":".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    # tcmalloc reports every allocation above 1 GB on stderr; a 4k-token logits tensor is one
    env.setdefault("TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD", str(2**40))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:  # cannot re-execute (no interpreter path, seccomp): stay, on tuned glibc
        tune_glibc()


if __name__ == "__main__":  # scripts/setup.sh: exit 0 when a tcmalloc is installed (one list of places)
    sys.exit(0 if find_tcmalloc() else 1)
