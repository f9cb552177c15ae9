#!/usr/bin/env bash
# GRPO grounding training with the DeepSpeed launcher: GPUs (NCCL), one node or many with a hostfile; a CPU (gloo)
# takes the same command. scripts/sft_grounding.sh runs `mmpg sft` (the supervised warm start) the same way.
#   bash scripts/train_grounding.sh [CONFIG] [key=value ...]
#   NUM_GPUS=8 bash scripts/train_grounding.sh configs/grounding_qwen25vl_7b.yaml data.batch_size=64
#   HOSTFILE=hostfile bash scripts/train_grounding.sh configs/grounding_qwen3vl_8b.yaml    # multi-node
#   MMPG_EXTRAS=dev NUM_GPUS=2 bash scripts/train_grounding.sh configs/cpu_demo.yaml       # a CPU: 2 processes
# Knobs (environment):
#   CONFIG     default configs/grounding_qwen25vl_7b.yaml (first argument wins). Its model.path may be a hub id
#              (Qwen/Qwen2.5-VL-7B-Instruct): downloaded into the Hugging Face cache (HF_HOME) on first use, once a node
#   NUM_GPUS   processes per node: GPUs (default: all visible), or CPU processes on a machine without GPUs
#   HOSTFILE   DeepSpeed hostfile ("host slots=8" per line); every node needs the repo and the data at the same path.
#              One that names only this machine (localhost, 127.0.0.1 or its hostname) needs no ssh. Several nodes
#              are started by LAUNCHER from this one, or by a launch on each node with NODE_RANK
#              (mmpg/train/launcher.py)
#   LAUNCHER   how DeepSpeed starts the other nodes: pdsh (the default, DeepSpeed's: pdsh and passwordless ssh),
#              openmpi, mvapich, mpich, impi (mpirun) or slurm (srun, inside an allocation); a missing program is one
#              line naming what to install. LAUNCHER_ARGS: more flags for it (e.g. "--mca btl_tcp_if_include ib0")
#   NODE_RANK  this node's line of HOSTFILE (or auto): run this script on every node, no ssh between them (what
#              scripts/slurm/train_grounding.sbatch does under srun)
#   MASTER_ADDR  the first node's address, as the others reach it (default: HOSTFILE's first host; pdsh asks it)
#   MASTER_PORT  the rendezvous port (default 29500); set it to run two jobs on one machine
#   FLASH_ATTN 1: install flash-attn first where it can work (a wheel in wheels/, else a source build: minutes to an
#              hour; scripts/flash_attn.sh), else one line and sdpa; must: required (a failed build stops the launch).
#              Default: a launch never builds it (attention runs on sdpa without it; one line says so on a GPU)
#   MMPG_EXTRAS  what scripts/env.sh installs first (default dev; dev,gpu-auto with FLASH_ATTN=1, dev,gpu with must)
#   ZERO       1, 2 or 3: picks configs/deepspeed/zero$ZERO.json (default: what the config says); ZERO=3_offload for
#              ZeRO-3 with CPU offload
#   SP         ranks that share each packed row (parallel.sequence_parallel_size; long videos): divides the GPUs
#              and the model's attention heads, e.g. SP=4 on 8 GPUs = 2 data-parallel groups of 4
#   RESUME     auto: continue from the latest checkpoint of the run trainer.run_name names, or without a name of the
#              newest run of this config and job under trainer.output_dir (one line names it, or says a new run
#              starts: mmpg/train/resume.py); or a checkpoint folder
#   VLLM       1: sample rollouts with vLLM (rollout.engine=vllm). This script starts `mmpg vllm-serve` servers on
#              this node (scripts/vllm_serve.sh; .venv-vllm is made on first use), the trainer waits for them
#              (rollout.vllm_wait_s), and they stop when training ends; on 127.0.0.1, so one node only, unless
#              VLLM_URL names servers started elsewhere. serve: start only the server(s) for this config (its model
#              and length, VLLM_HOST, VLLM_PORT, VLLM_GPUS, VLLM_TP, VLLM_ARGS), in the foreground, for VLLM_URL
#              elsewhere: one server, or with several VLLM_GPUS a pool (one line prints the VLLM_URL of them all)
#   VLLM_URL   http://HOST:PORT of a server started elsewhere (its own node: VLLM=serve there), or of a pool,
#              comma-separated: none is started here, the trainer of any number of nodes samples from it.
#              MMPG_VLLM_TOKEN: the server's shared token, sent by every trainer rank (off 127.0.0.1 it needs one)
#   VLLM_HOST  the address the server binds (default 127.0.0.1): this node's name on the job's network for VLLM_URL
#   The vLLM layouts (mmpg/train/layout.py plans them; data rank r samples from server r mod N, rank 0 sends the
#   weights to every server, by one file after each step). For 8 GPUs:
#     separate GPUs: VLLM=1 VLLM_GPUS=4,5,6,7 TRAIN_GPUS=0,1,2,3 bash scripts/train_grounding.sh CONFIG
#       a pool: one server per GPU of VLLM_GPUS (per VLLM_TP of them), server i on port VLLM_PORT+i with
#       CUDA_VISIBLE_DEVICES its GPU(s), its own log runs/vllm-serve-PORT.log and process group; the trainer takes
#       TRAIN_GPUS, else every GPU the servers leave (VLLM_GPUS=7: 7 ranks, so data.batch_size=28, not the 7B
#       config's 32, which 7 do not divide). None shared with the trainer (NCCL cannot put two ranks on one GPU)
#     colocated: VLLM=1 NUM_GPUS=8 VLLM_MEM=0.3 bash scripts/train_grounding.sh CONFIG
#       no VLLM_GPUS: one server per training GPU (CUDA_VISIBLE_DEVICES that GPU), taking VLLM_MEM of its memory
#       (default on GPUs: the share `mmpg plan --vllm-mem` computes for the config, docs/plan.md; else 0.3; lower
#       the training batch or use ZeRO-3 offload if the trainer runs short), so each rank samples
#       on its own GPU; with SP, one per data-parallel group. On a machine without GPUs, one CPU server per training
#       process, the N of them sharing 0.2 of its memory for their K/V (each 0.2 / N; VLLM_MEM sets each). One
#       training process: one server, with no GPU set
#     A pool has at most one server per data-parallel rank (more would sit idle); every check is one line, exit 2.
#     UNTESTED on GPUs so far: the layouts are tested with a stand-in nvidia-smi, servers and launcher
#   VLLM_GPUS  the servers' GPUs, a multiple of VLLM_TP (above). Weights by file; with VLLM_ARGS=--nccl by NCCL
#              broadcast instead (a pool: one group, each tensor sent once for all servers; colocated: by file,
#              NCCL cannot share a GPU)
#   VLLM_TP    GPUs per server (default 1): each gets --tensor-parallel-size VLLM_TP and that many GPUs, colocated or
#              not. VLLM_ARGS="--tensor-parallel-size N" (the older form) counts as VLLM_TP=N
#   VLLM_SERVERS  colocated servers (default: one per data-parallel rank); 1: the single server of before
#   TRAIN_GPUS the trainer's GPUs (deepspeed --include localhost:TRAIN_GPUS; instead of NUM_GPUS). The layout (ranks
#              against data.batch_size, trainer.micro_batch_size, rollout.n, SP; the vLLM servers against these) is
#              checked before anything starts: one line, exit 2, with the nearest batch sizes and rank counts that work
#   VLLM_PORT  the first server's port (default 8000; a pool's next ones follow); VLLM_ARGS: more `mmpg vllm-serve`
#              flags for every server, e.g. "--dtype bfloat16"
#   VLLM_MAX_LEN  every server's --max-model-len. Default: the config's longest prompt (frame cap, pixel budget,
#              template, system prompt, a 128-token query) + rollout.max_new_tokens + 64, rounded up to a multiple of
#              256, as `mmpg vllm-len --config CONFIG` prints it (8960 for configs/grounding_qwen25vl_7b.yaml),
#              computed once for all servers; the trainer refuses a server below the config's need before the first
#              step
#   DRY_RUN    1: check the layout, resolve the config's model (from the cache only) and the server's length, print
#              the command lines the launch would run, and start nothing
# Tested on a CPU only (gloo, 2 processes: tests/test_launch_real.py, with the real launcher and vLLM server;
# tests/test_train_launch.py checks the flags and the vLLM pools with stand-ins; LAUNCHER, NODE_RANK, VLLM_URL and
# VLLM=serve:
# tests/test_multinode_launch.py, test_slurm.py, test_vllm_remote.py). UNTESTED on GPUs and clusters so far (NCCL,
# the vLLM knobs, several machines).
set -euo pipefail
case "${FLASH_ATTN:-0}" in  # flash-attn is never compiled by a launch unless asked
  0) extras="${MMPG_EXTRAS:-dev}" ;;
  1) extras="${MMPG_EXTRAS:-dev,gpu-auto}" ;;
  must) extras="${MMPG_EXTRAS:-dev,gpu}" ;;
  *) echo "train_grounding.sh: FLASH_ATTN=$FLASH_ATTN: use 1 (install flash-attn where it can work) or must" >&2
     exit 2 ;;
esac
source "${MMPG_ENV_SH:-$(dirname "${BASH_SOURCE[0]}")/env.sh}" "$extras"  # MMPG_ENV_SH: tests' stand-in
if [ "${FLASH_ATTN:-0}" = 0 ] && nvidia-smi -L 2>/dev/null | grep -q '^GPU' \
    && ! python -c 'import importlib.metadata as m; m.version("flash_attn")' 2>/dev/null; then
  echo "[mmpg] flash-attn is not installed: attention runs on sdpa (same results, slower on GPUs). To install it" \
       "first: FLASH_ATTN=1 bash scripts/train_grounding.sh ... (a source build takes minutes to an hour)" >&2
fi
cd "$MMPG_ROOT"
job="${MMPG_JOB:-train}"  # sft: scripts/sft_grounding.sh
quoted() {  # a command line as a shell reads it back (only words that need it quoted)
  local w out=()
  for w in "$@"; do
    if [[ "$w" =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then out+=("$w"); else out+=("$(printf '%q' "$w")"); fi
  done
  echo "${out[*]}"
}
dry_run() { echo "[mmpg] dry run (DRY_RUN=1), nothing started; the launch would run:"; printf '  %s\n' "$@"; exit 0; }
config="configs/grounding_qwen25vl_7b.yaml"
if [ $# -gt 0 ] && [[ "$1" != *=* ]]; then config="$1"; shift; fi
args=(--config "$config")
[ -n "${ZERO:-}" ] && args+=("deepspeed.config=configs/deepspeed/zero${ZERO}.json")
[ -n "${SP:-}" ] && args+=("parallel.sequence_parallel_size=$SP")
[ -n "${RESUME:-}" ] && args+=(--resume "$RESUME")
case "${VLLM:-0}" in
  0) [ -z "${VLLM_URL:-}" ] || { echo "train_grounding.sh: VLLM_URL is the server of VLLM=1: set VLLM=1 too" >&2
                                  exit 2; } ;;
  1|serve) [ "$job" = train ] || { echo "train_grounding.sh: VLLM=$VLLM samples GRPO rollouts; mmpg $job has none" >&2
                                   exit 2; } ;;
  *) echo "train_grounding.sh: VLLM=$VLLM: use 1 (rollouts by vLLM) or serve (start only its server)" >&2; exit 2 ;;
esac
if [ "${VLLM:-0}" = 1 ] && [ -n "${VLLM_URL:-}" ]; then  # the knobs of a server this script starts have no say
  told=""
  # (its length is checked by the trainer, at /health)
  for knob in VLLM_GPUS VLLM_TP VLLM_SERVERS VLLM_HOST VLLM_PORT VLLM_ARGS; do
    [ -n "${!knob:-}" ] && told+=" $knob"
  done
  if [ -n "$told" ]; then
    echo "train_grounding.sh: VLLM_URL=$VLLM_URL names a server started elsewhere;$told set(s) up one this script" \
         "starts: unset them (or VLLM_URL)" >&2
    exit 2
  fi
elif [ "${VLLM:-0}" = 1 ] && [ -n "${HOSTFILE:-}" ]; then
  echo "train_grounding.sh: VLLM=1 with a HOSTFILE: the server it starts binds 127.0.0.1, for one node only; start" \
       "it on a node of its own (VLLM=serve VLLM_HOST=NAME there) and set VLLM_URL=http://NAME:PORT" \
       "(docs/rollouts.md#a-server-on-its-own-node)" >&2
  exit 2
fi
colocated_mem() {  # VLLM_MEM, else on GPUs the share `mmpg plan --vllm-mem` computes for the config, else 0.3;
  # without GPUs the servers' K/V comes out of the machine's memory they share: the CPU server's 0.2, split
  local gb ranks mem
  if [ -n "${VLLM_MEM:-}" ]; then echo "$VLLM_MEM"; return; fi
  gb="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)"
  if [[ "$gb" =~ ^[0-9]+$ ]]; then
    ranks="${train_gpus:+$(tr ',' '\n' <<< "$train_gpus" | wc -l)}"
    mem="$(mmpg plan --config "$config" "$@" rollout.engine=vllm --gpus "${ranks:-${NUM_GPUS:-1}}" \
           --gpu-memory "$((gb / 1024))" --vllm-mem 2>/dev/null)" && [ -n "$mem" ] && {
      echo "[mmpg] VLLM_MEM $mem: the colocated servers' share of each GPU that mmpg plan computes" >&2
      echo "$mem"; return; }
    echo 0.3; return
  fi
  awk -v n="${#server_gpus[@]}" 'BEGIN { printf "%.2f\n", 0.2 / (n > 0 ? n : 1) }'
}
server_args() {  # the flags every server shares (serve_head, serve_tail: its --port goes between) and its program
  local model max_len
  model="$(mmpg train "${args[@]}" "$@" --get model.path)"
  # a hub id: its snapshot folder, downloaded here first if the cache lacks it (progress on this terminal); the
  # server loads that folder and the trainer finds the same revision in the cache
  if [ "${DRY_RUN:-0}" = 1 ]; then  # a dry run downloads nothing: the cached snapshot, else the id as it is
    model="$(HF_HUB_OFFLINE=1 python -m mmpg.models.hub "$model" 2>/dev/null || echo "$model")"
  else model="$(python -m mmpg.models.hub "$model")"; fi
  serve_head=(--checkpoint "$model")
  [ -n "${VLLM_HOST:-}" ] && serve_head+=(--host "$VLLM_HOST")
  serve_tail=()
  if [ "$VLLM" = 1 ] && [ -z "${VLLM_GPUS:-}" ]; then serve_tail+=(--gpu-memory-utilization "$(colocated_mem "$@")"); fi
  # the servers' length, computed once for all of them: the config's longest prompt + rollout.max_new_tokens + a
  # margin (`mmpg vllm-len`, which says how it got there), unless VLLM_MAX_LEN or a --max-model-len in VLLM_ARGS sets it
  if [[ "${VLLM_ARGS:-}" != *--max-model-len* ]]; then
    max_len="${VLLM_MAX_LEN:-}"
    [ -n "$max_len" ] || max_len="$(mmpg vllm-len --config "$config" "$@" "model.path=$model")"
    serve_tail+=(--max-model-len "$max_len")
  fi
  # multi-turn grounding with the zoom tool: a request holds the overview and every clip (`mmpg vllm-len --videos`)
  if [[ "${VLLM_ARGS:-}" != *--videos-per-prompt* ]]; then
    local videos
    videos="$(mmpg vllm-len --videos --config "$config" "$@" "model.path=$model")"
    [ "$videos" = 1 ] || serve_tail+=(--videos-per-prompt "$videos")
  fi
  if [ "${VLLM_TP:-1}" != 1 ] && [[ "${VLLM_ARGS:-}" != *--tensor-parallel-size* ]]; then
    serve_tail+=(--tensor-parallel-size "$VLLM_TP")
  fi
  # shellcheck disable=SC2206
  serve_tail+=(${VLLM_ARGS:-})
  server_cmd=("${MMPG_VLLM_SERVE:-bash}")  # tests: a stand-in server
  [ -n "${MMPG_VLLM_SERVE:-}" ] || server_cmd+=(scripts/vllm_serve.sh)
}
serve_argv() { serve=("${server_cmd[@]}" "${serve_head[@]}" --port "$1" "${serve_tail[@]}"); }  # server on port $1
dry_servers() {  # DRY_RUN: the servers' command lines (lines) and URLs (urls), one per word of server_gpus
  local i p on
  lines=() urls=()
  for i in "${!server_gpus[@]}"; do
    p=$((port + i)) on=""
    [ "${server_gpus[i]}" = - ] || on="CUDA_VISIBLE_DEVICES=${server_gpus[i]} "
    serve_argv "$p"
    lines+=("server:  ${on}setsid $(quoted "${serve[@]}") > runs/vllm-serve-$p.log")
    urls+=("http://127.0.0.1:$p")
  done
}
start_servers() {  # one server per word of server_gpus, on ports VLLM_PORT, +1, ...: pids, logs and urls in that order
  local i p
  mkdir -p runs
  pids=() logs=() urls=()
  trap 'for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done; wait 2>/dev/null' EXIT
  for i in "${!server_gpus[@]}"; do
    p=$((port + i))
    serve_argv "$p"
    logs+=("runs/vllm-serve-$p.log") urls+=("http://127.0.0.1:$p")
    echo "[mmpg] starting the vLLM server on ${VLLM_HOST:-127.0.0.1}:$p for ${serve_head[1]} (GPUs" \
         "$(if [ "${server_gpus[i]}" = - ]; then echo "${VLLM_GPUS:-shared}"; else echo "${server_gpus[i]}"; fi);" \
         "log runs/vllm-serve-$p.log)"
    # its own process group (setsid), so stopping it also stops the engine processes vLLM spawns
    ( [ "${server_gpus[i]}" = - ] || export CUDA_VISIBLE_DEVICES="${server_gpus[i]}"
      exec setsid "${serve[@]}" ) >"runs/vllm-serve-$p.log" 2>&1 &
    pids+=($!)
  done
}
joined() { local IFS=,; echo "$*"; }
port="${VLLM_PORT:-8000}"
if [ "${VLLM:-0}" = serve ]; then  # this node serves rollouts to a trainer elsewhere (its VLLM_URL); no training here
  layout="$(python -m mmpg.train.layout serve "${args[@]}" "$@")" || exit 2  # the servers: VLLM_GPUS by VLLM_TP
  { read -r _; read -r -a server_gpus; } <<< "$layout"
  server_args "$@"
  n=${#server_gpus[@]} each="${server_gpus[*]}"
  if [ "$n" = 1 ]; then what="the vLLM server" where="$port (GPUs ${VLLM_GPUS:-all})"
  else what="$n vLLM servers" where="$port-$((port + n - 1)) (GPUs ${each// / | })"; fi
  echo "[mmpg] layout: $what alone on ${VLLM_HOST:-127.0.0.1}:$where, no training ranks on this node" >&2
  if [ "$n" = 1 ]; then  # one server: this process becomes it
    serve_argv "$port"
    [ "${DRY_RUN:-0}" = 1 ] && dry_run "server:  ${VLLM_GPUS:+CUDA_VISIBLE_DEVICES=$VLLM_GPUS }$(quoted "${serve[@]}")"
    [ -n "${VLLM_GPUS:-}" ] && export CUDA_VISIBLE_DEVICES="$VLLM_GPUS"
    exec "${serve[@]}"
  fi
  [ "${DRY_RUN:-0}" = 1 ] && dry_servers && dry_run "${lines[@]}"  # a pool: one line per server, each with its log
  trap 'exit 143' TERM INT  # the EXIT trap of start_servers stops them all
  start_servers
  echo "[mmpg] the trainer elsewhere: VLLM_URL=$(joined "${urls[@]/127.0.0.1/${VLLM_HOST:-127.0.0.1}}")" >&2
  wait
  exit 0
fi
launcher=("${MMPG_DEEPSPEED:-deepspeed}")
entry=(--module mmpg.cli)  # what each process runs: python -m mmpg.cli [--local_rank=N] JOB ...
if [ -n "${HOSTFILE:-}" ]; then
  [ -f "$HOSTFILE" ] || { echo "train_grounding.sh: HOSTFILE=$HOSTFILE: no such file" >&2; exit 2; }
  if [ -n "${LAUNCHER:-}" ] && [ "$LAUNCHER" != pdsh ] && [ -z "${NODE_RANK:-}" ]; then
    # mpirun / srun start the processes themselves: they read the master's address and port from here
    export MASTER_ADDR="${MASTER_ADDR:-$(awk '$1 !~ /^#/ && NF {print $1; exit}' "$HOSTFILE")}"
    export MASTER_PORT="${MASTER_PORT:-29500}"
  fi
  # how DeepSpeed reaches the nodes (mmpg/train/launcher.py): this machine alone (no ssh), NODE_RANK (a launch per
  # node) or LAUNCHER, whose programs must be here: one line naming what to install otherwise
  ds_flags="$(python -m mmpg.train.launcher "$job")" || exit 2
  mapfile -t ds_flags <<< "$ds_flags"
  launcher+=("${ds_flags[@]}")
  # DeepSpeed's slurm backend runs `python -u SCRIPT` even with --module: the mmpg console script is that script
  [ "${LAUNCHER:-}" = slurm ] && [ -z "${NODE_RANK:-}" ] && entry=("$(command -v mmpg)")
fi
[ -n "${MASTER_PORT:-}" ] && launcher+=(--master_port "$MASTER_PORT")
[ -n "${NUM_GPUS:-}" ] && launcher+=(--num_gpus "$NUM_GPUS")
# The GPU layout, checked before anything starts (mmpg/train/layout.py): the training ranks against data.batch_size,
# the micro-batch, rollout.n and SP, the vLLM servers against the trainer's GPUs; one line and exit 2 naming the
# nearest sizes that work. It prints the trainer's GPUs (TRAIN_GPUS, or with VLLM_GPUS alone the GPUs the servers
# leave), and with VLLM=1 a second line: the servers to start, one word each (its GPUs, or - for none set).
layout="$(python -m mmpg.train.layout "$job" "${args[@]}" "$@")" || exit 2
{ read -r train_gpus; read -r -a server_gpus || true; } <<< "$layout"
[ -n "$train_gpus" ] && launcher+=(--include "localhost:$train_gpus")
if [ "${VLLM:-0}" = 1 ] && [ -n "${VLLM_URL:-}" ]; then  # a server started elsewhere: none here
  trainer=("${launcher[@]}" "${entry[@]}" train "${args[@]}" "$@" rollout.engine=vllm "rollout.vllm_url=$VLLM_URL")
  [ "${DRY_RUN:-0}" = 1 ] && dry_run "trainer: $(quoted "${trainer[@]}")"
  exec "${trainer[@]}"
fi
if [ "${VLLM:-0}" = 1 ]; then
  server_args "$@"
  if [ "${DRY_RUN:-0}" = 1 ]; then
    dry_servers
    dry_run "${lines[@]}" "trainer: $(quoted "${launcher[@]}" "${entry[@]}" train "${args[@]}" "$@" \
                                      rollout.engine=vllm "rollout.vllm_url=$(joined "${urls[@]}")")"
  fi
  start_servers  # (a trap stops them all when this script exits)
  set +e
  # the trainer's wait for a server ends at once if its process exits, quoting the end of its log; data rank r
  # samples from server r mod N, rank 0 sends the weights to them all
  MMPG_VLLM_PID="$(joined "${pids[@]}")" MMPG_VLLM_LOG="$(joined "${logs[@]/#/$PWD/}")" \
    "${launcher[@]}" "${entry[@]}" train "${args[@]}" "$@" rollout.engine=vllm "rollout.vllm_url=$(joined "${urls[@]}")"
  exit $?
fi
# The launcher starts one process per GPU (or NUM_GPUS on a CPU) as `python -m mmpg.cli --local_rank=N train ...`;
# each joins the process group (NCCL, gloo on CPUs) the launcher set up.
[ "${DRY_RUN:-0}" = 1 ] && dry_run "trainer: $(quoted "${launcher[@]}" "${entry[@]}" "$job" "${args[@]}" "$@")"
exec "${launcher[@]}" "${entry[@]}" "$job" "${args[@]}" "$@"
