"""The learning demo's stages: artefacts, exactness check, evaluations, the SFT and GRPO runs, the report.

The two training stages run as `python -m mmpg.cli sft|train --config configs/... key=value ...` in their own
processes, exactly as a user starts them; this process follows their metrics.jsonl to print progress. The
evaluations call `mmpg eval`'s `evaluate_checkpoint`, so their folders (predictions, metrics, report.md, plots) are
the ones `mmpg eval` writes: the SFT and GRPO ones inside their run directories, where `mmpg inspect` shows them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mmpg.config.generated import DEMO_WORKDIR
from mmpg.errors import UserError

FAMILY = "qwen2_5_vl"
MODEL_SIZE = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}
N_VIDEOS, MIN_DURATION, MAX_DURATION, DATA_SEED = 400, 8.0, 20.0, 0
VIDEO = {"fps": 2.0, "min_pixels": 784, "max_pixels": 784}  # 28 x 28 frames: one video token per second
EVAL_NEW_TOKENS = 32  # the SFT answer is about 22 tokens; the untrained model writes 32 tokens of noise
CONFIGS = Path(__file__).resolve().parents[3] / "configs"
WORKDIR = DEMO_WORKDIR  # `mmpg demo --workdir`'s default


@dataclasses.dataclass(frozen=True)
class Preset:
    """How long each stage runs. test_samples: held-out videos evaluated (0: the whole test split)."""

    name: str
    sft_steps: int
    grpo_steps: int
    test_samples: int = 0


PRESETS = {
    "quick": Preset("quick", sft_steps=200, grpo_steps=90),
    "default": Preset("default", sft_steps=200, grpo_steps=200),
    "long": Preset("long", sft_steps=200, grpo_steps=500),
}


@dataclasses.dataclass
class Paths:
    workdir: Path
    model: Path
    data: Path
    runs: Path
    results: Path

    @classmethod
    def under(cls, workdir: Path, stamp: str) -> Paths:
        workdir = workdir.resolve()
        return cls(workdir, workdir / f"tiny-{FAMILY}", workdir / "easy", workdir / "runs",
                   workdir / "results" / stamp)


def _model_is_current(model_dir: Path) -> bool:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = cfg.get("text_config", cfg)
    sizes = (text.get("hidden_size"), text.get("num_hidden_layers"))
    return (cfg.get("model_type") == FAMILY and sizes == (MODEL_SIZE["hidden_size"], MODEL_SIZE["num_layers"])
            and (model_dir / "model.safetensors").is_file())


def _data_is_current(data_dir: Path) -> bool:
    try:
        events = json.loads((data_dir / "events.json").read_text())
    except (OSError, ValueError):
        return False
    return len(events) == N_VIDEOS and all((data_dir / f"{s}.json").is_file() for s in ("train", "val", "test"))


def ensure_artifacts(paths: Paths) -> list[str]:
    """Build the tiny checkpoint and the easy videos when missing or from an older demo; returns what was built."""
    from mmpg.toy.models import TinySpec, make_tiny
    from mmpg.toy.videos import generate_dataset

    built = []
    if not _model_is_current(paths.model):
        make_tiny(FAMILY, paths.model, seed=0, spec=TinySpec(**MODEL_SIZE), overwrite=True)
        built.append(f"tiny {FAMILY} checkpoint")
    if not _data_is_current(paths.data):
        generate_dataset(paths.data, n=N_VIDEOS, seed=DATA_SEED, overwrite=True, min_duration=MIN_DURATION,
                         max_duration=MAX_DURATION, easy=True)
        built.append(f"{N_VIDEOS} synthetic videos")
    return built


def load_split(paths: Paths, split: str):
    from mmpg.data.formats import load_annotations

    return load_annotations(paths.data / f"{split}.json", paths.data / "videos", fmt="auto", strict=True).samples


def exactness_check(paths: Paths, sample, group_size: int = 4, seed: int = 0) -> tuple[float, int]:
    """Sample `group_size` answers to one prompt from the untrained model and compare the grouped forward's
    logprobs with the repeated one's. Returns (max |difference|, response tokens compared)."""
    import torch

    from mmpg.data.prompts import build_prompt_inputs
    from mmpg.data.video import VideoSpec, load_video
    from mmpg.grouping import grouped_logprobs, repeated_logprobs
    from mmpg.models.loading import load_policy, load_processor
    from mmpg.rollout import HFEngine, SamplingParams

    processor, model = load_processor(paths.model), load_policy(paths.model, dtype="float32")
    video = load_video(sample.video, VideoSpec.for_family(FAMILY, **VIDEO))
    inputs = build_prompt_inputs(processor, [sample], [video])
    rollout = HFEngine(model, processor).generate_groups(
        inputs, group_size, SamplingParams(max_new_tokens=EVAL_NEW_TOKENS, temperature=1.0, seed=seed))
    with torch.no_grad():
        args = (model, inputs, rollout.completion_ids, rollout.completion_mask, rollout.group_sizes)
        diff = (grouped_logprobs(*args) - repeated_logprobs(*args)).abs() * rollout.completion_mask
    return float(diff.max()), int(rollout.completion_mask.sum())


def evaluate(checkpoint: Path, paths: Paths, out: Path, preset: Preset):
    """Greedy evaluation on the test split into `out` (a finished folder with the same settings is reused)."""
    from mmpg.eval.runner import evaluate_checkpoint
    from mmpg.eval.settings import load_settings

    settings = load_settings("default", [f"fps={VIDEO['fps']}", f"min_pixels={VIDEO['min_pixels']}",
                                         f"max_pixels={VIDEO['max_pixels']}", f"max_new_tokens={EVAL_NEW_TOKENS}",
                                         f"max_samples={preset.test_samples}", "device=cpu"])
    return evaluate_checkpoint(checkpoint, paths.data / "test.json", paths.data / "videos", out, settings,
                               benchmark="test")


def _progress_line(kind: str, m: dict, total: int) -> str:
    if kind == "sft":
        what = f"loss {m.get('sft/loss', float('nan')):.3f}"
    else:
        what = f"reward {m.get('reward/mean', float('nan')):.3f} (tIoU {m.get('reward/iou', float('nan')):.3f})"
    name = "SFT" if kind == "sft" else "GRPO"
    return f"    {name:<4} step {m['step']:>4}/{total}  {what}  {m.get('timing_s/step', 0.0):.2f} s/step"


def train_stage(kind: str, config: str, overrides: list[str], run_dir: Path, total: int, log_path: Path,
                every: int) -> float:
    """Run `mmpg sft|train` in its own process; print a progress line every `every` steps. Returns seconds."""
    from mmpg.runs import RunReader

    if not (CONFIGS / config).is_file():
        raise UserError(f"{CONFIGS / config}: the demo's config is missing; run the demo from a checkout of mmpg")
    cmd = [sys.executable, "-m", "mmpg.cli", kind, "--config", str(CONFIGS / config), *overrides]
    start, shown = time.perf_counter(), 0
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        while True:
            done = proc.poll() is not None
            if (run_dir / "metrics.jsonl").is_file():
                for m in RunReader(run_dir).metrics():
                    if m["step"] > shown and (m["step"] % every == 0 or m["step"] == total):
                        print(_progress_line(kind, m, total), flush=True)
                    shown = max(shown, m["step"])
            if done:
                break
            time.sleep(1.0)
    if proc.returncode != 0:
        tail = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()][-3:]
        raise UserError(f"the demo's `mmpg {kind}` stage failed (exit {proc.returncode}); its output is in "
                        f"{log_path}; last lines: {' | '.join(tail) or 'none'}")
    return time.perf_counter() - start


def final_checkpoint(run_dir: Path) -> Path:
    from mmpg.runs import list_checkpoints

    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        raise UserError(f"{run_dir}: the run finished without a checkpoint")
    return ckpts[-1][1]


def stage_overrides(paths: Paths, seed: int, steps: int, run_name: str) -> list[str]:
    """A demo training stage's config overrides: its model and data, run name, steps, one checkpoint at the end."""
    return [f"model.path={paths.model}", f"data.train={paths.data / 'train.json'}",
            f"data.val={paths.data / 'val.json'}", f"data.videos={paths.data / 'videos'}",
            f"trainer.output_dir={paths.runs}", f"trainer.run_name={run_name}", f"trainer.total_steps={steps}",
            f"trainer.seed={seed}", f"checkpoint.every_n_steps={steps}", "checkpoint.keep_last=1",
            "eval.every_n_steps=0"]


def run_demo(workdir: str | Path = "data/generated/demo", preset: str | Preset = "default", seed: int = 0,
             sft_steps: int | None = None, grpo_steps: int | None = None) -> int:
    """Run every stage and print the report; returns 0, or 1 when the grouped forward disagrees with the naive one."""
    from transformers.utils import logging as hf_logging

    from mmpg.toy.demo import summary

    hf_logging.disable_progress_bar()  # "Loading weights" bars; each stage prints its own progress
    p = PRESETS[preset] if isinstance(preset, str) else preset
    p = dataclasses.replace(p, sft_steps=p.sft_steps if sft_steps is None else sft_steps,
                            grpo_steps=p.grpo_steps if grpo_steps is None else grpo_steps)
    if p.sft_steps <= 0 or p.grpo_steps <= 0:
        raise UserError(f"the demo needs at least one SFT and one GRPO step, got {p.sft_steps} and {p.grpo_steps}")
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{p.name}-seed{seed}"
    paths = Paths.under(Path(workdir), stamp)
    clock = summary.Clock()
    print(f"mmpg demo: {p.name} ({p.sft_steps} SFT + {p.grpo_steps} GRPO steps, seed {seed}) in {paths.workdir}",
          flush=True)
    with clock("build"):
        built = ensure_artifacts(paths)
    train, test = load_split(paths, "train"), load_split(paths, "test")
    print(f"  built now: {', '.join(built) if built else 'nothing (reused the checkpoint and videos there)'}")
    with clock("check"):
        diff, tokens = exactness_check(paths, test[0], seed=seed)
    print(f"  grouped vs repeated forward: max |logprob difference| {diff:.1e} over {tokens} response tokens "
          "(float32)", flush=True)

    rows = summary.Rows(summary.baselines(train, test[:p.test_samples] if p.test_samples else test))
    with clock("eval"):
        rows.add("untrained", "untrained", evaluate(paths.model, paths, paths.results / "eval-untrained", p))
    print(f"  untrained: {rows.line('untrained')}", flush=True)

    sft_run = paths.runs / f"{stamp}-sft"
    print(f"  SFT warm start -> {sft_run}", flush=True)
    with clock("sft"):
        train_stage("sft", "sft_cpu_demo.yaml", stage_overrides(paths, seed, p.sft_steps, sft_run.name), sft_run,
                    p.sft_steps, paths.results / "sft.log", every=max(1, p.sft_steps // 5))
    sft_ckpt = final_checkpoint(sft_run)
    with clock("eval"):
        rows.add("sft", f"SFT ({p.sft_steps} steps)", evaluate(sft_ckpt, paths, eval_out(sft_ckpt), p))
    print(f"  after SFT: {rows.line('sft')}", flush=True)

    grpo_run = paths.runs / f"{stamp}-grpo"
    print(f"  GRPO from {sft_ckpt.name} -> {grpo_run}", flush=True)
    grpo_overrides = stage_overrides(paths, seed, p.grpo_steps, grpo_run.name)
    grpo_overrides[0] = f"model.path={sft_ckpt}"
    with clock("grpo"):
        train_stage("train", "cpu_demo.yaml", grpo_overrides, grpo_run, p.grpo_steps, paths.results / "grpo.log",
                    every=max(1, p.grpo_steps // 10))
    grpo_ckpt = final_checkpoint(grpo_run)
    with clock("eval"):
        result = evaluate(grpo_ckpt, paths, eval_out(grpo_ckpt), p)
    rows.add("grpo", f"SFT + GRPO ({p.grpo_steps} steps)", result)

    report = summary.DemoReport(p, seed, paths, rows, clock, sft_run, grpo_run, diff)
    report.write()
    print(report.text(), flush=True)
    return 0 if diff <= 1e-4 else 1


def eval_out(checkpoint: Path) -> Path:
    """Where `mmpg eval` writes a checkpoint's test-split evaluation (its default: RUN/evals/test/step_N)."""
    from mmpg.eval.cli import default_out

    return default_out(str(checkpoint), "test")
