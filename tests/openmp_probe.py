"""Run an OpenMP-team probe (a Python snippet that counts this process's threads around parallel regions
and prints one JSON line) in a fresh interpreter with two OpenMP threads: the tests of rollout/openmp.py
and of its callers (the engines' StepRuntime, the learner thread) share it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]

_WHY_NOT = ("reads /proc/self/task (Linux only)" if not sys.platform.startswith("linux")
            else "an OpenMP team needs 2 CPUs; this machine has 1" if (os.cpu_count() or 1) < 2 else "")
needs_an_openmp_team = pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT or "runs here")
"""The mark for a test that runs `run_team_probe`."""


def run_team_probe(code: str) -> dict[str, Any]:
    """Run `code` in a fresh interpreter from the repository root with OMP_NUM_THREADS=2; its last line."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])
