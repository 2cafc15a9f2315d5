"""The heavy `vcpo` commands re-execute on tcmalloc; light ones, `VCPO_ALLOCATOR=system` and a process
that already re-executed do not (run/launch/allocator.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from run.launch.allocator import ENV_CHOICE, ENV_DONE, find_tcmalloc

ROOT = Path(__file__).resolve().parents[3]
TCMALLOC = find_tcmalloc()
NO_TCMALLOC = "no libtcmalloc_minimal on this machine (scripts/setup.sh installs it where it runs as root)"


def _allocator_after(command: str, **env: str) -> str:
    """What a fresh interpreter allocates with after `prefer_tcmalloc([command])`."""
    code = ("from run.launch.allocator import prefer_tcmalloc, active_allocator\n"
            f"prefer_tcmalloc([{command!r}, '--help'])\n"
            "print(active_allocator())\n")
    base = {k: v for k, v in os.environ.items() if k not in (ENV_CHOICE, ENV_DONE, "LD_PRELOAD")}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, **env}, capture_output=True,
                          text=True, timeout=60, check=True)
    assert "cannot be preloaded" not in done.stderr, done.stderr
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(TCMALLOC is None, reason=NO_TCMALLOC)
@pytest.mark.parametrize("command", ["train", "bench", "eval"])
def test_a_heavy_command_reexecutes_on_tcmalloc(command: str) -> None:
    assert _allocator_after(command) == "tcmalloc"


def test_a_light_command_keeps_the_system_allocator_untouched() -> None:
    assert _allocator_after("config") == "glibc"


def test_system_turns_the_choice_off() -> None:
    assert _allocator_after("train", **{ENV_CHOICE: "system"}) == "glibc"


def test_after_a_reexec_it_never_reexecutes_again_but_tunes_glibc() -> None:
    # a re-executed process whose preload did not take (or was removed) must not loop
    assert _allocator_after("train", **{ENV_DONE: "1"}) == "glibc (tuned)"


def test_find_tcmalloc_takes_the_first_pattern_that_names_a_file(tmp_path: Path) -> None:
    assert find_tcmalloc([str(tmp_path / "libtcmalloc_minimal.so.4*")]) is None
    (tmp_path / "libtcmalloc_minimal.so.4.5.10").write_bytes(b"")
    (tmp_path / "libtcmalloc_minimal.so.4").mkdir()  # a directory is not a library
    found = find_tcmalloc([str(tmp_path / "nothing*"), str(tmp_path / "libtcmalloc_minimal.so.4*")])
    assert found == str(tmp_path / "libtcmalloc_minimal.so.4.5.10")


def test_the_installed_script_and_python_m_go_through_the_allocator_choice() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["vcpo"] == "cli:console"
    assert "console()" in (ROOT / "cli" / "__main__.py").read_text()
