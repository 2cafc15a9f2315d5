"""The local sandbox as the agent loop uses it: results, limits, stdin/files, sessions, pool."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.tools.conftest import REPO_ROOT, SMALL_LIMITS, child_pids, pids_with_cmdline
from tools.base import ToolCall, ToolUnavailableError
from tools.sandbox._bwrap import build_bwrap_argv, probe_interpreter
from tools.sandbox.local_sandbox import LocalPythonSandbox
from tools.settings import LocalSandboxSettings


async def test_print_returns_ok_with_stdout_and_timings(sandbox: LocalPythonSandbox) -> None:
    result = await sandbox.run(ToolCall(code="print(6 * 7)"))
    assert (result.status, result.stdout, result.stderr, result.exit_code) == ("ok", "42\n", "", 0)
    assert result.message == ""
    assert 0 < result.wall_time_s < SMALL_LIMITS.timeout_s
    assert result.cpu_time_s is not None and result.cpu_time_s >= 0


async def test_exception_is_an_error_whose_message_is_the_exception_line(sandbox: LocalPythonSandbox) -> None:
    result = await sandbox.run(ToolCall(code="x = 1\n\ndef f():\n    return 1 / 0\n\nf()"))
    assert result.status == "error" and result.exit_code == 1
    assert result.message == "ZeroDivisionError: division by zero"
    # The traceback shows the model's code with line numbers, not the runner's frames.
    assert 'File "<code>", line 6' in result.stderr and "return 1 / 0" in result.stderr
    assert "_sandbox_runner" not in result.stderr and "<string>" not in result.stderr


async def test_syntax_error_is_an_error(sandbox: LocalPythonSandbox) -> None:
    result = await sandbox.run(ToolCall(code="def f(:\n  pass"))
    assert result.status == "error" and result.message.startswith("SyntaxError")


@pytest.mark.parametrize(
    ("code", "exit_code"), [("import sys; sys.exit(3)", 3), ("import os; os._exit(5)", 5)]
)
async def test_exit_status_is_reported(sandbox: LocalPythonSandbox, code: str, exit_code: int) -> None:
    result = await sandbox.run(ToolCall(code=code))
    assert (result.status, result.exit_code) == ("error", exit_code)


async def test_stdin_and_files_in_and_out(sandbox: LocalPythonSandbox) -> None:
    code = "data = open('in/data.txt').read()\nopen('out.txt', 'w').write(data + input())\nprint('done')"
    call = ToolCall(
        code=code, stdin="!\n", files={"in/data.txt": b"abc"}, fetch_files=("out.txt", "missing.txt")
    )
    result = await sandbox.run(call)
    assert (result.status, result.stdout) == ("ok", "done\n")
    assert result.files == {"out.txt": b"abc!"}  # missing files are simply absent


async def test_preamble_runs_before_the_code() -> None:
    settings = SMALL_LIMITS.model_copy(update={"preamble": "def final_answer(x):\n    print('ANSWER', x)\n"})
    async with LocalPythonSandbox(settings) as tool:
        result = await tool.run(ToolCall(code="final_answer(3 + 4)"))
    assert result.stdout == "ANSWER 7\n"


async def test_bash_runs_in_the_same_sandbox(sandbox: LocalPythonSandbox) -> None:
    code = f"echo $HOME; pwd; cat {REPO_ROOT / 'pyproject.toml'} 2>&1; exit 4"
    result = await sandbox.run(ToolCall(code=code, language="bash"))
    lines = result.stdout.splitlines()
    assert lines[:2] == ["/tmp", "/tmp"]
    assert "No such file or directory" in lines[2]  # the repository is not visible
    assert (result.status, result.exit_code) == ("error", 4)


async def test_installed_packages_of_the_running_interpreter_are_importable(
    sandbox: LocalPythonSandbox,
) -> None:
    pytest.importorskip("numpy")
    result = await sandbox.run(ToolCall(code="import numpy as np\nprint(int(np.arange(5).sum()))"))
    assert (result.status, result.stdout) == ("ok", "10\n")


async def test_vcpo_source_is_not_importable_inside(sandbox: LocalPythonSandbox) -> None:
    result = await sandbox.run(ToolCall(code="import tools"))
    assert result.status == "error" and "ModuleNotFoundError" in result.message


async def test_call_timeout_can_lower_but_not_raise_the_limit(sandbox: LocalPythonSandbox) -> None:
    lowered = await sandbox.run(ToolCall(code="import time; time.sleep(30)", timeout_s=0.5))
    assert lowered.status == "timeout" and 0.45 <= lowered.wall_time_s < 1.5
    assert lowered.exit_code is None and "0.5 s" in lowered.message
    raised = await sandbox.run(ToolCall(code="import time; time.sleep(30)", timeout_s=100))
    assert raised.status == "timeout" and raised.wall_time_s < SMALL_LIMITS.timeout_s + 1


async def test_output_beyond_the_cap_is_truncated_with_a_marker(sandbox: LocalPythonSandbox) -> None:
    result = await sandbox.run(ToolCall(code="print('a' * 10000)"))
    assert result.status == "output_truncated" and result.is_stdout_truncated
    assert result.stdout.startswith("a" * 4096)
    # 10000 'a' plus a newline were written; the first 4096 bytes are kept.
    assert "[output truncated: showing the first 4096 of 10001 bytes]" in result.stdout


async def test_output_written_before_a_timeout_is_kept(sandbox: LocalPythonSandbox) -> None:
    result = await sandbox.run(ToolCall(code="print('started')\nwhile True: pass", timeout_s=0.5))
    assert (result.status, result.stdout) == ("timeout", "started\n")


async def test_calls_run_concurrently_up_to_max_concurrency() -> None:
    settings = SMALL_LIMITS.model_copy(update={"max_concurrency": 2})
    async with LocalPythonSandbox(settings) as tool:
        call = ToolCall(code="import time; start = time.time(); time.sleep(0.4); print(start, time.time())")
        results = await asyncio.gather(*(tool.run(call) for _ in range(4)))
    assert [r.status for r in results] == ["ok"] * 4
    # when each call's code ran (the host's clock, read inside the sandbox): never more than 2 at once, and 2
    # at once at some point — whatever else loads the machine (a wall-time bound flaked under load)
    intervals = [tuple(map(float, r.stdout.split())) for r in results]
    running = [sum(start <= moment < end for start, end in intervals) for moment, _ in intervals]
    assert max(running) == 2


async def test_warm_pool_serves_calls_from_started_sandboxes() -> None:
    settings = SMALL_LIMITS.model_copy(update={"warm_pool_size": 2})
    async with LocalPythonSandbox(settings) as tool:
        await tool.wait_for_warm_pool()
        for _ in range(3):
            assert (await tool.run(ToolCall(code="print(1)"))).status == "ok"
            await tool.wait_for_warm_pool()
        metrics = tool.metrics()
    assert metrics["tools/python_warm_pool_hits"] == 3 and metrics["tools/python_warm_pool_misses"] == 0


def _orphaned_sandboxes() -> set[int]:
    """bwrap processes whose parent is gone (reparented to PID 1): a sandbox nobody will ever close."""
    return {pid for pid in pids_with_cmdline("bwrap") if pid in child_pids(1)}


async def test_closing_the_tool_while_sandboxes_start_neither_hangs_nor_leaves_one_running() -> None:
    """Closing cancels the warm pool's starts at any point of a sandbox's start-up — before its PID 1
    has armed --die-with-parent, before it is ready — and each must still end, its stderr pipe closed,
    or asyncio's wait() for it never returns."""
    before = _orphaned_sandboxes()
    settings = SMALL_LIMITS.model_copy(update={"warm_pool_size": 4})
    for _ in range(15):
        async with asyncio.timeout(30):
            async with LocalPythonSandbox(settings):
                await asyncio.sleep(0)  # close while the pool's four starts are in flight
    deadline = time.monotonic() + 5.0
    while _orphaned_sandboxes() - before and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not _orphaned_sandboxes() - before


async def test_each_call_gets_a_fresh_interpreter_and_work_dir(sandbox: LocalPythonSandbox) -> None:
    listing = "import os\nprint('x' in globals(), sorted(os.listdir('.')))"
    # A fresh sandbox's work dir is empty, except for mount points of read-only binds when the
    # interpreter itself lives under /tmp (e.g. a checkout's venv in /tmp/...).
    fresh = await sandbox.run(ToolCall(code=listing))
    await sandbox.run(ToolCall(code="x = 1\nopen('left_behind.txt', 'w').write('x')"))
    result = await sandbox.run(ToolCall(code=listing))
    assert result.stdout == fresh.stdout
    assert result.stdout.startswith("False ") and "left_behind.txt" not in result.stdout


async def test_session_keeps_variables_between_calls(sandbox: LocalPythonSandbox) -> None:
    async with sandbox.session() as session:
        first = await session.run(ToolCall(code="total = 40\nopen('notes.txt', 'w').write('kept')"))
        second = await session.run(ToolCall(code="total += 2\nprint(total, open('notes.txt').read())"))
    assert first.status == "ok" and second.stdout == "42 kept\n"
    assert not second.is_session_reset


async def test_session_timeout_resets_the_session(sandbox: LocalPythonSandbox) -> None:
    async with sandbox.session() as session:
        await session.run(ToolCall(code="x = 1"))
        timed_out = await session.run(ToolCall(code="while True: pass", timeout_s=0.5))
        after = await session.run(ToolCall(code="print('x' in globals())"))
    assert timed_out.status == "timeout" and timed_out.is_session_reset
    assert "session was reset" in timed_out.message
    assert (after.status, after.stdout, after.is_session_reset) == ("ok", "False\n", False)


async def test_session_survives_an_exception_and_a_memory_error(sandbox: LocalPythonSandbox) -> None:
    async with sandbox.session() as session:
        await session.run(ToolCall(code="x = 5"))
        error = await session.run(ToolCall(code="1 / 0"))
        memory = await session.run(ToolCall(code="b = bytearray(4 * 1024**3)"))
        after = await session.run(ToolCall(code="print(x)"))
    assert (error.status, memory.status) == ("error", "memory")
    assert not (error.is_session_reset or memory.is_session_reset)
    assert after.stdout == "5\n"


async def test_session_preamble_runs_once_per_interpreter() -> None:
    settings = SMALL_LIMITS.model_copy(update={"preamble": "count = globals().get('count', 0) + 1\n"})
    async with LocalPythonSandbox(settings) as tool, tool.session() as session:
        await session.run(ToolCall(code="pass"))
        result = await session.run(ToolCall(code="print(count)"))
    assert result.stdout == "1\n"


async def test_cancelling_a_call_kills_its_sandbox(sandbox: LocalPythonSandbox) -> None:
    marker = "7011.5"
    task = asyncio.create_task(
        sandbox.run(ToolCall(code=f"import subprocess; subprocess.run(['sleep', '{marker}'])"))
    )
    await asyncio.sleep(0.5)
    assert pids_with_cmdline(marker), "the snippet should be running"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not pids_with_cmdline(marker)


async def test_tool_refuses_to_start_without_bubblewrap_and_says_how_to_install() -> None:
    settings = LocalSandboxSettings(bwrap_path="/nonexistent/bwrap")
    with pytest.raises(
        ToolUnavailableError, match=r"apt-get install bubblewrap.*use_unsafe_unisolated_execution"
    ):
        async with LocalPythonSandbox(settings):
            pass


async def test_unisolated_mode_needs_the_explicit_setting_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    settings = SMALL_LIMITS.model_copy(
        update={"use_unsafe_unisolated_execution": True, "bwrap_path": "/nonexistent"}
    )
    with caplog.at_level(logging.WARNING):
        async with LocalPythonSandbox(settings) as tool:
            result = await tool.run(
                ToolCall(code="import os; print(os.getcwd().startswith('/tmp/vcpo-unisolated-'))")
            )
    assert result.stdout == "True\n"
    assert any("UNSAFE" in record.message for record in caplog.records)


def test_bwrap_command_binds_only_what_the_interpreter_needs() -> None:
    layout = asyncio.run(probe_interpreter(None))
    argv = build_bwrap_argv("bwrap", layout, SMALL_LIMITS, is_root=True, seccomp_fd=9, command=["python"])
    sources = {argv[i + 1] for i, arg in enumerate(argv) if arg in ("--ro-bind", "--bind", "--ro-bind-try")}
    assert "/" not in sources and str(Path.home()) not in sources and "/root" not in sources
    assert not any(source in (str(REPO_ROOT), str(REPO_ROOT.parent)) for source in sources)
    assert "--bind" not in argv and "--dev-bind" not in argv  # nothing of the host is writable
    assert {"--unshare-net", "--unshare-pid", "--die-with-parent", "--new-session", "--clearenv"} <= set(argv)
    assert argv[argv.index("--seccomp") + 1] == "9"
    work_dir = ["--size", str(8 << 20), "--perms", "01777", "--tmpfs", "/tmp"]
    assert any(argv[i : i + len(work_dir)] == work_dir for i in range(len(argv)))


def test_sandboxes_die_with_their_parent_process(tmp_path: Path) -> None:
    """SIGKILL the process that owns a sandbox: the sandboxed code must die with it."""
    marker = "7022.5"
    script = tmp_path / "owner.py"
    script.write_text(
        "import asyncio\n"
        "from tools.base import ToolCall\n"
        "from tools.sandbox.local_sandbox import LocalPythonSandbox\n"
        "async def main():\n"
        "    async with LocalPythonSandbox() as tool:\n"
        f"        code = \"import subprocess; subprocess.run(['sleep', '{marker}'])\"\n"
        "        await tool.run(ToolCall(code=code))\n"
        "asyncio.run(main())\n"
    )
    owner = subprocess.Popen([sys.executable, str(script)], cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 20
        while not pids_with_cmdline(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pids_with_cmdline(marker), "the sandboxed snippet never started"
    finally:
        owner.kill()
        owner.wait()
    deadline = time.monotonic() + 5
    while pids_with_cmdline(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pids_with_cmdline(marker)
    assert owner.pid not in child_pids(os.getpid())


async def test_cpu_time_limit_is_a_timeout_distinct_from_the_wall_clock() -> None:
    settings = SMALL_LIMITS.model_copy(update={"timeout_s": 10.0, "cpu_time_limit_s": 1})
    async with LocalPythonSandbox(settings) as tool:
        result = await tool.run(ToolCall(code="while True: pass"))
    assert result.status == "timeout" and result.exit_code == 128 + 24  # SIGXCPU
    assert result.message.startswith("CPU time limit of 1 s exceeded") and result.wall_time_s < 5


async def test_an_interpreter_inside_tmp_is_not_hidden_by_the_private_tmp() -> None:
    """A checkout (and its venv) under /tmp: the sandbox's own tmpfs at /tmp must not shadow it."""

    root = Path(tempfile.mkdtemp(prefix="vcpo-venv-", dir="/tmp"))
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
        settings = SMALL_LIMITS.model_copy(update={"interpreter": str(root / "venv" / "bin" / "python")})
        async with LocalPythonSandbox(settings) as tool:
            result = await tool.run(ToolCall(code="import sys; print(sys.executable)"))
        assert result.status == "ok", result
        assert result.stdout.strip() == str(root / "venv" / "bin" / "python")
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_a_sandbox_that_dies_at_start_fails_fast_not_at_the_timeout() -> None:
    settings = SMALL_LIMITS.model_copy(update={"bwrap_path": "/bin/false", "startup_timeout_s": 120.0})
    started = time.monotonic()
    with pytest.raises(ToolUnavailableError, match="did not start"):
        async with LocalPythonSandbox(settings):
            pass
    assert time.monotonic() - started < 60  # end-of-file on the control socket, not the 120 s timeout


async def test_waiting_for_a_warm_pool_whose_starts_fail_returns() -> None:
    from tools.sandbox._warm_pool import WarmPool

    attempts = 0

    async def failing_start() -> Any:
        nonlocal attempts
        attempts += 1
        raise ToolUnavailableError("no sandbox today")

    async with WarmPool(failing_start, 2, 2) as pool:
        await asyncio.wait_for(pool.wait_until_settled(), timeout=30)
    assert attempts >= 1
