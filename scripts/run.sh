#!/usr/bin/env bash
# The README's main-job command: installs what is missing (idempotent), then runs the main job on
# the embedded default model. Until `vcpo train` lands (issue #6) the main job is one VCPO step
# (fast exact per-trajectory norms + OPOB + ESS step size) vs GRPO on SmolLM2-135M-Instruct.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p runs
exec .venv/bin/vcpo bench opob model=default "lengths=[128,512]" repeats=1 --out runs/bench_opob_default.json "$@"
