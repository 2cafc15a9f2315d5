"""`vcpo --help` and the packages' indexes import nothing heavy: no torch, no transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["cli.main", "vcpo", "tools", "rollout", "agent_env", "learner"])
def test_importing_stays_light(module: str) -> None:
    code = f"import sys, {module}; sys.exit(int('torch' in sys.modules or 'transformers' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0, module
