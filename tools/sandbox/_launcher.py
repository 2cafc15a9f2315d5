"""How one tool instance starts its sandboxes: finds bwrap, probes the interpreter once, leases a
uid per sandbox when running as root, and passes the seccomp filter and control socket.

`SandboxLauncher.create` does the checks that can fail (no bwrap, broken interpreter) so the tool
refuses to start with an error that says what to do. `start` is then cheap and repeatable; the
warm pool calls it in the background.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path

from tools.base import ToolUnavailableError
from tools.sandbox import _bwrap
from tools.sandbox._sandbox_process import SandboxProcess
from tools.sandbox._seccomp import no_new_user_namespaces_filter
from tools.settings import LocalSandboxSettings

logger = logging.getLogger(__name__)

_RUNNER_PATH = Path(__file__).with_name("_sandbox_runner.py")
_BWRAP_ENV = {"PATH": "/usr/bin:/bin"}
"""bwrap's own environment. Its PID-1 keeps this environment, so it must hold no secrets either."""

INSTALL_HINT = (
    "bubblewrap (bwrap) was not found. Install it: `sudo apt-get install bubblewrap` (Debian/Ubuntu), "
    "`sudo dnf install bubblewrap` (Fedora) or `sudo pacman -S bubblewrap` (Arch); or set `bwrap_path`. "
    "To run model code WITHOUT isolation on a trusted machine, set use_unsafe_unisolated_execution: true"
)


class UidPool:
    """Unprivileged uids for sandboxes when vcpo runs as root, one per live sandbox, so that
    RLIMIT_NPROC (counted per uid) gives every sandbox its own process budget."""

    def __init__(self, base: int, count: int) -> None:
        self._base = base
        self._count = count
        self._in_use: set[int] = set()
        # Different processes on one host start at different places in the range.
        self._next = hash((os.getpid(), id(self))) % count

    def acquire(self) -> int:
        for _ in range(self._count):
            uid = self._base + self._next
            self._next = (self._next + 1) % self._count
            if uid not in self._in_use:
                self._in_use.add(uid)
                return uid
        raise ToolUnavailableError(
            f"all {self._count} sandbox uids are in use; raise sandbox_uid_count or close idle sessions"
        )

    def release(self, uid: int) -> None:
        self._in_use.discard(uid)


class SandboxLauncher:
    """Starts `SandboxProcess`es for one tool instance. Not thread-safe; use from one event loop."""

    def __init__(
        self,
        settings: LocalSandboxSettings,
        layout: _bwrap.InterpreterLayout,
        bwrap: str | None,
        runner_source: str,
    ) -> None:
        self.settings = settings
        self.layout = layout
        self._bwrap = bwrap
        self._runner_source = runner_source
        self.is_root = os.geteuid() == 0
        self.uids = (
            UidPool(settings.sandbox_uid_base, settings.sandbox_uid_count) if self.is_isolated_root else None
        )
        self._seccomp = no_new_user_namespaces_filter() if self.is_isolated_root else None
        if self.is_isolated_root and self._seccomp is None:
            logger.warning(
                "no seccomp filter for this CPU architecture: sandboxes can create user namespaces"
            )

    @property
    def is_isolated(self) -> bool:
        return self._bwrap is not None

    @property
    def is_isolated_root(self) -> bool:
        return self._bwrap is not None and self.is_root

    @classmethod
    async def create(cls, settings: LocalSandboxSettings) -> SandboxLauncher:
        """Check the environment once. Raises ToolUnavailableError saying how to fix it."""
        bwrap: str | None = None
        if settings.use_unsafe_unisolated_execution:
            logger.warning(
                "UNSAFE: use_unsafe_unisolated_execution is set; model code runs WITHOUT a sandbox "
                "(it can read and write your files, use the network and see your processes)"
            )
        else:
            bwrap = shutil.which(settings.bwrap_path)
            if bwrap is None:
                raise ToolUnavailableError(f"{INSTALL_HINT} (looked for {settings.bwrap_path!r})")
        layout = await _bwrap.probe_interpreter(settings.interpreter)
        return cls(settings, layout, bwrap, _RUNNER_PATH.read_text())

    async def start(self) -> SandboxProcess:
        """Start one sandbox and wait until its runner is ready."""
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pass_fds = [child_end.fileno()]
        uid = self.uids.acquire() if self.uids is not None else None
        work_dir = _bwrap.WORK_DIR if self.is_isolated else tempfile.mkdtemp(prefix="vcpo-unisolated-")
        seccomp_read = self._seccomp_pipe()
        if seccomp_read is not None:
            pass_fds.append(seccomp_read)
        info_read, info_write = os.pipe() if self.is_isolated else (None, None)
        if info_write is not None:
            pass_fds.append(info_write)
        command = [
            self.layout.executable,
            "-I",
            "-S",
            "-c",
            self._runner_source,
            self._runner_config(child_end, uid, work_dir),
        ]

        def on_exit() -> None:
            if uid is not None and self.uids is not None:
                self.uids.release(uid)
            if not self.is_isolated:
                shutil.rmtree(work_dir, ignore_errors=True)

        child_fds_open = True

        def close_child_fds() -> None:
            nonlocal child_fds_open
            if child_fds_open:
                child_fds_open = False
                child_end.close()
                if info_write is not None:
                    os.close(info_write)
                if seccomp_read is not None:
                    os.close(seccomp_read)

        started = False
        try:
            if self._bwrap is not None:
                argv = _bwrap.build_bwrap_argv(
                    self._bwrap,
                    self.layout,
                    self.settings,
                    is_root=self.is_root,
                    seccomp_fd=seccomp_read,
                    info_fd=info_write,
                    command=command,
                )
                env = dict(_BWRAP_ENV)
            else:
                argv, env = (
                    command,
                    {**_bwrap.sandbox_env(self.settings), "HOME": work_dir, "TMPDIR": work_dir},
                )
            started = True  # from here on, SandboxProcess.start owns the socket and calls on_exit
            return await SandboxProcess.start(
                argv,
                env=env,
                pass_fds=pass_fds,
                control=parent_end,
                info_fd=info_read,
                startup_timeout_s=self.settings.startup_timeout_s,
                on_exit=on_exit,
                after_spawn=close_child_fds,
            )
        finally:
            if not started:
                parent_end.close()
                on_exit()
                if info_read is not None:
                    os.close(info_read)
            close_child_fds()

    def _seccomp_pipe(self) -> int | None:
        """A pipe holding the filter program; bwrap reads it once at start."""
        if self._seccomp is None:
            return None
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, self._seccomp)  # a few hundred bytes: fits the pipe buffer
        finally:
            os.close(write_end)
        return read_end

    def _runner_config(self, child_end: socket.socket, uid: int | None, work_dir: str) -> str:
        settings = self.settings
        return json.dumps(
            {
                "control_fd": child_end.fileno(),
                "uid": uid,
                "gid": uid,
                "work_dir": work_dir,
                "site_packages": list(self.layout.site_packages),
                "max_processes": settings.max_processes,
                "max_open_files": settings.max_open_files,
                "max_file_size_bytes": settings.max_file_size_mb << 20,
                "memory_limit_bytes": settings.memory_limit_mb << 20,
            }
        )
