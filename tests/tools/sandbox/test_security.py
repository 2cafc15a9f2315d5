"""Hostile snippets against the local sandbox: each is contained, with a specific result, and the
test process is unharmed.

Every case runs in a fresh sandbox with small limits (tests/tools/conftest.py: 3 s, 512 MiB,
16 processes, 32 files, 4 MiB files, 8 MiB work dir, 4 KiB output). Besides its own check, every
case must leave: no connection on the loopback listener and the abstract socket this test opened,
the sentinel file unchanged, no probe files in home or the repository, the test's secret
environment variable out of all output, the test process's children as before, and (as root) no
process left running under a sandbox uid.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.tools.conftest import REPO_ROOT, SMALL_LIMITS, child_pids, pids_with_cmdline, pids_with_uid_in
from tools.base import ToolCall, ToolResult
from tools.sandbox.local_sandbox import LocalPythonSandbox
from tools.settings import LocalSandboxSettings

SECRET_NAME = "VCPO_TEST_SECRET"


@pytest.fixture
def sandbox_settings() -> LocalSandboxSettings:
    """The small limits on a uid range no other test uses: the leftover check scans the whole machine
    for processes under these uids, and other test files' sandboxes run beside this one."""
    return SMALL_LIMITS.model_copy(update={"sandbox_uid_base": 3_000_000, "sandbox_uid_count": 4096})


@dataclass
class Probe:
    """What the host side prepared for a case to attack."""

    listener: socket.socket
    abstract_listener: socket.socket
    abstract_name: str
    secret: str
    sentinel: Path
    sentinel_content: bytes
    home_probe: Path
    repo_probe: Path
    test_pid: int

    @property
    def port(self) -> int:
        return self.listener.getsockname()[1]


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Probe]:
    token = secrets.token_hex(8)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    abstract_name = f"vcpo-test-{token}"
    abstract_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    abstract_listener.bind("\0" + abstract_name)
    abstract_listener.listen(8)
    abstract_listener.setblocking(False)
    secret = f"secret-{token}"
    monkeypatch.setenv(SECRET_NAME, secret)
    sentinel = tmp_path / "sentinel.txt"
    sentinel.write_bytes(b"do not touch " + token.encode())
    probe = Probe(
        listener=listener,
        abstract_listener=abstract_listener,
        abstract_name=abstract_name,
        secret=secret,
        sentinel=sentinel,
        sentinel_content=sentinel.read_bytes(),
        home_probe=Path.home() / f".vcpo_probe_{token}",
        repo_probe=REPO_ROOT / f".vcpo_probe_{token}",
        test_pid=os.getpid(),
    )
    yield probe
    listener.close()
    abstract_listener.close()
    for path in (probe.home_probe, probe.repo_probe):
        path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Case:
    name: str
    code: Callable[[Probe], str]
    check: Callable[[ToolResult, Probe], None]
    language: str = "python"
    timeout_s: float | None = None


def _try(statement: str) -> str:
    """Code that runs `statement` and prints the exception type and errno, or 'no error'."""
    return (
        f"try:\n    {statement}\n    print('no error')\n"
        "except Exception as error:\n    print(type(error).__name__, getattr(error, 'errno', None))\n"
    )


def _prints(*expected: str) -> Callable[[ToolResult, Probe], None]:
    """The call succeeded and printed one of `expected` (alternatives differ by kernel or layout)."""

    def check(result: ToolResult, probe: Probe) -> None:
        assert result.status == "ok" and result.stdout in expected, result

    return check


def _absent(path_of: Callable[[Probe], Path], *expected: str) -> Callable[[ToolResult, Probe], None]:
    def check(result: ToolResult, probe: Probe) -> None:
        _prints(*expected)(result, probe)
        assert not path_of(probe).exists()

    return check


def _status(status: str, *, max_wall_s: float | None = None) -> Callable[[ToolResult, Probe], None]:
    def check(result: ToolResult, probe: Probe) -> None:
        assert result.status == status, result
        if max_wall_s is not None:
            assert result.wall_time_s < max_wall_s

    return check


def _count_below(limit: int) -> Callable[[ToolResult, Probe], None]:
    def check(result: ToolResult, probe: Probe) -> None:
        assert result.status == "ok", result
        assert 0 < int(result.stdout.split()[-1]) < limit, result.stdout

    return check


def _bash_bomb_capped(result: ToolResult, probe: Probe) -> None:
    # The copies multiply in the background until the process cap stops them; the shell in front
    # times out (or gives up when even `sleep` cannot fork). The sandbox dies with the call.
    assert result.status == "timeout" or "Resource temporarily unavailable" in result.stderr, result
    assert result.wall_time_s < 3.0


def _secret_absent(result: ToolResult, probe: Probe) -> None:
    assert result.status == "ok", result
    assert SECRET_NAME not in result.stdout and probe.secret not in result.stdout


def _flood_truncated(stream: str) -> Callable[[ToolResult, Probe], None]:
    def check(result: ToolResult, probe: Probe) -> None:
        text = getattr(result, stream)
        assert result.status == "output_truncated" and getattr(result, f"is_{stream}_truncated")
        assert len(text) < 4096 + 200 and "of 100000000 bytes]" in text

    return check


FORK_COUNT = """
import os, time
count = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    count += 1
print('forked', count)
"""

THREAD_COUNT = """
import threading, time
count = 0
try:
    while True:
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
        count += 1
except RuntimeError:
    pass
print('threads', count)
"""

FILL = """
import os
index = 0
try:
    while True:
        with open(f'{directory}/fill{{index}}', 'wb') as handle:
            for _ in range(3):
                handle.write(b'x' * (1 << 20))
        index += 1
except OSError as error:
    print('stopped with errno', error.errno)
"""

OPEN_FILES = """
handles = []
try:
    while True:
        handles.append(open('/dev/null'))
except OSError as error:
    print('errno', error.errno, 'after', len(handles))
    assert error.errno == 24
"""

CASES = [
    # --- network ---
    Case(
        "connect_to_host_loopback_listener",
        lambda p: _try(f"__import__('socket').create_connection(('127.0.0.1', {p.port}), timeout=2)"),
        _prints("ConnectionRefusedError 111\n"),
    ),
    Case(
        "connect_to_host_abstract_unix_socket",
        lambda p: (
            "import socket\ns = socket.socket(socket.AF_UNIX)\n" + _try(f"s.connect('\\0{p.abstract_name}')")
        ),
        _prints("ConnectionRefusedError 111\n"),
    ),
    Case(
        "only_an_isolated_loopback_interface",
        lambda p: "import socket\nprint(sorted(name for _, name in socket.if_nameindex()))",
        _prints("['lo']\n"),
    ),
    Case(
        "dns_lookup",
        lambda p: _try("__import__('socket').getaddrinfo('vcpo-sandbox-test.invalid', 80)"),
        _prints("gaierror -3\n", "gaierror -2\n"),
    ),
    # --- filesystem ---
    Case("write_to_root", lambda p: _try("open('/evil.txt', 'w')"), _prints("OSError 30\n")),
    Case("write_to_usr", lambda p: _try("open('/usr/evil.txt', 'w')"), _prints("OSError 30\n")),
    Case(
        "write_to_home",
        lambda p: _try(f"open({str(p.home_probe)!r}, 'w').write('x')"),
        _absent(lambda p: p.home_probe, "OSError 30\n", "FileNotFoundError 2\n"),
    ),
    Case(
        "write_into_the_repository",
        lambda p: _try(f"open({str(p.repo_probe)!r}, 'w').write('x')"),
        # PermissionError: a checkout under /tmp has its path present as root-owned mount points.
        _absent(lambda p: p.repo_probe, "OSError 30\n", "FileNotFoundError 2\n", "PermissionError 13\n"),
    ),
    Case(
        "overwrite_a_host_sentinel_file",
        lambda p: _try(f"open({str(p.sentinel)!r}, 'w').write('pwned')"),
        _prints("FileNotFoundError 2\n"),
    ),
    Case(
        "read_repository_source",
        lambda p: _try(f"open({str(REPO_ROOT / 'pyproject.toml')!r}).read()"),
        _prints("FileNotFoundError 2\n"),
    ),
    Case(
        "symlink_escape_to_host_file",
        lambda p: (
            "import os\nos.symlink('/', 'up')\n" + _try(f"open('up/{str(p.sentinel).lstrip('/')}').read()")
        ),
        _prints("FileNotFoundError 2\n"),
    ),
    Case(
        "proc_root_escape",
        lambda p: _try(f"open('/proc/1/root{p.sentinel}').read()"),
        _prints("PermissionError 13\n", "FileNotFoundError 2\n"),
    ),
    Case(
        "no_sys_filesystem", lambda p: "import os\nprint(os.path.exists('/sys/kernel'))", _prints("False\n")
    ),
    Case("write_to_dev", lambda p: _try("open('/dev/evil', 'w')"), _prints("OSError 30\n")),
    # --- secrets ---
    Case("read_environment", lambda p: "import os\nprint(dict(os.environ))", _secret_absent),
    Case(
        "read_proc_1_environ",
        lambda p: "import os\n" + _try("print(open('/proc/1/environ', 'rb').read())"),
        _secret_absent,
    ),
    Case(
        "read_parent_environ",
        lambda p: "import os\n" + _try("print(open(f'/proc/{os.getppid()}/environ', 'rb').read())"),
        _secret_absent,
    ),
    Case(
        "shell_echoes_the_secret",
        lambda p: f'echo "secret=${SECRET_NAME}"; env',
        lambda r, p: (_secret_absent(r, p), "secret=\n" in r.stdout or pytest.fail(r.stdout)),
        language="bash",
    ),
    # --- processes ---
    Case(
        "fork_bomb",
        lambda p: "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        _status("timeout", max_wall_s=3.0),
        timeout_s=1.5,
    ),
    Case("bash_fork_bomb", lambda p: ":(){ :|:& };:; sleep 10", _bash_bomb_capped, "bash", 1.5),
    Case("fork_count_is_capped", lambda p: FORK_COUNT, _count_below(SMALL_LIMITS.max_processes)),
    Case("thread_bomb_is_capped", lambda p: THREAD_COUNT, _count_below(SMALL_LIMITS.max_processes)),
    Case(
        "spawn_shell_that_looks_around",
        lambda p: (
            "import subprocess\nprint(subprocess.run(['sh', '-c', 'ls /proc | grep -c ^[0-9]; ls /home'], "
            "capture_output=True, text=True).stdout.split())"
        ),
        # The shell runs, sees only the sandbox's own handful of processes, and no /home.
        lambda r, p: (r.status == "ok" and int(r.stdout.split("'")[1]) < 8) or pytest.fail(str(r)),
    ),
    Case(
        "signal_the_test_process",
        lambda p: _try(f"__import__('os').kill({p.test_pid}, {int(signal.SIGTERM)})"),
        _prints("ProcessLookupError 3\n"),
    ),
    Case(
        "kill_the_parent",
        lambda p: "import os\n" + _try("os.kill(os.getppid(), 9)") + "print('survived')",
        # As root the sandbox's PID 1 belongs to another uid; unprivileged, PID 1 ignores the signal.
        _prints("PermissionError 1\nsurvived\n", "no error\nsurvived\n"),
    ),
    Case(
        "kill_every_process_it_can",
        # kill(-1) spares PID 1 and the caller; in its own PID namespace nothing else is there.
        lambda p: "import os\n" + _try("os.kill(-1, 9)") + "print('survived')",
        _prints("ProcessLookupError 3\nsurvived\n"),
    ),
    Case("become_root", lambda p: _try("__import__('os').setuid(0)"), _prints("PermissionError 1\n")),
    Case(
        "create_a_user_namespace",
        lambda p: (
            "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "print(libc.unshare(0x10000000), os.strerror(ctypes.get_errno()))"
        ),
        # EPERM from the seccomp filter (as root) or ENOSPC from bwrap's --disable-userns.
        _prints("-1 Operation not permitted\n", "-1 No space left on device\n"),
    ),
    Case(
        "leftover_background_process",
        lambda p: (
            "import subprocess\nsubprocess.Popen(['sleep', '7033.5'], start_new_session=True, "
            "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
            "print('spawned')"
        ),
        lambda r, p: (
            _prints("spawned\n")(r, p),
            not pids_with_cmdline("7033.5") or pytest.fail("sleep survived"),
        ),
    ),
    # --- resources ---
    Case("memory_bomb_one_allocation", lambda p: "x = bytearray(8 << 30)", _status("memory")),
    Case(
        "memory_bomb_growing",
        lambda p: "chunks = []\nwhile True:\n    chunks.append(b'x' * (32 << 20))",
        _status("memory", max_wall_s=3.0),
    ),
    Case(
        "shared_anonymous_mmap_bomb",
        lambda p: _try("__import__('mmap').mmap(-1, 4 << 30)"),
        _prints("OSError 12\n"),
    ),
    Case("cpu_spin", lambda p: "while True:\n    pass", _status("timeout", max_wall_s=2.5), timeout_s=1.0),
    Case(
        "sleep_forever",
        lambda p: "import time\ntime.sleep(10**9)",
        _status("timeout", max_wall_s=2.5),
        timeout_s=1.0,
    ),
    Case(
        "stdout_flood_100mb",
        lambda p: "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)",
        _flood_truncated("stdout"),
    ),
    Case(
        "stderr_flood_100mb",
        lambda p: "import os\nfor _ in range(100):\n    os.write(2, b'e' * 1_000_000)",
        _flood_truncated("stderr"),
    ),
    Case("disk_fill_work_dir", lambda p: FILL.format(directory="."), _prints("stopped with errno 28\n")),
    Case(
        "disk_fill_dev_shm", lambda p: FILL.format(directory="/dev/shm"), _prints("stopped with errno 28\n")
    ),
    Case(
        "file_over_the_size_limit",
        lambda p: _try("open('big', 'wb').write(b'x' * (5 << 20))"),
        _prints("OSError 27\n"),
    ),
    Case("too_many_open_files", lambda p: OPEN_FILES, _count_below(SMALL_LIMITS.max_open_files)),
]


def _host_state(tool: LocalPythonSandbox) -> tuple[set[int], set[int]]:
    uids = tool.launcher.uids
    sandbox_pids = (
        pids_with_uid_in(tool.settings.sandbox_uid_base, tool.settings.sandbox_uid_count) if uids else set()
    )
    return child_pids(os.getpid()), sandbox_pids


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
async def test_hostile_snippet_is_contained(case: Case, sandbox: LocalPythonSandbox, probe: Probe) -> None:
    children_before, _ = _host_state(sandbox)
    result = await sandbox.run(
        ToolCall(code=case.code(probe), language=case.language, timeout_s=case.timeout_s)
    )
    case.check(result, probe)
    # The common guarantees:
    with pytest.raises(BlockingIOError):
        probe.listener.accept()
    with pytest.raises(BlockingIOError):
        probe.abstract_listener.accept()
    assert probe.sentinel.read_bytes() == probe.sentinel_content
    assert not probe.home_probe.exists() and not probe.repo_probe.exists()
    assert probe.secret not in result.stdout + result.stderr + result.message
    children_after, leftovers = _host_state(sandbox)
    assert children_after == children_before, "a sandbox process outlived its call"
    assert not leftovers, f"processes left under sandbox uids: {leftovers}"
    assert os.environ[SECRET_NAME] == probe.secret
    with contextlib.suppress(Exception):
        os.kill(probe.test_pid, 0)  # we are alive to run this line at all


def test_the_suite_has_at_least_25_hostile_snippets() -> None:
    assert len(CASES) >= 25 and len({case.name for case in CASES}) == len(CASES)
