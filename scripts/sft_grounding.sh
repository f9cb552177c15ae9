#!/usr/bin/env bash
# Supervised warm start (`mmpg sft`) with the DeepSpeed launcher: scripts/train_grounding.sh's launch and knobs
# (NUM_GPUS, HOSTFILE, LAUNCHER, NODE_RANK, ZERO, RESUME, MASTER_PORT, MMPG_EXTRAS; not VLLM; on Slurm:
# JOB=sft sbatch scripts/slurm/train_grounding.sbatch). Its checkpoint is then model.path of the
# GRPO run. Without a config (no first argument, or one that is a key=value override) it runs
# configs/sft_qwen25vl_7b.yaml: TimeLens's SFT settings on Qwen2.5-VL-7B (lr 1e-5, 128 samples a step, one epoch of
# Charades-STA; the GRPO config's lr 1e-6 is not an SFT one).
#   NUM_GPUS=8 bash scripts/sft_grounding.sh                                   # configs/sft_qwen25vl_7b.yaml
#   NUM_GPUS=8 bash scripts/sft_grounding.sh configs/sft_qwen25vl_7b.yaml data.train=ANN data.videos=DIR
#   MMPG_EXTRAS=dev NUM_GPUS=2 bash scripts/sft_grounding.sh configs/sft_cpu_demo.yaml     # a CPU: 2 processes
if [ $# -eq 0 ] || [[ "$1" == *=* ]]; then set -- configs/sft_qwen25vl_7b.yaml "$@"; fi
MMPG_JOB=sft exec bash "$(dirname "${BASH_SOURCE[0]}")/train_grounding.sh" "$@"
