#!/usr/bin/env bash
# The README's test command: installs what is missing (idempotent), then runs the CPU test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m slow` or `-k opob`.
#
# Two pytest-xdist workers, each test file whole on one worker (its module fixtures built once):
# most of the suite's time is engines, servers and subprocesses starting up or waiting, which
# overlap. Each worker computes on one OpenMP thread so the pair never oversubscribes 2 cores.
# VCPO_TEST_WORKERS=0 runs in one process (two OpenMP threads), e.g. to debug with `-s` or pdb.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers=${VCPO_TEST_WORKERS:-2}
if [[ "$workers" == 0 ]]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  exec .venv/bin/python -m pytest "$@"
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -n "$workers" --dist loadfile "$@"
