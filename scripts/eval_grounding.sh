#!/usr/bin/env bash
# Evaluate a checkpoint on a grounding benchmark: R1@0.3/0.5/0.7 and mIoU (both threshold conventions), report.md,
# plots, predictions.jsonl (a rerun continues a killed evaluation).
#   bash scripts/eval_grounding.sh CHECKPOINT ANNOTATIONS VIDEOS [PROTOCOL] [key=value ...] [--out DIR]
#   bash scripts/eval_grounding.sh --run RUN_DIR ANNOTATIONS VIDEOS [PROTOCOL] [key=value ...]   each checkpoint
# CHECKPOINT: a folder, or a hub id (Qwen/Qwen2.5-VL-7B-Instruct, the untrained baseline): downloaded into the
# Hugging Face cache on first use, once per node
# PROTOCOL: default (mmpg's training settings), or a paper's: time_r1, tvgbench, videochat_r1, timelens. A paper's
# protocol prompts with the paper's own text, which mmpg does not ship: fetch its file once (mmpg eval --fields
# prints the command for each; docs/evaluation.md#prompts) and pass it as prompt_file=, e.g.
#   curl -fL --create-dirs -o data/prompts/time_r1.py \
#       https://raw.githubusercontent.com/xiaomi-research/time-r1/7f2b5944a0c35993da80634a459d5a48a3a5431e/src/vllm_inference/data/config.py
#   NUM_GPUS=8 bash scripts/eval_grounding.sh runs/grpo/checkpoints/step_00000200 \
#       data/charades/charades_sta_test.txt data/charades/Charades_v1_480 time_r1 prompt_file=data/prompts/time_r1.py
# Knobs, as key=value after the protocol (`mmpg eval --fields` lists all, with each protocol's sources):
#   template=time_r1|time_r1_frames|answer_only|zoom   mmpg's own prompts (default time_r1, the one training uses;
#                       zoom: the zoom protocol, multi-turn, with zoom_fps, zoom_max_frames, zoom_max_turns)
#   prompt_file=PATH    a paper's prompt file (.py: read, never run) or a text file with {query} (instead of template)
#   fps=2 max_frames=768 min_pixels=12544 max_pixels=602112 total_pixels=2809856   what the model sees of a video
#   max_new_tokens=1024 answer length (too short cuts the <answer> off: unparseable, IoU 0)
#   dtype=auto          bfloat16 on GPUs, float32 on CPUs
#   bad_videos=fail     a missing/corrupt video scores 0 and is counted; skip: left out, still counted
#   max_samples=0       only the first N samples (0: all), for a quick look
#   batch_size=8 num_workers=2   speed only: prompts per decoding batch per GPU, video-decoding workers
# NUM_GPUS=N: N processes with torchrun (GPUs, or a CPU with gloo); MASTER_PORT (default 29500) for two on one machine;
# MMPG_TORCHRUN: the torchrun command (default torchrun).
# Output: --out DIR (default: RUN/evals/<benchmark>/step_N for a run's checkpoint, else evals/<ckpt>/<benchmark>).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${MMPG_EXTRAS:-dev}"
if [ "${1:-}" = "--run" ]; then what=(--run "${2:?run directory}"); shift 2
else what=(--checkpoint "${1:?checkpoint folder}"); shift; fi
ann="${1:?annotation file}"; videos="${2:?video folder}"; protocol=default
if [ $# -gt 2 ] && [[ "$3" != *=* && "$3" != -* ]]; then protocol="$3"; shift 3; else shift 2; fi
args=("${what[@]}" --annotations "$ann" --videos "$videos" --protocol "$protocol" "$@")
if [ "${NUM_GPUS:-1}" -gt 1 ]; then   # one rank per GPU (or CPU process); samples sharded, predictions merged on rank 0
  exec "${MMPG_TORCHRUN:-torchrun}" --nproc_per_node "$NUM_GPUS" --master_port "${MASTER_PORT:-29500}" \
    -m mmpg.cli eval "${args[@]}"
fi
exec mmpg eval "${args[@]}"
