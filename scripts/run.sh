#!/usr/bin/env bash
# The README's main-job command: installs what is missing (idempotent), then trains the embedded
# default model (SmolLM2-135M-Instruct) on Countdown with the Python tool, asynchronously with VCPO
# (configs/default.yaml), and draws the dashboard. Extra arguments are a.b.c=value overrides, e.g.
#   bash scripts/run.sh trainer.total_steps=5
# Rerunning resumes from runs/default's newest checkpoint (delete runs/default to start over).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/vcpo train configs/default.yaml "$@"
run_dir=$(.venv/bin/vcpo config check configs/default.yaml "$@" | sed -n 's/^run_dir: //p')
.venv/bin/vcpo plot "$run_dir"
