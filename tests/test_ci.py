"""`.ci/run`: past its stated budget the suite is stopped and CI fails saying so, not silently at the runner's
hard limit."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _stub(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/usr/bin/env bash\n{body}\n")
    path.chmod(0o755)


def test_a_suite_past_its_budget_fails_ci_loudly(tmp_path: Path) -> None:
    shutil.copytree(ROOT / ".ci", tmp_path / ".ci")
    _stub(tmp_path / "scripts" / "setup.sh", "exit 0")
    _stub(tmp_path / ".venv" / "bin" / "ruff", "exit 0")
    _stub(tmp_path / "scripts" / "test.sh", "sleep 20")
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "VCPO_CI_TEST_BUDGET_S": "1"})
    assert done.returncode == 1
    assert "ran past its budget of 1 s and was stopped" in done.stderr
    _stub(tmp_path / "scripts" / "test.sh", "exit 3")  # a failing suite keeps its own exit status
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "test budget" in done.stdout
