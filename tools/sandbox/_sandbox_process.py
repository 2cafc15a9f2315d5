"""One running sandbox (bwrap + `_sandbox_runner.py`) and the protocol to hand it code.

Control channel: a Unix socketpair; each message is a 4-byte big-endian length and UTF-8 JSON.
The runner says `ready` once started; each request's header carries, as SCM_RIGHTS, the write
ends of two fresh pipes that become the code's stdout and stderr for that call only. So output of
different calls never mixes and reading stops at EOF, not at a marker the code could forge.

Concurrency: one `execute` at a time per process (sessions serialise calls; one-shot processes
get a single request). Output is drained by `CappedReader`s while waiting for the report. On the
wall-clock timeout, on cancellation and after a one-shot request the sandbox's PID 1 is killed
(through its pidfd) and our child's process group with it; with PID 1 the kernel kills every process
of the sandbox's PID namespace, background ones included. `close()` hangs up the control socket and
waits for that to finish. A sandbox cancelled while starting has no pidfd yet, and its PID 1 may not
have armed `--die-with-parent` yet: hanging up is what ends it then (its runner exits on end-of-file).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tools._output import CappedReader
from tools.base import ToolUnavailableError

logger = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
_MAX_REPORT_BYTES = 256 << 20
_SELF_EXIT_WAIT_S = 1.0
"""How long a runner that ended by itself may take to take its sandbox down before we kill it."""
_DEAD_OUTPUT_WAIT_S = 2.0
_LIVE_OUTPUT_WAIT_S = 0.1
"""After a session call, how long to keep reading output from processes the code left running."""


class _ControlClosed(Exception):
    """The runner's end of the control socket is gone: it exited or was killed."""


@dataclass(frozen=True)
class ExecutionOutcome:
    """What one request did, before it is turned into a `ToolResult`."""

    report: dict[str, Any] | None
    """The runner's report (`kind` done or runner_error); None when it died or was killed."""
    stdout: bytes
    stdout_total_bytes: int
    stderr: bytes
    stderr_total_bytes: int
    is_wall_timeout: bool
    """The wall-clock limit expired and we killed the sandbox."""
    exit_status: int | None
    """bwrap's exit status when the sandbox ended during this call (128+N: killed by signal N;
    negative: we killed bwrap itself), else None."""
    wall_time_s: float
    is_alive: bool
    """The runner survived and can take another request (sessions only)."""


class SandboxProcess:
    """A started sandbox whose runner has said `ready`. Create with `start`; always `close`."""

    def __init__(
        self, process: asyncio.subprocess.Process, control: socket.socket, on_exit: Callable[[], None]
    ) -> None:
        self._process = process
        self._control = control
        self._on_exit = on_exit
        self._closing: asyncio.Task[int] | None = None
        self._init_pidfd: int | None = None
        """pidfd of the sandbox's PID 1 (bwrap's reaper). Killing it ends the whole PID namespace,
        and it counts as exited only once the kernel has killed and released every process in
        that namespace. bwrap itself exits as soon as the runner does, possibly earlier. None
        (unisolated mode): kill our child's process group instead."""

    @classmethod
    async def start(
        cls,
        argv: list[str],
        *,
        env: dict[str, str],
        pass_fds: list[int],
        control: socket.socket,
        info_fd: int | None,
        startup_timeout_s: float,
        on_exit: Callable[[], None],
        after_spawn: Callable[[], None] = lambda: None,
    ) -> SandboxProcess:
        """Start `argv` and wait for the runner's `ready`. Raises ToolUnavailableError with bwrap's
        own error message when the sandbox cannot start.

        `after_spawn` runs as soon as the child exists: it must close this process's copies of the
        child's descriptors, or a sandbox that dies at once is noticed only at the start-up timeout
        (the control socket would never reach end-of-file)."""
        control.setblocking(False)
        # The spawn runs as its own task, so that cancelling us cannot cancel it half-way: asyncio
        # would then kill only bwrap itself, and a sandbox PID 1 that had not yet armed
        # --die-with-parent would live on, holding the stderr pipe that asyncio waits on for ever.
        spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            pass_fds=pass_fds,
            env=env,
            start_new_session=True,
        ))
        try:
            process = await asyncio.shield(spawn)
        except OSError as error:
            control.close()
            on_exit()
            if info_fd is not None:
                os.close(info_fd)
            raise ToolUnavailableError(f"cannot start the sandbox ({argv[0]}): {error}") from error
        except asyncio.CancelledError:
            # Hang up first: a runner that starts now reads end-of-file and exits, and its sandbox
            # with it, whatever happens to bwrap; then take down what was spawned.
            control.close()
            after_spawn()
            try:
                spawned = await spawn
            except BaseException:
                on_exit()
            else:
                with contextlib.suppress(BaseException):
                    await cls(spawned, control, on_exit).close()
            if info_fd is not None:
                os.close(info_fd)
            raise
        after_spawn()
        sandbox = cls(process, control, on_exit)
        try:
            await sandbox._wait_ready(startup_timeout_s)
            if info_fd is not None:
                sandbox._init_pidfd = _open_init_pidfd(info_fd)
        finally:
            if info_fd is not None:
                os.close(info_fd)
        return sandbox

    async def _wait_ready(self, startup_timeout_s: float) -> dict[str, Any]:
        try:
            hello = await asyncio.wait_for(self._receive_report(), startup_timeout_s)
        except asyncio.CancelledError:
            await asyncio.shield(self.close())
            raise
        except (TimeoutError, _ControlClosed, ValueError) as error:
            await self.close()
            assert self._process.stderr is not None
            diagnostics = (await self._process.stderr.read(4000)).decode(errors="replace").strip()
            raise ToolUnavailableError(
                f"the sandbox did not start ({type(error).__name__}); "
                f"its error output: {diagnostics or '(none)'}"
            ) from error
        if hello.get("kind") != "ready":
            await self.close()
            raise ToolUnavailableError(f"the sandbox runner sent {hello!r} instead of 'ready'")
        return hello

    @property
    def is_running(self) -> bool:
        return self._closing is None and self._process.returncode is None

    async def execute(
        self, request: dict[str, Any], *, timeout_s: float, max_output_bytes: int
    ) -> ExecutionOutcome:
        """Run one request. Failures of the code are in the outcome; nothing here raises for them."""
        payload = json.dumps(request).encode()
        readers = self._send_header_with_pipes(len(payload), max_output_bytes)
        start = time.monotonic()
        report: dict[str, Any] | None = None
        is_wall_timeout = False
        try:
            report = await asyncio.wait_for(self._send_and_receive(payload), timeout_s)
        except TimeoutError:
            is_wall_timeout = True
        except (_ControlClosed, OSError):
            report = None
        except ValueError as error:  # malformed report: the code tampered with the runner
            report = {"kind": "runner_error", "message": f"the sandbox sent an invalid report ({error})"}
            self.kill_soon()
        except asyncio.CancelledError:  # the caller is gone, so the sandbox must go too
            for reader in readers:
                await reader.wait_closed(0)
            await asyncio.shield(self.close())
            raise
        wall_time_s = time.monotonic() - start
        is_alive = self.is_running and report is not None and not request["is_last"]
        exit_status = None
        if not is_alive:
            exit_status = await self._end(wait_for_exit_s=0.0 if is_wall_timeout else _SELF_EXIT_WAIT_S)
        output_wait_s = _LIVE_OUTPUT_WAIT_S if is_alive else _DEAD_OUTPUT_WAIT_S
        await asyncio.gather(*(reader.wait_closed(output_wait_s) for reader in readers))
        stdout, stderr = readers
        return ExecutionOutcome(
            report=report,
            stdout=stdout.data,
            stdout_total_bytes=stdout.total_bytes,
            stderr=stderr.data,
            stderr_total_bytes=stderr.total_bytes,
            is_wall_timeout=is_wall_timeout,
            exit_status=exit_status,
            wall_time_s=wall_time_s,
            is_alive=is_alive,
        )

    def _send_header_with_pipes(
        self, payload_size: int, max_output_bytes: int
    ) -> tuple[CappedReader, CappedReader]:
        """Send the request header with fresh stdout/stderr pipes; return readers of their read ends."""
        stdout_read, stdout_write = os.pipe()
        stderr_read, stderr_write = os.pipe()
        try:
            fds = array.array("i", [stdout_write, stderr_write])
            with contextlib.suppress(OSError):  # a dead runner shows up as EOF on the report
                self._control.sendmsg(
                    [_HEADER.pack(payload_size)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
                )
        finally:
            os.close(stdout_write)
            os.close(stderr_write)
        return CappedReader(stdout_read, max_output_bytes), CappedReader(stderr_read, max_output_bytes)

    async def _send_and_receive(self, payload: bytes) -> dict[str, Any]:
        await asyncio.get_running_loop().sock_sendall(self._control, payload)
        report = await self._receive_report()
        if report.get("kind") not in ("done", "runner_error"):
            raise ValueError(f"unexpected report kind {report.get('kind')!r}")
        return report

    async def _receive_report(self) -> dict[str, Any]:
        (size,) = _HEADER.unpack(await self._receive_exactly(_HEADER.size))
        if size > _MAX_REPORT_BYTES:
            raise ValueError(f"report of {size} bytes is over the {_MAX_REPORT_BYTES} byte limit")
        report = json.loads(await self._receive_exactly(size))
        if not isinstance(report, dict):
            raise ValueError("report is not a JSON object")
        return report

    async def _receive_exactly(self, size: int) -> bytes:
        loop = asyncio.get_running_loop()
        buffer = bytearray()
        while len(buffer) < size:
            chunk = await loop.sock_recv(self._control, min(size - len(buffer), 1 << 20))
            if not chunk:
                raise _ControlClosed()
            buffer += chunk
        return bytes(buffer)

    async def _end(self, wait_for_exit_s: float) -> int:
        """Finish the sandbox after its last request. A runner that exits by itself gets a moment
        to take the sandbox down, so that its own exit status (e.g. 128+SIGXCPU) is kept."""
        if wait_for_exit_s > 0 and self._process.returncode is None:
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._process.wait()), wait_for_exit_s)
        return await self.close()

    def kill_soon(self) -> None:
        """Kill now and reap in the background (for cancellation paths that cannot await)."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._kill_and_wait())

    async def close(self) -> int:
        """Kill the sandbox (no-op if it already exited), wait for it, free its uid. Idempotent."""
        self.kill_soon()
        assert self._closing is not None
        return await asyncio.shield(self._closing)

    async def _kill_and_wait(self) -> int:
        if self._process.returncode is None and self._init_pidfd is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signal.pidfd_send_signal(self._init_pidfd, signal.SIGKILL)
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._process.wait()), _SELF_EXIT_WAIT_S)
        if self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._process.pid, signal.SIGKILL)
        # Hang up before waiting: a sandbox PID 1 that outlived the kill (killed before it armed
        # --die-with-parent, outside our process group) ends when its runner reads end-of-file, and
        # only then does the stderr pipe close, which asyncio's wait() needs.
        self._control.close()
        status = await self._process.wait()
        if self._init_pidfd is not None:
            await _wait_readable(self._init_pidfd, _DEAD_OUTPUT_WAIT_S)
            os.close(self._init_pidfd)
            self._init_pidfd = None
        self._on_exit()
        return status


def _open_init_pidfd(info_fd: int) -> int | None:
    """A pidfd of the sandbox's PID 1, from bwrap's --info-fd JSON (written before the runner
    started, so before it said ready; PID 1 is alive until the runner exits, so no pid reuse)."""
    os.set_blocking(info_fd, False)
    try:
        return os.pidfd_open(int(json.loads(os.read(info_fd, 65536))["child-pid"]))
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("no pidfd of the sandbox's PID 1 (%s); killing by process group instead", error)
        return None


async def _wait_readable(fd: int, timeout_s: float) -> None:
    """Wait until `fd` polls readable (a pidfd: its process has exited), at most `timeout_s`."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout_s)
    except TimeoutError:
        logger.warning("a killed sandbox's PID 1 was still alive after %.1f s", timeout_s)
    finally:
        loop.remove_reader(fd)
