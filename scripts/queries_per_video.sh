#!/usr/bin/env bash
# Does training on K queries of one video per batch (data.queries_per_video) change what GRPO learns?
# One SFT warm start, then two GRPO runs from it with the same steps, seed and data: K=1 (i.i.d. queries) and K=3
# (up to three queries of a video side by side, sharing its prefix in the rollout and the grouped forward).
# Data: easy synthetic videos asked about in 2-3 wordings each (`mmpg synth --easy --queries 3`, 2.5 per video).
# Each run evaluates on the val split every 25 steps (RUN_DIR/evals/val/step_N, shown by `mmpg inspect`), and both
# final checkpoints (and the SFT one) are evaluated on the test split. SEEDS="0 1" repeats the GRPO pair per seed.
# About 6 min per seed on 2 idle CPU cores.
# Usage: [SEEDS="0 1"] bash scripts/queries_per_video.sh [workdir]        (default data/generated/kcmp)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh dev
W="${1:-data/generated/kcmp}"
SFT_STEPS="${SFT_STEPS:-200}" GRPO_STEPS="${GRPO_STEPS:-100}" SEEDS="${SEEDS:-0}"
[ -f "$W/tiny/config.json" ] || mmpg make-tiny --family qwen2_5_vl --out "$W/tiny" --hidden-size 128 --layers 2 \
  --heads 4 --kv-heads 2 --intermediate-size 256 --overwrite
[ -f "$W/easy3/test.json" ] || mmpg synth --out "$W/easy3" --n 400 --easy --queries 3 --min-duration 8 \
  --max-duration 20 --overwrite
data=(data.train="$W/easy3/train.json" data.val="$W/easy3/val.json" data.videos="$W/easy3/videos")
common=(trainer.output_dir="$W/runs" checkpoint.keep_last=1 eval.every_n_steps=25)
evaluate() {  # checkpoint, out
  mmpg eval --checkpoint "$1" --annotations "$W/easy3/test.json" --videos "$W/easy3/videos" --out "$2" fps=2.0 \
    min_pixels=784 max_pixels=784 max_new_tokens=32 device=cpu
}
[ -d "$W/runs/sft/checkpoints" ] || mmpg sft --config configs/sft_cpu_demo.yaml model.path="$W/tiny" "${data[@]}" \
  "${common[@]}" trainer.seed=0 trainer.run_name=sft trainer.total_steps="$SFT_STEPS" \
  checkpoint.every_n_steps="$SFT_STEPS"
sft="$(ls -d "$W"/runs/sft/checkpoints/step_* | tail -1)"
[ -f "$W/eval-sft/metrics.json" ] || evaluate "$sft" "$W/eval-sft"
for seed in $SEEDS; do
  for K in 1 3; do
    run="grpo-k$K-seed$seed"
    rm -rf "$W/runs/$run" "$W/eval-$run"
    mmpg train --config configs/cpu_demo.yaml model.path="$sft" "${data[@]}" "${common[@]}" trainer.seed="$seed" \
      trainer.run_name="$run" trainer.total_steps="$GRPO_STEPS" checkpoint.every_n_steps="$GRPO_STEPS" \
      data.queries_per_video="$K"
    evaluate "$(ls -d "$W/runs/$run"/checkpoints/step_* | tail -1)" "$W/eval-$run"
  done
done
