"""Evaluation speed: greedy answers through the batched shared-prefix engine vs `model.generate` one sample at a time.

    python -m mmpg.eval.speed --checkpoint models/tiny-256 --annotations data/generated/synth/test.json \\
        --videos data/generated/synth/videos --samples 16 --batch-size 8 fps=1 max_frames=8

Videos are decoded and prompts built before the clock starts (the same for every variant), so the figures are the
model's time only. Variants, each timed after one untimed warm-up call:

    generate      model.generate(do_sample=False) per sample, the prompt unpadded (what a plain eval script does)
    engine_b1     HFEngine.generate_groups with batch size 1 (the engine alone, no batching)
    engine_bB     HFEngine.generate_groups with B prompts per batch, left padded (what `mmpg eval` does)

Prints a table (samples/s, seconds, tokens, answers identical to `generate`) and writes JSON with --out.
A program, never a test.
"""

from __future__ import annotations

import argparse
import json
import time


def _inputs(processor, items, template):
    from mmpg.data.prompts import build_prompt_inputs

    return build_prompt_inputs(processor, [it.sample for it in items], [it.video for it in items], template)


def _timed(fn, calls, sync) -> tuple[float, list[str], int]:
    fn(calls[0])  # warm-up (allocator, kernels), not timed
    sync()
    texts, tokens, t0 = [], 0, time.perf_counter()
    for call in calls:
        out, n = fn(call)
        texts += out
        tokens += n
    sync()
    return time.perf_counter() - t0, texts, tokens


def measure(checkpoint, annotations, videos, samples: int, batch_size: int, overrides: list[str],
            device: str = "cpu") -> dict:
    import torch

    from mmpg.data.dataset import GroundingDataset
    from mmpg.data.video import VideoSpec
    from mmpg.eval.protocols import eval_template
    from mmpg.eval.runner import load_benchmark, load_model
    from mmpg.eval.settings import load_settings
    from mmpg.grouping.inputs import placeholder_token_ids
    from mmpg.rollout import HFEngine, SamplingParams

    settings = load_settings("default", list(overrides) + [f"max_samples={samples}"])
    chosen = load_benchmark(annotations, videos, settings).samples
    model, processor, family, dtype = load_model(checkpoint, settings, device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    spec = VideoSpec.for_family(family, **settings.video_values())
    template = eval_template(settings.template, settings.prompt_file)
    items = [it for it in GroundingDataset(chosen, spec) if it.ok]
    singles = [_inputs(processor, [it], template) for it in items]
    batches = [_inputs(processor, items[i:i + batch_size], template) for i in range(0, len(items), batch_size)]
    engine = HFEngine(model, processor, decode=settings.decode, cascade_backend=settings.cascade_backend,
                      decode_check=settings.decode_check)
    sampling = SamplingParams(max_new_tokens=settings.max_new_tokens, temperature=0.0, logprobs=False)
    eos = model.generation_config.eos_token_id
    banned = placeholder_token_ids(model) or None

    def run_engine(inputs):
        r = engine.generate_groups(inputs, 1, sampling)
        return r.texts, int(r.completion_mask.sum())

    def run_generate(inputs):
        inputs = inputs.to(device)
        with torch.no_grad():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=settings.max_new_tokens, eos_token_id=eos,
                                 suppress_tokens=banned)
        new = out[:, inputs["input_ids"].shape[1]:]
        return processor.batch_decode(new, skip_special_tokens=True), int(new.numel())

    rows = {}
    for name, fn, calls in [("generate", run_generate, singles), ("engine_b1", run_engine, singles),
                            (f"engine_b{batch_size}", run_engine, batches)]:
        seconds, texts, tokens = _timed(fn, calls, sync)
        rows[name] = {"seconds": seconds, "samples": len(texts), "samples_per_s": len(texts) / seconds,
                      "tokens": tokens, "texts": texts}
    reference = rows["generate"]["texts"]
    for row in rows.values():
        row["same_as_generate"] = sum(a == b for a, b in zip(row.pop("texts"), reference))
    prompt_tokens = [int(s["input_ids"].shape[1]) for s in singles]
    where = torch.cuda.get_device_name(0) if device.startswith("cuda") else f"{torch.get_num_threads()} threads"
    return {"checkpoint": str(checkpoint), "family": family, "dtype": dtype, "device": where,
            "samples": len(items), "batch_size": batch_size, "max_new_tokens": settings.max_new_tokens,
            "prompt_tokens_mean": sum(prompt_tokens) / len(prompt_tokens), "settings": overrides, "variants": rows}


def table(result: dict) -> str:
    lines = [f"{result['samples']} samples, prompts of {result['prompt_tokens_mean']:.0f} tokens on average, "
             f"{result['max_new_tokens']} new tokens at most, {result['dtype']}, {result['device']}",
             f"{'variant':<12} {'samples/s':>10} {'seconds':>9} {'tokens':>8} {'speed-up':>9} {'same answers':>13}"]
    base = result["variants"]["generate"]["samples_per_s"]
    for name, r in result["variants"].items():
        lines.append(f"{name:<12} {r['samples_per_s']:>10.2f} {r['seconds']:>9.2f} {r['tokens']:>8d} "
                     f"{r['samples_per_s'] / base:>8.2f}x {r['same_as_generate']:>6d}/{r['samples']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mmpg.eval.speed", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--annotations", required=True)
    p.add_argument("--videos", default=None)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu", help="cpu or cuda (one GPU)")
    p.add_argument("--out", default=None, help="write the result as JSON here")
    p.add_argument("overrides", nargs="*", help="eval settings key=value (fps, max_frames, max_new_tokens, ...)")
    args = p.parse_args(argv)
    result = measure(args.checkpoint, args.annotations, args.videos, args.samples, args.batch_size, args.overrides,
                     args.device)
    print(table(result))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
