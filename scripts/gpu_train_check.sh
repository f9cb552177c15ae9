#!/usr/bin/env bash
# Stage 3 of scripts/gpu_check.sh, usable alone: a short `mmpg train` (GRPO, DeepSpeed in one process) in bf16 on the
# tiny Qwen2.5-VL and the synthetic videos of wheels/synth/ (scripts/gpu_bundle.sh renders them): ZeRO-0 and ZeRO-3,
# each with the grouped and with the repeated forward, the four runs side by side (the tiny model leaves the GPU
# idle most of the time). Then one row per run: actor/logprob_gap_max (rollout engine vs training forward, the drift
# alarm's figure) against the bf16 bound, steps done, s/step, the self-check's figure. Exit 0 only if all four pass.
#   bash scripts/gpu_train_check.sh      PYTHON (python3), DEVICE (cuda; cpu for the rehearsal), TRAIN_STEPS (3),
#                                        MMPG_TRAIN_OUT (run folders; default runs/gpu_train_check/<time>),
#                                        MMPG_SYNTH (videos; default wheels/synth, else rendered here if av imports)
# No time limit of its own: gpu_check.sh runs it under one (a kill there stops all four runs).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
device="${DEVICE:-cuda}"
out="${MMPG_TRAIN_OUT:-$root/runs/gpu_train_check/$(date +%Y%m%d-%H%M%S)}"
synth="${MMPG_SYNTH:-$root/wheels/synth}"
mkdir -p "$out"
export FORCE_QWENVL_VIDEO_READER=decord TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$root:$root/tests${PYTHONPATH:+:$PYTHONPATH}"
say() { echo "[gpu_train_check] $*"; }
if [ ! -f "$synth/train.json" ]; then
  if "$py" -c "import av" 2>/dev/null; then  # a machine that can render them (the Docker image): here and now
    synth="$out/synth"
    "$py" -m mmpg.cli synth --out "$synth" --n 16 --min-duration 8 --max-duration 16 >"$out/synth.log" 2>&1 \
      || { say "mmpg synth failed:"; tail -20 "$out/synth.log"; exit 1; }
  else
    say "no synthetic videos in $synth and no av to render them: run scripts/gpu_bundle.sh where av is installed"
    exit 1
  fi
fi
tiny="$out/tiny-qwen2_5_vl"
if [ ! -f "$tiny/config.json" ] && ! "$py" -m mmpg.cli make-tiny --family qwen2_5_vl --out "$tiny" \
    >"$out/make-tiny.log" 2>&1; then
  say "make-tiny failed:"; tail -20 "$out/make-tiny.log"; exit 1
fi
if [ "$device" = cuda ]; then size=(data.batch_size=4 rollout.n=8 rollout.max_new_tokens=32 trainer.micro_batch_size=16
                                   data.num_workers=2)
else size=(data.batch_size=2 rollout.n=4 rollout.max_new_tokens=16 trainer.micro_batch_size=8 data.num_workers=0); fi
common=(model.path="$tiny" model.dtype=bfloat16 data.train="$synth/train.json" data.videos="$synth/videos"
        data.fps=1.0 data.max_frames=8 "${size[@]}" trainer.device="$device" trainer.total_steps="${TRAIN_STEPS:-3}"
        trainer.output_dir="$out" optim.lr=1e-4 checkpoint.every_n_steps=1000 logging.tensorboard=false
        reward.function=reward_fns:space_share)
for zero in 0 3; do
  for forward in grouped repeated; do
    name="bf16-zero$zero-$forward"
    grouping=$([ "$forward" = grouped ] && echo true || echo false)
    say "train $name"
    ( "$py" -m mmpg.cli train "${common[@]}" deepspeed.zero_stage="$zero" algorithm.grouping="$grouping" \
        trainer.run_name="$name" >"$out/$name.log" 2>&1
      echo $? >"$out/$name.rc" ) &
  done
done
wait
for f in "$out"/*.rc; do
  [ "$(cat "$f")" = 0 ] || { say "$(basename "$f" .rc) exited $(cat "$f"); its log ends:"; tail -15 "${f%.rc}.log"; }
done
"$py" -m mmpg.grouping.gpu_check train-table --runs "$out"
