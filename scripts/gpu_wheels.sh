#!/usr/bin/env bash
# Companion of scripts/gpu_check.sh: fetch here, where PyPI is reachable, every wheel the GPU machine
# lacks, into the git-ignored .gpu/ folder that travels with the check (the GPU machine has no network).
#
#   bash scripts/gpu_wheels.sh                 # wheels for the GPU machine's Python (3.12) -> .gpu/wheels-cp312
#   bash scripts/gpu_wheels.sh --python 3.11   # wheels for this machine's Python (the --rehearse run)
#   bash scripts/gpu_wheels.sh --model         # also the default model (GGUF), split in three parts
#   bash scripts/gpu_wheels.sh --python 3.11 --base   # and .gpu/base-venv: a stand-in for the GPU image's
#                                                     # Python (torch, transformers, ...) for --rehearse
#
# What the GPU image already holds (torch 2.11 + CUDA, transformers, accelerate, numpy, pyyaml, httpx,
# msgpack, pyarrow, pandas, tqdm, pytest, pytest-timeout, ...) is not carried: the check's venv sees
# it. The versions below are the ones this project's tests run with (scripts/setup.sh).
# vLLM and SGLang are not carried: each is gigabytes of CUDA wheels, over the 64 MiB a loan carries.
set -euo pipefail
cd "$(dirname "$0")/.."

PYVER=3.12
WITH_MODEL=0
WITH_BASE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PYVER=$2; shift 2 ;;
    --model) WITH_MODEL=1; shift ;;
    --base) WITH_BASE=1; shift ;;
    *) echo "usage: $0 [--python X.Y] [--model] [--base]" >&2; exit 2 ;;
  esac
done

# Pinned, without their dependencies: each one's needs are either on the image or in this list.
WHEELS=(
  megatron-core==0.16.1 mbridge==0.15.1
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  gguf==0.19.0
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  pytest-asyncio==1.5.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
)
PIP=${PIP:-.venv/bin/pip}
dest=.gpu/wheels-cp${PYVER/./}
mkdir -p "$dest"
platforms=()
for n in 17 27 28 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform any)
"$PIP" download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${platforms[@]}" -d "$dest" "${WHEELS[@]}"
rm -f "$dest"/vcpo-*.whl  # the project is not installed there: its venv puts the repo itself on the path

if [ "$WITH_MODEL" = 1 ]; then
  gguf=$(.venv/bin/python -c "from rollout.models import find_default_gguf; print(find_default_gguf())")
  # Three parts of ~31 MiB: a device call carries at most 64 MiB with the working tree (~21 MiB), the
  # GGUF is ~94 MiB. The first call carries the wheels and part 1; each later call one more part.
  parts=3
  rm -rf .gpu/model-[0-9]* .gpu/model-meta
  mkdir -p .gpu/model-meta
  split -n "$parts" --numeric-suffixes=1 -a 1 "$gguf" .gpu/model-meta/part-
  for piece in .gpu/model-meta/part-*; do
    n=${piece##*-}
    mkdir -p ".gpu/model-$n"
    mv "$piece" ".gpu/model-$n/part"
  done
  basename "$gguf" > .gpu/model-meta/name
  sha256sum "$gguf" | cut -d' ' -f1 > .gpu/model-meta/sha256
  echo "$parts" > .gpu/model-meta/parts
fi
if [ "$WITH_BASE" = 1 ]; then
  # What the GPU image holds and vcpo uses, at the image's versions where they matter (transformers
  # 5.17, accelerate 1.15); torch is this machine's CPU build. None of the carried wheels goes here.
  [ -x .gpu/base-venv/bin/python ] || "python$PYVER" -m venv .gpu/base-venv
  .gpu/base-venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 transformers==5.17.0 \
    accelerate==1.15.0 numpy pyyaml httpx msgpack pyarrow pandas tqdm pytest pytest-timeout safetensors \
    sympy xxhash fsspec huggingface-hub requests filelock packaging jinja2 psutil setuptools \
    typing-extensions einops matplotlib attrs
fi

# bubblewrap for the sandboxed tool, should the machine lack it (unpacked there, never installed)
mkdir -p .gpu/debs
(cd .gpu/debs && apt-get download -q bubblewrap libcap2 libselinux1 libpcre2-8-0 >/dev/null 2>&1) \
  || echo "[gpu_wheels] note: apt-get download failed; the check then relies on the machine's bwrap" >&2
du -sh .gpu/* | sed 's/^/[gpu_wheels] /'
