"""The bubblewrap command line of one sandbox, and the probe of the interpreter it runs.

What the sandbox sees: /usr (read-only, with the /bin, /lib* links or binds of the host), the
interpreter's prefixes (its venv and base installation) read-only at their host paths, a few files
of /etc that the dynamic loader and time zone need, a fresh /proc of its own PID namespace, a
minimal /dev, and a private size-capped tmpfs at /tmp that is the work directory and HOME. Not
visible: the rest of /, the repository, home directories, /sys, the host's processes.
Namespaces: IPC, PID, network (only an unconnected loopback), UTS and cgroup are always new.

Two identity modes, chosen by who runs vcpo:
* unprivileged: a new user namespace too (`--unshare-user --disable-userns`); the kernel counts
  RLIMIT_NPROC per user namespace, so each sandbox has its own process budget.
* root: no user namespace (inside one, uid 0 would map to host root, which RLIMIT_NPROC exempts).
  bwrap keeps CAP_SETUID/CAP_SETGID for the runner, which switches to a per-sandbox unprivileged
  uid before touching any request (see `_sandbox_runner.py`); a seccomp filter stands in for
  `--disable-userns`.

This module builds argument lists only; `_sandbox_process.py` starts them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tools.base import ToolUnavailableError
from tools.settings import LocalSandboxSettings

WORK_DIR = "/tmp"
"""The sandbox's work directory, cwd and HOME (a private tmpfs)."""

_SYSTEM_TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime", "/etc/alternatives")
_THREAD_ENV = {
    # One BLAS/OpenMP thread: thread pools would eat the process budget and reserve address space.
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
}

_PROBE_CODE = (
    "import json, site, sys; print(json.dumps({'prefixes': [sys.prefix, sys.base_prefix, sys.exec_prefix, "
    "sys.base_exec_prefix], 'site_packages': site.getsitepackages()}))"
)


@dataclass(frozen=True)
class InterpreterLayout:
    """Where an interpreter lives: the executable as invoked and the host trees it needs."""

    executable: str
    read_only_paths: tuple[str, ...]
    site_packages: tuple[str, ...]
    """What `site` would add to sys.path; the runner starts with -S and adds these itself."""


async def probe_interpreter(executable: str | None) -> InterpreterLayout:
    """Run the interpreter once (unsandboxed, trusted code of ours) to learn its prefixes.

    None means the interpreter running vcpo. Raises ToolUnavailableError when it cannot run.
    """
    path = executable or sys.executable
    if not os.path.isabs(path):
        raise ToolUnavailableError(f"interpreter={path!r} must be an absolute path to a python executable")
    try:
        process = await asyncio.create_subprocess_exec(
            path, "-I", "-c", _PROBE_CODE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await process.communicate()
    except OSError as error:
        raise ToolUnavailableError(
            f"cannot run interpreter {path!r}: {error}; set `interpreter` to a python"
        ) from error
    if process.returncode != 0:
        raise ToolUnavailableError(
            f"interpreter {path!r} failed its probe: {err.decode(errors='replace')[-500:]}"
        )
    found = json.loads(out)
    trees = [os.path.realpath(p) for p in found["prefixes"]]
    trees += [os.path.dirname(path), os.path.dirname(os.path.realpath(path))]
    for tree in trees:
        if tree in ("/", "") or Path(tree) in (Path.home(), Path("/home"), Path("/root")):
            raise ToolUnavailableError(
                f"interpreter {path!r} lives in {tree!r}; binding that would expose the host to the sandbox. "
                "Use an interpreter installed in its own prefix (a venv, pyenv or /usr)"
            )
    return InterpreterLayout(
        executable=path, read_only_paths=_outermost(trees), site_packages=tuple(found["site_packages"])
    )


def _outermost(paths: list[str]) -> tuple[str, ...]:
    """Drop duplicates, paths under /usr (bound anyway) and paths inside another listed path."""
    kept: list[str] = []
    for path in sorted(set(paths), key=len):
        if path == "/usr" or path.startswith("/usr/"):
            continue
        if not any(path == parent or path.startswith(parent + "/") for parent in kept):
            kept.append(path)
    return tuple(kept)


def sandbox_env(settings: LocalSandboxSettings) -> dict[str, str]:
    """The complete environment inside the sandbox: nothing of the host's."""
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": WORK_DIR,
        "TMPDIR": WORK_DIR,
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "MPLBACKEND": "Agg",
        **_THREAD_ENV,
    }
    env.update(settings.env)
    return env


def _system_args() -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in _SYSTEM_TOP_LEVEL:
        host = Path("/") / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            args += ["--ro-bind", str(host), str(host)]
    for path in _ETC_FILES:
        args += ["--ro-bind-try", path, path]
    return args


def _bind_args(paths: tuple[str, ...]) -> list[str]:
    """Read-only binds at the host paths, creating missing parent directories world-readable
    (bwrap would create them mode 0700, unreadable for the sandbox's unprivileged uid)."""
    args: list[str] = []
    created: set[str] = {"/", "/usr", "/etc", "/tmp", "/proc", "/dev"}
    for path in sorted(paths):
        for parent in reversed(Path(path).parents):
            if str(parent) not in created:
                created.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", path, path]
        created.add(path)
    return args


def build_bwrap_argv(
    bwrap: str,
    layout: InterpreterLayout,
    settings: LocalSandboxSettings,
    *,
    is_root: bool,
    seccomp_fd: int | None,
    info_fd: int | None = None,
    command: list[str],
) -> list[str]:
    """The full argv: `bwrap <isolation> -- <command>`."""
    size_bytes = str(settings.work_dir_size_mb << 20)
    argv = [bwrap, *_system_args()]
    # The work-dir tmpfs goes first: bwrap mounts in order, so binds of paths under /tmp (a venv in
    # /tmp/...) land on top of it instead of being hidden by it.
    argv += ["--size", size_bytes, "--perms", "01777", "--tmpfs", WORK_DIR]
    argv += _bind_args(tuple(layout.read_only_paths) + tuple(settings.extra_read_only_paths))
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--size", size_bytes, "--perms", "01777", "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    argv += ["--remount-ro", "/", "--chdir", WORK_DIR, "--clearenv"]
    for key, value in sandbox_env(settings).items():
        argv += ["--setenv", key, value]
    argv += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    if is_root:
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--disable-userns"]
    argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    if info_fd is not None:  # bwrap writes {"child-pid": ...}: the sandbox's PID 1, to kill it
        argv += ["--info-fd", str(info_fd)]
    return [*argv, "--", *command]
