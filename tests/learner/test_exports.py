"""`learner`'s public names resolve, and importing the package stays light (no torch)."""

from __future__ import annotations

import subprocess
import sys

import learner


def test_every_public_name_resolves() -> None:
    for name in learner.__all__:
        assert getattr(learner, name) is not None, name


def test_importing_learner_does_not_import_torch() -> None:
    code = "import sys, learner; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
