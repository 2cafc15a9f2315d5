#!/usr/bin/env bash
# The README's test command: installs what is missing (idempotent), then runs the CPU test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` or `-k opob`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec .venv/bin/python -m pytest "$@"
