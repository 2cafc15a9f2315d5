"""Turns what a sandbox did (`ExecutionOutcome`) into the `ToolResult` the model sees.

Pure function, no I/O. Status precedence: timeout > memory > error > output_truncated > ok.
A MemoryError is `memory`. Death by SIGKILL that we did not send is `error` with a message that
names the possible causes: without a memory cgroup the kernel's OOM killer cannot be told apart
from the code killing itself; RLIMIT_AS makes allocations fail (MemoryError) long before that.
"""

from __future__ import annotations

import base64
import signal

from tools._output import decode_capped, last_line
from tools.base import ToolResult, ToolStatus
from tools.sandbox._sandbox_process import ExecutionOutcome

_MAX_MESSAGE_CHARS = 600
_RESET_NOTE = " The session was reset: variables from earlier calls are gone."


def outcome_to_result(
    outcome: ExecutionOutcome,
    *,
    timeout_s: float,
    cpu_time_limit_s: int,
    memory_limit_mb: int,
    is_session: bool,
) -> ToolResult:
    is_session_reset = is_session and not outcome.is_alive
    stdout = decode_capped(outcome.stdout, outcome.stdout_total_bytes)
    stderr = decode_capped(outcome.stderr, outcome.stderr_total_bytes)
    is_truncated = outcome.stdout_total_bytes > len(outcome.stdout) or outcome.stderr_total_bytes > len(
        outcome.stderr
    )
    report = outcome.report
    files: dict[str, bytes] = {}
    cpu_time_s: float | None = None
    exit_code: int | None
    if outcome.is_wall_timeout:
        status: ToolStatus = "timeout"
        exit_code = None
        message = f"Timed out after {timeout_s:g} s (wall clock); all of its processes were killed."
    elif report is None:
        exit_code = outcome.exit_status
        status, message = _classify_exit_without_report(exit_code, cpu_time_limit_s)
    elif report["kind"] == "runner_error":
        status, exit_code = "error", None
        message = f"The sandbox could not run the code: {report['message']}"
    else:
        exit_code = int(report["exit_code"])
        cpu_time_s = float(report["cpu_time_s"])
        files = {path: base64.b64decode(content) for path, content in report["files"].items()}
        if report["is_memory_error"]:
            status = "memory"
            message = (
                f"Out of memory ({report['exception']}); the limit is {memory_limit_mb} MiB per process."
            )
        elif exit_code != 0:
            status, message = "error", last_line(stderr) or f"Exited with status {exit_code}."
        else:
            status, message = "ok", ""
    if status == "ok" and is_truncated:
        status, message = "output_truncated", "The output was too long and was truncated."
    if is_session_reset:
        message += _RESET_NOTE
    return ToolResult(
        status=status,
        stdout=stdout,
        stderr=stderr,
        exit_code=exit_code,
        wall_time_s=outcome.wall_time_s,
        cpu_time_s=cpu_time_s,
        is_stdout_truncated=outcome.stdout_total_bytes > len(outcome.stdout),
        is_stderr_truncated=outcome.stderr_total_bytes > len(outcome.stderr),
        message=message.strip()[:_MAX_MESSAGE_CHARS],
        files=files,
        is_session_reset=is_session_reset,
    )


def _classify_exit_without_report(exit_status: int | None, cpu_time_limit_s: int) -> tuple[ToolStatus, str]:
    """The runner ended without a report: the code called os._exit, or a signal killed it.
    bwrap exits with 128+N when its child died of signal N; a negative status is a signal that
    hit the process we started itself (unisolated mode)."""
    if exit_status is None:
        return "error", "The sandbox ended without a report."
    signal_number = exit_status - 128 if exit_status > 128 else -exit_status if exit_status < 0 else None
    if signal_number is None:
        if exit_status == 0:
            return "ok", ""
        return "error", f"Exited with status {exit_status}."
    if signal_number == signal.SIGXCPU:
        return "timeout", f"CPU time limit of {cpu_time_limit_s} s exceeded; the process was killed."
    name = _signal_name(signal_number)
    if signal_number == signal.SIGKILL:
        return "error", (
            "Killed by SIGKILL (by the code itself, by the CPU-time hard limit, "
            "or by the kernel for lack of memory)."
        )
    return "error", f"Killed by signal {name}."


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)
