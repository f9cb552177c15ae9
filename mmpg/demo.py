"""The default job (`mmpg demo`, `bash scripts/demo.sh`): the whole path on a CPU with artefacts built here.

1. build a tiny random-weight checkpoint and a few synthetic grounding videos, once, under the work folder;
2. load them as a user loads real ones: `from_pretrained`, the annotation loader, qwen-vl-utils (decord);
3. sample a group of answers to one grounding question with the shared-prefix rollout (video prefilled once);
4. score them with the grounding rewards and compute GRPO-style group-normalised advantages;
5. recompute the answers' logprobs with the grouped forward and with the naive repeated forward, and compare;
6. run a few GRPO training steps (`mmpg train`, DeepSpeed on the CPU) and say where the run directory is.
The model is random, so its answers are noise; the point is that every stage runs on real formats and code paths.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

GROUP_SIZE = 4
MAX_NEW_TOKENS = 48


def _ensure_artifacts(workdir: Path, family: str) -> tuple[Path, Path, list[str]]:
    """The tiny checkpoint and synthetic videos, built only when missing. Returns their folders and what was built."""
    from mmpg.data.synth import generate_dataset
    from mmpg.models.tiny import make_tiny

    model_dir, data_dir, built = workdir / f"tiny-{family}", workdir / "synth", []
    if not (model_dir / "config.json").is_file():
        make_tiny(family, model_dir, seed=0, overwrite=True)
        built.append(f"tiny {family} checkpoint")
    if not (data_dir / "val.json").is_file():
        generate_dataset(data_dir, n=6, seed=0, overwrite=True, min_duration=8.0, max_duration=30.0)
        built.append("6 synthetic videos")
    return model_dir, data_dir, built


def _first_sample(data_dir: Path):
    from mmpg.data.formats import load_annotations

    result = load_annotations(data_dir / "val.json", data_dir / "videos", fmt="auto", strict=True)
    return result.samples[0], len(result.samples)


def _train_briefly(model_dir: Path, data_dir: Path, workdir: Path, family: str, steps: int) -> Path:
    """A few GRPO steps on the demo's videos: `mmpg train` in its own process, exactly as a user starts it."""
    import subprocess
    import sys

    from mmpg.errors import UserError

    name = f"demo-{family}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides = [
        f"model.path={model_dir}", "model.dtype=float32", f"data.train={data_dir / 'train.json'}",
        f"data.videos={data_dir / 'videos'}", "data.batch_size=2", "data.fps=1.0", "data.max_frames=8",
        "data.num_workers=0", f"rollout.n={GROUP_SIZE}", f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
        f"trainer.micro_batch_size={GROUP_SIZE}", "trainer.device=cpu", f"trainer.output_dir={workdir / 'runs'}",
        f"trainer.run_name={name}", f"trainer.total_steps={steps}", "optim.lr=1e-4",
        f"checkpoint.every_n_steps={steps}", "checkpoint.keep_last=1", "logging.tensorboard=false"]
    proc = subprocess.run([sys.executable, "-m", "mmpg.cli", "train", *overrides], capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"the demo's training run failed (exit {proc.returncode}): "
                        f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return workdir / "runs" / name


def run_demo(workdir: str | Path = "data/generated/demo", family: str = "qwen2_5_vl", train_steps: int = 3) -> int:
    from mmpg.data.prompts import build_prompt_inputs
    from mmpg.data.video import VideoSpec, load_video
    from mmpg.grouping import grouped_logprobs, repeated_logprobs
    from mmpg.models.loading import load_policy, load_processor
    from mmpg.rewards import sample_reward
    from mmpg.rollout import HFEngine, SamplingParams

    from mmpg.errors import UserError
    from mmpg.models.tiny import VL_FAMILIES

    if train_steps < 0:
        raise UserError(f"--train-steps must be >= 0, got {train_steps}")
    if family not in VL_FAMILIES:
        raise UserError(f"the demo needs a video model family; choose one of {', '.join(VL_FAMILIES)}")
    start = time.perf_counter()
    workdir = Path(workdir)
    model_dir, data_dir, built = _ensure_artifacts(workdir, family)
    processor, model = load_processor(model_dir), load_policy(model_dir, dtype="float32")
    sample, n_samples = _first_sample(data_dir)
    video = load_video(sample.video, VideoSpec.for_family(family, fps=1.0, max_frames=8))
    inputs = build_prompt_inputs(processor, [sample], [video])

    rollout = HFEngine(model, processor).generate_groups(
        inputs, GROUP_SIZE, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, seed=0))
    rewards = [sample_reward(text, sample) for text in rollout.texts]
    overall = torch.tensor([r["overall"] for r in rewards])
    advantages = (overall - overall.mean()) / (overall.std() + 1e-6)
    with torch.no_grad():
        args = (model, inputs, rollout.completion_ids, rollout.completion_mask, rollout.group_sizes)
        grouped, repeated = grouped_logprobs(*args), repeated_logprobs(*args)
    diff = float(((grouped - repeated).abs() * rollout.completion_mask).max())

    print(f"mmpg demo ({family}, CPU, {time.perf_counter() - start:.1f} s)")
    print(f"  built now:   {', '.join(built) if built else 'nothing (reused what was there)'}")
    print(f"  checkpoint:  {model_dir}  (random weights, loaded with from_pretrained)")
    print(f"  videos:      {data_dir / 'videos'}  ({n_samples} validation queries in {data_dir / 'val.json'})")
    print(f"  question:    {sample.sample_id}: \"{sample.query}\" (truth {sample.span[0]:.1f}-{sample.span[1]:.1f} s "
          f"of {sample.duration:.1f} s)")
    print(f"  video input: {len(video.timestamps)} frames at {video.sample_fps:.2f} fps -> "
          f"{int(inputs['input_ids'].shape[1])} prompt tokens")
    print(f"  rollout:     {GROUP_SIZE} answers from one prefill (temperature 1.0, up to {MAX_NEW_TOKENS} tokens)")
    for i, (text, r) in enumerate(zip(rollout.texts, rewards)):
        shown = text.replace("\n", " ")[:60]
        print(f"    [{i}] reward {r['overall']:.2f} (format {r['format']:.0f}, iou {r['iou']:.2f}) "
              f"advantage {advantages[i]:+.2f}  {shown!r}")
    truth = f"<think>The {sample.query} moment.</think><answer>{sample.span[0]:.2f} to {sample.span[1]:.2f}</answer>"
    print(f"    (a correct answer would score {sample_reward(truth, sample)['overall']:.2f}: format 1 + iou_v2 1)")
    print(f"  grouped vs repeated forward: max |logprob difference| = {diff:.2e} over "
          f"{int(rollout.completion_mask.sum())} response tokens (float32)")
    if train_steps > 0:
        from mmpg.runs import RunReader

        run_dir = _train_briefly(model_dir, data_dir, workdir, family, train_steps)
        print(f"  training:    {train_steps} GRPO steps (DeepSpeed, CPU) -> run directory {run_dir}")
        for m in RunReader(run_dir).metrics():
            print(f"    step {m['step']}: reward {m['reward/mean']:.3f}, tIoU {m['reward/iou']:.3f}, "
                  f"{m['timing_s/step']:.1f} s")
        print("    metrics.jsonl, rollouts/ and checkpoints/ are there; longer: bash scripts/train_cpu_demo.sh")
        print(f"    look at it: mmpg inspect {run_dir}")
    print("  next: bash scripts/test.sh runs the test suite; README.md explains the pieces")
    return 0 if diff <= 1e-4 else 1
