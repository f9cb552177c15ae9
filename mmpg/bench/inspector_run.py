"""A large synthetic run directory written with the writers of `mmpg.runs`, for the inspector's benchmark
(`python -m mmpg.bench.inspector`) and a look at the inspector without training anything
(`bash scripts/inspect.sh --example`):

    python -m mmpg.bench.inspector_run runs/synthetic_inspector   # 1,000 steps x 16 groups x 8 responses (a minute)
    mmpg inspect runs/synthetic_inspector

Rewards follow the default reward (format + tIoU) so the curves and tables look like a real run's; numbers are
random but seeded. The tests' small run, with spans known in advance, is tests/synthetic_run.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from mmpg.rewards.grounding import temporal_iou
from mmpg.runs import GroupRecord, ResponseRecord, RunWriter

# a config `mmpg plan` can plan (a preset model on this machine's CPU), so the inspector's plan card has one
CONFIG = ("trainer:\n  run_name: synthetic\n  device: cpu\n  micro_batch_size: 4\nmodel:\n  path: qwen3-vl-2b\n"
          "data:\n  batch_size: 2\n  max_frames: 4\nrollout:\n  n: 4\n  max_new_tokens: 64\n")


def thumbnail_frames(rng: np.random.Generator, count: int, h: int = 72, w: int = 128) -> list[np.ndarray]:
    """Flat-coloured frames with a moving bar, so a frame strip is recognisable."""
    base = rng.integers(40, 200, size=3)
    out = []
    for i in range(count):
        a = np.empty((h, w, 3), np.uint8)
        a[:] = base
        x = int((w - 12) * i / max(1, count - 1))
        a[:, x:x + 12] = 255 - base
        out.append(a)
    return out


def _response(rng: np.random.Generator, gt: list[float], duration: float, max_tokens: int) -> ResponseRecord:
    kind = rng.random()
    if kind < 0.08:  # truncated mid-thought
        text = "<think>The person walks to the " + "door and then " * 20
        span, finish, length = None, "length", max_tokens
    elif kind < 0.15:  # answered in a form the parser does not read
        text = "<think>It happens near the middle.</think> <answer>somewhere in the middle</answer>"
        span, finish, length = None, "stop", int(rng.integers(20, 60))
    else:
        centre = (gt[0] + gt[1]) / 2 + rng.normal(0, duration / 8)
        half = max(0.5, (gt[1] - gt[0]) / 2 * rng.uniform(0.5, 1.6))
        span = [round(max(0.0, centre - half), 2), round(min(duration, centre + half), 2)]
        text = (f"<think>The query mentions an action; frames around {span[0]:.1f}s show it starting and it ends "
                f"near {span[1]:.1f}s.</think> <answer>{span[0]:.2f} to {span[1]:.2f}</answer>")
        finish, length = "stop", int(rng.integers(30, 120))
    iou = temporal_iou(span, gt) if span else 0.0
    fmt = 1.0 if span and finish == "stop" else 0.0
    rewards = {"overall": fmt + iou, "format": fmt, "accuracy": iou, "iou": iou, "parsed": 1.0 if span else 0.0}
    return ResponseRecord(text=text, parsed_span=span, rewards=rewards, advantage=0.0, length=length,
                          finish_reason=finish)


def with_advantages(responses: list[ResponseRecord]) -> list[ResponseRecord]:
    overall = np.array([r.rewards["overall"] for r in responses])
    std = overall.std()
    for r, x in zip(responses, overall):
        r.advantage = float((x - overall.mean()) / (std + 1e-6)) if std > 0 else 0.0
    return responses


def make_run(out: str | os.PathLike, steps: int = 1000, groups: int = 16, g: int = 8, videos: int = 48,
             frames: int = 8, seed: int = 0, eval_every: int = 50) -> Path:
    """Write a run directory of `steps` steps x `groups` groups x `g` responses into `out` (must not exist)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    rng = np.random.default_rng(seed)
    writer = RunWriter(out, tensorboard=False)
    writer.start(CONFIG, kind="grpo", command=["python", "-m", "mmpg.bench.inspector_run"],
                 extra={"device": "cpu", "devices": 1})
    catalogue = []
    for v in range(videos):
        duration = float(rng.uniform(20, 120))
        start = float(rng.uniform(0, duration * 0.7))
        gt = [round(start, 2), round(min(duration, start + rng.uniform(3, duration * 0.3)), 2)]
        path = f"/data/videos/synthetic_{v:03d}.mp4"  # not on disk: the app shows the stored thumbnails
        times = [duration * (i + 0.5) / frames for i in range(frames)]
        key = writer.write_thumbnails(path, thumbnail_frames(rng, frames), times)
        catalogue.append((path, duration, gt, key, f"person does action number {v} in the room"))
    for step in range(1, steps + 1):
        records, overall, lengths = [], [], []
        for b in range(groups):
            path, duration, gt, key, query = catalogue[int(rng.integers(videos))]
            responses = with_advantages([_response(rng, gt, duration, 256) for _ in range(g)])
            records.append(GroupRecord(step=step, group_index=b, sample_id=f"s{step}-{b}", video=path,
                                       duration=duration, query=query, gt_span=gt, media_key=key,
                                       responses=responses))
            overall += [r.rewards["overall"] for r in responses]
            lengths += [r.length for r in responses]
        writer.write_rollouts(step, records)
        progress = step / steps
        writer.log_metrics(step, {
            "reward/mean": float(np.mean(overall)), "reward/std": float(np.std(overall)),
            "reward/iou": float(np.mean([r.rewards["iou"] for g_ in records for r in g_.responses])),
            "reward/format": float(np.mean([r.rewards["format"] for g_ in records for r in g_.responses])),
            "reward/parsed": float(np.mean([r.rewards["parsed"] for g_ in records for r in g_.responses])),
            "data/zero_adv_groups": float(np.mean([all(r.advantage == 0.0 for r in g_.responses) for g_ in records])),
            "response/length_mean": float(np.mean(lengths)), "response/length_max": float(max(lengths)),
            "actor/kl": 0.001 * progress + 1e-4 * float(rng.random()),
            "actor/clip_fraction": 0.02 + 0.01 * float(rng.random()), "actor/loss": float(rng.normal(0, 0.1)),
            "timing_s/rollout": 10 + float(rng.random()), "timing_s/reward": 0.1, "timing_s/logprob": 2.0,
            "timing_s/update": 4 + float(rng.random()), "timing_s/step": 17.0,
            "perf/peak_memory_mb": 32600.0 + 400 * float(rng.random()),
        })
        if eval_every and step % eval_every == 0:
            m = 0.2 + 0.3 * progress + 0.02 * float(rng.random())
            writer.log_eval(step, {"eval/miou": m, "eval/r1@0.3": min(1.0, m * 1.6), "eval/r1@0.5": m,
                                   "eval/r1@0.7": m / 2})
    writer.close()
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print(make_run(argv[0] if argv else "runs/synthetic_inspector"), "written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
