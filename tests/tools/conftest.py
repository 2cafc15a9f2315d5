"""Fixtures for the tool tests: a real local sandbox with small limits, and host-process probes.

The sandbox tests need bubblewrap; without it they fail with the tool's own install hint rather
than skip, so a machine that lost bwrap cannot pass the security suite by skipping it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tools.sandbox.local_sandbox import LocalPythonSandbox
from tools.settings import LocalSandboxSettings

REPO_ROOT = Path(__file__).resolve().parents[2]

SMALL_LIMITS = LocalSandboxSettings(
    timeout_s=3.0,
    memory_limit_mb=512,
    max_processes=16,
    max_open_files=32,
    max_file_size_mb=4,
    work_dir_size_mb=8,
    max_output_bytes=4096,
    warm_pool_size=0,
)


@pytest.fixture
def sandbox_settings() -> LocalSandboxSettings:
    """The `sandbox` fixture's settings; a test module overrides this fixture to change them."""
    return SMALL_LIMITS


@pytest.fixture
async def sandbox(sandbox_settings: LocalSandboxSettings) -> AsyncIterator[LocalPythonSandbox]:
    """A local sandbox with small limits and no warm pool (so it has no idle child processes)."""
    async with LocalPythonSandbox(sandbox_settings) as tool:
        yield tool


def child_pids(pid: int) -> set[int]:
    """Direct children of `pid`, read from /proc."""
    children: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.add(int(entry.name))
    return children


def pids_with_uid_in(first: int, count: int) -> set[int]:
    """Host processes whose real uid lies in [first, first + count): sandboxes run as root."""
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:"):
                if first <= int(line.split()[1]) < first + count:
                    found.add(int(entry.name))
                break
    return found


def pids_with_cmdline(marker: str) -> set[int]:
    """Host processes whose command line contains `marker`."""
    found: set[int] = set()
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
        except OSError:
            continue
    return found
