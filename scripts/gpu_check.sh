#!/usr/bin/env bash
# The GPU check: one command on a machine with a CUDA GPU and no network (≤ 8 minutes on an H100).
#
#   bash scripts/gpu_wheels.sh --model     # here, with network: the wheels and the model it carries (.gpu/)
#   bash scripts/gpu_check.sh              # there: venv over the machine's torch, then every part
#   bash scripts/gpu_check.sh --rehearse   # here: the same, CPU as the device, tiny sizes, no network
#
# Options: --out DIR (default runs/gpu_check, or $OUT where set), --parts a,b (scripts/gpu_check.py
# lists them), --budget SECONDS (all parts together, default 480; ×3 with --rehearse).
# The venv sees the base Python's packages (torch with CUDA, transformers, ...) through a .pth file and
# gets everything else from .gpu/wheels-cpXY only (pip --no-index). The default model travels as its
# GGUF in three parts (.gpu/model-1..3, one per device call: a call carries at most 64 MiB with the
# working tree; .gpu/model-meta holds its name and digest) and is converted into a fresh cache, so the
# warm start runs as on a new machine.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

REHEARSE=0
OUT_DIR=${OUT:-$REPO/runs/gpu_check}
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rehearse) REHEARSE=1; shift ;;
    --out) OUT_DIR=$2; shift 2 ;;
    --parts|--budget) PASS+=("$1" "$2"); shift 2 ;;
    *) echo "usage: $0 [--rehearse] [--out DIR] [--parts a,b] [--budget S]" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT_DIR"
LOG=$OUT_DIR/gpu_check.log
say() { echo "[gpu_check] $*" | tee -a "$LOG"; }
t0=$(date +%s)

if [ "$REHEARSE" = 1 ]; then
  BASE=${BASE_PYTHON:-$REPO/.gpu/base-venv/bin/python}   # stands in for the GPU image's Python
  PASS+=(--rehearse)
  VENV=${GPU_CHECK_VENV:-/tmp/vcpo-gpu-rehearse-venv}
  export VCPO_CACHE_DIR=${VCPO_CACHE_DIR:-/tmp/vcpo-gpu-rehearse-cache}
else
  BASE=${BASE_PYTHON:-python3}
  VENV=${GPU_CHECK_VENV:-/tmp/vcpo-gpu-venv}
  export VCPO_CACHE_DIR=${VCPO_CACHE_DIR:-/tmp/vcpo-gpu-cache}
fi
[ -x "$BASE" ] || command -v "$BASE" >/dev/null || { say "no base Python '$BASE' (set BASE_PYTHON)"; exit 2; }
PYTAG=$("$BASE" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
WHEELS=$REPO/.gpu/wheels-$PYTAG
[ -d "$WHEELS" ] || { say "no $WHEELS: run 'bash scripts/gpu_wheels.sh --python X.Y' where there is network"; exit 2; }

# --- the venv: base packages through a .pth, the carried wheels over them, the repo on the path
rm -rf "$VENV"
"$BASE" -m venv "$VENV" >>"$LOG" 2>&1 || { say "venv creation failed (see $LOG)"; exit 2; }
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$BASE" -c 'import site; print("\n".join(site.getsitepackages()))' > "$SITE/_base_python.pth"
echo "$REPO" > "$SITE/_vcpo_repo.pth"
"$VENV/bin/python" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
  "$WHEELS"/*.whl >>"$LOG" 2>&1 || { say "installing the carried wheels failed (see $LOG)"; exit 2; }
printf '#!/bin/sh\nexec "%s" -m cli "$@"\n' "$VENV/bin/python" > "$VENV/bin/vcpo"
chmod +x "$VENV/bin/vcpo"
export PATH=$VENV/bin:$PATH

# --- bubblewrap for the sandboxed Python tool, from carried Debian packages where the machine lacks it
# (VCPO_GPU_CHECK_BWRAP=carried takes the carried one even where the machine has its own: rehearsal)
if { [ "${VCPO_GPU_CHECK_BWRAP:-}" = carried ] || ! command -v bwrap >/dev/null 2>&1; } \
   && ls "$REPO"/.gpu/debs/*.deb >/dev/null 2>&1; then
  root=/tmp/vcpo-gpu-debs
  for deb in "$REPO"/.gpu/debs/*.deb; do dpkg-deb -x "$deb" "$root" 2>>"$LOG" || say "could not unpack $deb"; done
  libs=$(find "$root" -name 'lib*.so*' -printf '%h\n' | sort -u | tr '\n' ':')
  mkdir -p "$VENV/sbin"
  printf '#!/bin/sh\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:-}" exec "%s" "$@"\n' "$libs" "$root/usr/bin/bwrap" > "$VENV/bin/bwrap"
  chmod +x "$VENV/bin/bwrap"
fi

# --- the default model from its carried parts (checked against the digest taken here)
want=$(cat .gpu/model-meta/parts 2>/dev/null || echo 0)
missing=$(for n in $(seq 1 "$want"); do [ -f ".gpu/model-$n/part" ] || printf '%s ' "$n"; done)
missing=${missing% }
if [ "$want" -gt 0 ] && [ -z "$missing" ]; then
  gguf_dir=$VCPO_CACHE_DIR/gguf
  mkdir -p "$gguf_dir"
  gguf=$gguf_dir/$(cat .gpu/model-meta/name)
  for n in $(seq 1 "$want"); do cat ".gpu/model-$n/part"; done > "$gguf"
  if [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$(cat .gpu/model-meta/sha256)" ]; then
    "$VENV/bin/python" -c "import sys; from pathlib import Path; from rollout.models import ensure_default_model; \
ensure_default_model(Path(sys.argv[1]) / 'models', gguf=Path(sys.argv[2]))" "$VCPO_CACHE_DIR" "$gguf" >>"$LOG" 2>&1 \
      && say "default model converted into $VCPO_CACHE_DIR/models" || say "default model conversion failed (see $LOG)"
  else
    say "default model parts do not match their digest: the training parts will fail"
  fi
else
  say "default model not all here (.gpu/model-meta/parts says $want; missing: ${missing:-the meta file itself}): carry" \
      ".gpu/model-meta and one .gpu/model-N per call; the training parts will fail"
fi
say "environment ready in $(( $(date +%s) - t0 )) s ($VENV over $BASE)"

"$VENV/bin/python" scripts/gpu_check.py --out "$OUT_DIR" "${PASS[@]}"
code=$?
say "done in $(( $(date +%s) - t0 )) s; report: $OUT_DIR/report.json"
exit $code
