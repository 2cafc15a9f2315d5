#!/usr/bin/env bash
# Runs a command as it would run on an AVX2-only x86-64 host (no AVX-512, AMX or VNNI), for timing the
# main job where no such host is at hand, e.g.
#   bash scripts/emulate_avx2.sh bash scripts/run.sh run_dir=runs/avx2
# torch's CPU probes report the missing instruction sets (so vLLM loads its AVX2 kernels and vcpo's
# `auto` picks fp32 where bf16 would be emulated: benchmarks/avx2_host/sitecustomize.py), and ATen,
# oneDNN and MKL are limited to their AVX2 kernels. Clock speed and memory stay this host's.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export EMULATE_AVX2=1 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
export PYTHONPATH="$root/benchmarks/avx2_host${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
