#!/usr/bin/env bash
# Supervised warm start (`mmpg sft`) with the DeepSpeed launcher: scripts/train_grounding.sh's launch and knobs
# (NUM_GPUS, HOSTFILE, ZERO, RESUME, MASTER_PORT, MMPG_EXTRAS; not VLLM), the same configs. Its checkpoint is then
# model.path of the GRPO run.
#   NUM_GPUS=8 bash scripts/sft_grounding.sh configs/grounding_qwen25vl_7b.yaml data.train=ANN data.videos=DIR
#   MMPG_EXTRAS=dev NUM_GPUS=2 bash scripts/sft_grounding.sh configs/sft_cpu_demo.yaml     # a CPU: 2 processes
MMPG_JOB=sft exec bash "$(dirname "${BASH_SOURCE[0]}")/train_grounding.sh" "$@"
