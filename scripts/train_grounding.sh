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
#   VLLM       1: sample rollouts with vLLM (rollout.engine=vllm). This script starts `mmpg vllm-serve` on this node
#              (scripts/vllm_serve.sh; .venv-vllm is made on first use), waits for it inside the trainer
#              (rollout.vllm_wait_s), and stops it when training ends. One node only (the server binds 127.0.0.1).
#   VLLM_GPUS  the server's own GPUs, e.g. VLLM_GPUS=7 with TRAIN_GPUS=0,1,2,3,4,5,6. Unset: colocated on the
#              trainer's GPUs, the server taking VLLM_MEM of their memory (default 0.3; lower the training batch or
#              use ZeRO-3 offload if the trainer runs short)
#   TRAIN_GPUS the trainer's GPUs (deepspeed --include localhost:TRAIN_GPUS; instead of NUM_GPUS)
#   VLLM_PORT  default 8000; VLLM_ARGS: more `mmpg vllm-serve` flags, e.g. "--max-model-len 16384"
# UNTESTED on GPUs so far: the vLLM knobs (tests/test_train_launch.py runs them on a CPU with stand-in launchers).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" "${MMPG_EXTRAS:-dev,gpu}"
cd "$MMPG_ROOT"
config="configs/grounding_qwen25vl_7b.yaml"
if [ $# -gt 0 ] && [[ "$1" != *=* ]]; then config="$1"; shift; fi
args=(--config "$config")
[ -n "${ZERO:-}" ] && args+=("deepspeed.config=configs/deepspeed/zero${ZERO}.json")
[ -n "${RESUME:-}" ] && args+=(--resume "$RESUME")
launcher=("${MMPG_DEEPSPEED:-deepspeed}")
[ -n "${HOSTFILE:-}" ] && launcher+=(--hostfile "$HOSTFILE")
[ -n "${NUM_GPUS:-}" ] && launcher+=(--num_gpus "$NUM_GPUS")
if [ -n "${TRAIN_GPUS:-}" ]; then
  [ -n "${NUM_GPUS:-}" ] && { echo "train_grounding.sh: set NUM_GPUS or TRAIN_GPUS, not both" >&2; exit 2; }
  launcher+=(--include "localhost:$TRAIN_GPUS")
fi
if [ "${VLLM:-0}" = 1 ]; then
  if [ -n "${HOSTFILE:-}" ]; then
    echo "train_grounding.sh: VLLM=1 runs on one node (the server binds 127.0.0.1); start \`mmpg vllm-serve\` yourself" \
         "for several nodes and pass rollout.engine=vllm rollout.vllm_url=..." >&2
    exit 2
  fi
  port="${VLLM_PORT:-8000}"
  model="$(mmpg train "${args[@]}" "$@" --get model.path)"
  serve=(--checkpoint "$model" --port "$port")
  if [ -z "${VLLM_GPUS:-}" ]; then serve+=(--gpu-memory-utilization "${VLLM_MEM:-0.3}"); fi
  # shellcheck disable=SC2206
  serve+=(${VLLM_ARGS:-})
  mkdir -p runs
  log="runs/vllm-serve-$port.log"
  echo "[mmpg] starting the vLLM server on 127.0.0.1:$port for $model (GPUs ${VLLM_GPUS:-shared}; log $log)"
  server_cmd=(bash scripts/vllm_serve.sh)
  [ -n "${MMPG_VLLM_SERVE:-}" ] && server_cmd=("$MMPG_VLLM_SERVE")  # tests: a stand-in server
  # its own process group (setsid), so stopping it also stops the engine processes vLLM spawns
  ( [ -n "${VLLM_GPUS:-}" ] && export CUDA_VISIBLE_DEVICES="$VLLM_GPUS"
    exec setsid "${server_cmd[@]}" "${serve[@]}" ) >"$log" 2>&1 &
  server=$!
  trap 'kill -TERM -- "-$server" 2>/dev/null; wait "$server" 2>/dev/null' EXIT
  set +e
  "${launcher[@]}" --module mmpg.cli train "${args[@]}" "$@" rollout.engine=vllm \
    "rollout.vllm_url=http://127.0.0.1:$port"
  exit $?
fi
# The launcher starts one process per GPU; each runs `mmpg train`, which joins the NCCL group the launcher set up.
exec "${launcher[@]}" --module mmpg.cli train "${args[@]}" "$@"
