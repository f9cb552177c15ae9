#!/usr/bin/env bash
# GRPO grounding training on GPUs with the DeepSpeed launcher: one node, or many with a hostfile.
#   bash scripts/train_grounding.sh [CONFIG] [key=value ...]
#   NUM_GPUS=8 bash scripts/train_grounding.sh configs/grounding_qwen25vl_7b.yaml data.batch_size=64
#   HOSTFILE=hostfile bash scripts/train_grounding.sh configs/grounding_qwen3vl_8b.yaml    # multi-node
# Knobs (environment):
#   CONFIG     default configs/grounding_qwen25vl_7b.yaml (first argument wins)
#   NUM_GPUS   GPUs per node (default: all visible)
#   HOSTFILE   DeepSpeed hostfile ("host slots=8" per line); every node needs the repo, the data and passwordless ssh
#   ZERO       1, 2 or 3: picks configs/deepspeed/zero$ZERO.json (default: what the config says); ZERO=3_offload for
#              ZeRO-3 with CPU offload
#   RESUME     auto (continue the run named by trainer.run_name from its latest checkpoint) or a checkpoint folder
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${MMPG_EXTRAS:-dev,gpu}"
cd "$MMPG_ROOT"
config="configs/grounding_qwen25vl_7b.yaml"
if [ $# -gt 0 ] && [[ "$1" != *=* ]]; then config="$1"; shift; fi
args=(--config "$config")
[ -n "${ZERO:-}" ] && args+=("deepspeed.config=configs/deepspeed/zero${ZERO}.json")
[ -n "${RESUME:-}" ] && args+=(--resume "$RESUME")
launcher=(deepspeed)
[ -n "${HOSTFILE:-}" ] && launcher+=(--hostfile "$HOSTFILE")
[ -n "${NUM_GPUS:-}" ] && launcher+=(--num_gpus "$NUM_GPUS")
# The launcher starts one process per GPU; each runs `mmpg train`, which joins the NCCL group the launcher set up.
exec "${launcher[@]}" --module mmpg.cli train "${args[@]}" "$@"
