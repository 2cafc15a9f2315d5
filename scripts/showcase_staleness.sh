#!/usr/bin/env bash
# The staleness showcase on the real model: VCPO vs sequence TIS on the default run's
# workload (SmolLM2-135M, Countdown + Python tool), at k = 0 and at a large lag, every batch lagging
# by exactly min(k, step) (rollout.saturate_lag), then one comparison PNG. CPU-sized by default:
#   STEPS=10 LAG=8 bash scripts/showcase_staleness.sh        (≈ 4 runs × STEPS × ~30 s on 2 cores)
# Any further arguments are a.b.c=value overrides for every run. Reruns resume finished runs.
# WARM_START=true starts every run from the default run's cold-start SFT model (measured without).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
steps=${STEPS:-10}
lag=${LAG:-8}
root=${ROOT:-runs/showcase}
declare -A algo=(
  [vcpo]="algo.objective={type: vcpo, is_cap: 8.0}"
  [seq_tis]="algo.objective={type: seq_tis, is_cap: 8.0}"
)
declare -A ess=([vcpo]=true [seq_tis]=false)
for method in vcpo seq_tis; do
  for k in 0 "$lag"; do
    .venv/bin/vcpo train configs/default.yaml --no-progress "run_dir=$root/$method-k$k" \
      "${algo[$method]}" "algo.ess_lr.enabled=${ess[$method]}" "rollout.max_lag=$k" \
      rollout.saturate_lag=true "trainer.total_steps=$steps" trainer.checkpoint_every=1 \
      "warm_start.enabled=${WARM_START:-false}" \
      rollout.groups_per_step=2 algo.group_size=4 \
      "task_overrides=[reward.format_score=0.1, loop.max_turns=2, loop.max_total_tokens=512, loop.max_new_tokens_per_turn=128]" \
      "$@"
  done
done
.venv/bin/vcpo plot "$root"/vcpo-k0 "$root"/vcpo-k"$lag" "$root"/seq_tis-k0 "$root"/seq_tis-k"$lag" \
  --out "$root/compare.png"
