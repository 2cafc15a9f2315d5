"""One `vcpo train` per run directory: an exclusive lock held for the whole run.

Two processes on one run directory (a second terminal, a scheduler's retry, a kill that missed the trainer)
would append to the same metrics, trajectory and evaluation files and race on the checkpoints. The first
process takes an exclusive `flock` on `run_dir/run.lock` and writes its pid and host there; a second is
refused at once, before it writes anything, naming the holder and what to do. The kernel drops the lock when
its process dies however it dies, so the lock of a dead process is simply taken over (its pid in the file is
overwritten). Local file systems only: `flock` on NFS may not exclude a process on another host.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = "run.lock"


class RunDirBusy(RuntimeError):
    """Another live process holds the run directory."""


def _holder(path: Path) -> str:
    try:
        pid, _, host = path.read_text().strip().partition("\n")
    except OSError:
        return "an unknown process"
    return f"pid {pid} on {host}" if pid else "an unknown process"


@contextlib.contextmanager
def run_dir_lock(run_dir: Path) -> Iterator[Path]:
    """Hold `run_dir` exclusively while the block runs (module docstring); raises `RunDirBusy` naming the
    holder when another process has it. Yields the lock file's path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise RunDirBusy(
            f"{run_dir} is in use by another `vcpo train` ({_holder(path)}): two processes on one run "
            "directory would write into the same files. Wait for it to finish, stop it (Ctrl-C there, or "
            "kill that pid; rerunning the command afterwards resumes from its newest checkpoint), or give "
            "this run another run_dir=...") from None
    try:
        os.ftruncate(descriptor, 0)
        os.write(descriptor, f"{os.getpid()}\n{socket.gethostname()}\n".encode())
        yield path
    finally:
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        os.close(descriptor)
