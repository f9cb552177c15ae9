#!/usr/bin/env bash
# One GPU, a few minutes: `mmpg train` (GRPO on DeepSpeed, NCCL, CUDA) end to end on the tiny Qwen2.5-VL and a few
# synthetic videos — bf16 with the grouped forward, fp32 with the grouped and the repeated forward (same rewards,
# gradient norms within 1e-4), ZeRO-3 in one process and a resume — then the `gpu`-marked grouping tests and the GRPO step benchmark's GPU preset.
# Uses the Python on PATH as it is (no install step: run `source scripts/env.sh dev,gpu` first where pip works).
#   bash scripts/gpu_train_check.sh            logs and JSON under $OUT when set, else runs/gpu-check/
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/runs/gpu-check}"
mkdir -p "$out"
export FORCE_QWENVL_VIDEO_READER=decord TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PYTHONPATH="$root:$root/tests:${PYTHONPATH:-}"
py="${PYTHON:-python3}"
work=data/generated/demo
status=0
step() { echo "[gpu_train_check] $*"; }
[ -f "$work/tiny-qwen2_5_vl/config.json" ] || $py -m mmpg.cli make-tiny --family qwen2_5_vl --out "$work/tiny-qwen2_5_vl"
[ -f "$work/synth/train.json" ] || $py -m mmpg.cli synth --out "$work/synth" --n 24 --min-duration 8 --max-duration 20
common=(model.path=$work/tiny-qwen2_5_vl data.train=$work/synth/train.json data.videos=$work/synth/videos
        data.batch_size=4 data.fps=1.0 data.max_frames=8 data.num_workers=2 rollout.n=8 rollout.max_new_tokens=32
        trainer.micro_batch_size=16 trainer.device=${DEVICE:-cuda} trainer.total_steps=4 trainer.output_dir="$out/runs"
        optim.lr=1e-4 checkpoint.every_n_steps=2 logging.tensorboard=false reward.function=reward_fns:space_share)
run() {  # name, overrides...
  local name="$1"; shift
  step "train $name: $*"
  timeout 240 $py -m mmpg.cli train "${common[@]}" trainer.run_name="$name" "$@" > "$out/$name.log" 2>&1 \
    || { step "FAILED $name (exit $?)"; tail -30 "$out/$name.log"; status=1; }
}
run bf16-grouped model.dtype=bfloat16 algorithm.grouping=true
run fp32-grouped model.dtype=float32 algorithm.grouping=true
run fp32-repeated model.dtype=float32 algorithm.grouping=false
run fp32-zero3 model.dtype=float32 deepspeed.config=configs/deepspeed/zero3.json
run fp32-zero3 model.dtype=float32 deepspeed.config=configs/deepspeed/zero3.json trainer.total_steps=6 \
    checkpoint.resume=auto
$py - "$out/runs" <<'PY' || status=1
import json, sys
from pathlib import Path
root = Path(sys.argv[1])
def lines(name):
    p = root / name / "metrics.jsonl"
    return [json.loads(l) for l in p.read_text().splitlines()] if p.exists() else []
print(f"{'run':16} {'step':>4} {'reward':>8} {'loss':>12} {'grad_norm':>10} {'gap_max':>9} {'s/step':>7} {'peak MB':>8}")
for name in ("bf16-grouped", "fp32-grouped", "fp32-repeated", "fp32-zero3"):
    for m in lines(name):
        print(f"{name:16} {m['step']:>4} {m['reward/mean']:8.4f} {m.get('actor/loss', float('nan')):12.4e} "
              f"{m.get('actor/grad_norm') or float('nan'):10.4f} {m.get('actor/logprob_gap_max', 0):9.2e} "
              f"{m['timing_s/step']:7.2f} {m['perf/peak_memory_mb']:8.0f}")
a, b = lines("fp32-grouped"), lines("fp32-repeated")
ok = len(a) == len(b) == 4
for x, y in zip(a, b):
    d = abs(x["actor/grad_norm"] - y["actor/grad_norm"]) / max(1e-12, y["actor/grad_norm"])
    ok &= x["reward/mean"] == y["reward/mean"] and d < 1e-4
    print(f"fp32 grouped vs repeated step {x['step']}: same rewards {x['reward/mean'] == y['reward/mean']}, "
          f"grad norm rel diff {d:.2e}")
z = lines("fp32-zero3")
print("zero3 resumed to step 6:", [m["step"] for m in z])
ok &= [m["step"] for m in z] == [1, 2, 3, 4, 5, 6]
print("TRAIN CHECK", "PASSED" if ok else "FAILED")
sys.exit(0 if ok else 1)
PY
step "gpu-marked grouping tests"
timeout 100 $py -m pytest -m gpu tests/test_grouping_gpu.py -q -p no:cacheprovider -rs -x 2>&1 | tail -15 || status=1
if $py -m mmpg.cli bench --help 2>/dev/null | grep -q step; then
  step "GRPO step benchmark, GPU preset"
  timeout 150 $py -m mmpg.cli bench --levels step --preset gpu --rounds 1 --out "$out/bench-step-gpu.json" 2>&1 \
    | tail -25 || status=1
fi
step "exit status $status"
exit $status
