"""The small run directory and evaluation folder of the inspector's tests, written with the writers of `mmpg.runs`,
with spans known in advance (SMALL_SPANS, SMALL_EVAL): `make_small_run`, `make_small_sft_run`, `make_eval_folder`.
A test fixture: nothing in mmpg/ or app/ imports it (tests/test_import_graph.py). The large synthetic run of the
inspector's benchmark and of `scripts/inspect.sh --example` is `mmpg.bench.inspector_run`.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mmpg.bench.inspector_run import thumbnail_frames, with_advantages
from mmpg.rewards.grounding import temporal_iou
from mmpg.runs import GroupRecord, ResponseRecord, RunWriter


# 3 steps x 2 groups x 4 responses with spans known in advance. Group (step, position) -> the 4 responses as
# (parsed span or None, finish reason). Chosen so each filter has a known answer:
#   (1, 0) every response gives the same span: all rewards equal     (2, 0) one truncated (and so unparsed) response
#   (1, 1) one answer that does not parse                            (3, 0) close to the truth: highest mean reward
#   (2, 1), (3, 1) ordinary; (3, 1) is far off: lowest mean reward
# SMALL_RAW: answers written outside the video, (step, position, response) -> the answer text: (2, 1) #3 is cut to the
# 20 s video (clamped: parsed [16, 20]); (3, 1) #3 lies wholly outside it (out of range: no span, format 1).
SMALL_GT = {0: [2.0, 6.0], 1: [10.0, 16.0]}  # position -> ground truth; durations 12 s and 20 s
SMALL_DURATION = {0: 12.0, 1: 20.0}
SMALL_SPANS = {
    (1, 0): [([3.0, 5.0], "stop")] * 4,
    (1, 1): [([9.0, 15.0], "stop"), ([11.0, 17.0], "stop"), (None, "stop"), ([12.0, 13.0], "stop")],
    (2, 0): [([1.0, 5.0], "stop"), ([2.5, 7.0], "stop"), (None, "length"), ([0.0, 3.0], "stop")],
    (2, 1): [([10.0, 16.0], "stop"), ([4.0, 9.0], "stop"), ([14.0, 19.5], "stop"), ([16.0, 20.0], "stop")],
    (3, 0): [([2.0, 6.0], "stop"), ([2.2, 5.8], "stop"), ([1.8, 6.0], "stop"), ([2.0, 5.5], "stop")],
    (3, 1): [([0.0, 2.0], "stop"), ([1.0, 3.0], "stop"), ([15.0, 19.0], "stop"), (None, "stop")],
}
SMALL_RAW = {(2, 1, 3): "16.0 to 24.0", (3, 1, 3): "24.0 to 30.0"}
# a config `mmpg plan` can plan (a preset model on this machine's CPU) and the peaks the run "measured"; the SFT run's
# model is a checkpoint that no longer exists, so its plan is one line saying why
SMALL_CONFIG = ("trainer:\n  run_name: small\n  device: cpu\n  micro_batch_size: 4\nmodel:\n  path: qwen3-vl-2b\n"
                "data:\n  batch_size: 2\n  max_frames: 4\nrollout:\n  n: 4\n  max_new_tokens: 64\n")
SMALL_PEAK_MB = {1: 32600.0, 2: 32950.0, 3: 32800.0}
SMALL_SFT_CONFIG = "trainer:\n  run_name: small-sft\nmodel:\n  path: /checkpoints/gone\n"


def _small_response(span, finish: str, gt: list[float], raw: str | None = None) -> ResponseRecord:
    if finish == "length":
        text = "<think>First the person opens the door, then " + "walks around " * 12
    elif raw is not None:
        text = f"<think>It happens late.</think> <answer>{raw}</answer>"
    elif span is None:
        text = "<think>Hard to say.</think> <answer>near the end</answer>"
    else:
        text = f"<think>The action starts at {span[0]} s and ends at {span[1]} s.</think> " \
               f"<answer>{span[0]:.1f} to {span[1]:.1f}</answer>"
    iou = temporal_iou(span, gt) if span else 0.0
    fmt = 1.0 if (span or raw) and finish == "stop" else 0.0
    return ResponseRecord(text=text, parsed_span=span, rewards={"overall": fmt + iou, "format": fmt, "iou": iou},
                          advantage=0.0, length=len(text) // 4, finish_reason=finish)


def write_video(path: str | os.PathLike, seconds: float = 4.0, fps: int = 8, width: int = 64,
                height: int = 48) -> Path:
    """A small H.264 mp4 whose frames fade from dark to light (for decode-on-demand)."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"threads": "1", "bf": "0"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        n = int(seconds * fps)
        for i in range(n):
            a = np.full((height, width, 3), int(30 + 200 * i / max(1, n - 1)), np.uint8)
            frame = av.VideoFrame.from_ndarray(a, format="rgb24")
            frame.pts = i
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def small_policy_version(step: int, position: int, max_staleness: int) -> int:
    """The weights that sampled group (step, position) of the small run with rollout.max_staleness = k: position 0
    lags k steps, position 1 one step (never before the initial weights, 0). k = 0: the weights after step - 1."""
    return max(0, step - 1 - (max_staleness if position == 0 else min(1, max_staleness)))


def make_small_run(out: str | os.PathLike, video_dir: str | os.PathLike | None = None,
                   max_staleness: int | None = None) -> Path:
    """The run of SMALL_SPANS, with metrics, eval lines and 4 thumbnails for the video of position 0.

    The video of position 1 has no thumbnails; it is written under `video_dir` when given (decoded on demand), and
    otherwise does not exist ("video file not available"). `max_staleness`: None writes a run from before the
    rollout/training overlap (no policy_version in its records, no rollout.max_staleness in its config, no staleness
    metrics); k >= 0 sets rollout.max_staleness = k, each record's policy_version (small_policy_version) and
    rollout/staleness_mean, _max. With k = 2 the staleness of (step, position 0, 1) is (1: 0, 0), (2: 1, 1),
    (3: 2, 1): step means 0, 1, 1.5 (their mean 0.833), maxes 0, 1, 2.
    """
    out = Path(out)
    rng = np.random.default_rng(0)
    writer = RunWriter(out, tensorboard=False)
    config = SMALL_CONFIG if max_staleness is None else SMALL_CONFIG + (
        f"  engine: vllm\n  tis_cap: 2.0\n  max_staleness: {max_staleness}\n" if max_staleness else
        "  max_staleness: 0\n")
    writer.start(config, kind="grpo", command=["pytest"],
                 extra={"device": "cpu", "devices": 1})
    videos = {0: "/data/videos/kitchen.mp4",
              1: str(write_video(Path(video_dir) / "garden.mp4", seconds=SMALL_DURATION[1], fps=4)) if video_dir
              else "/data/videos/garden.mp4"}
    keys = {0: writer.write_thumbnails(videos[0], thumbnail_frames(rng, 4), [1.5, 4.5, 7.5, 10.5]), 1: None}
    for step in (1, 2, 3):
        groups = []
        for pos in (0, 1):
            responses = with_advantages([_small_response(span, fin, SMALL_GT[pos], SMALL_RAW.get((step, pos, i)))
                                          for i, (span, fin) in enumerate(SMALL_SPANS[(step, pos)])])
            groups.append(GroupRecord(step=step, group_index=pos, sample_id=f"sample-{pos}", video=videos[pos],
                                      duration=SMALL_DURATION[pos], query=f"query of video {pos}: the person <cooks>",
                                      gt_span=SMALL_GT[pos], media_key=keys[pos], responses=responses,
                                      policy_version=None if max_staleness is None
                                      else small_policy_version(step, pos, max_staleness)))
        writer.write_rollouts(step, groups)
        rs = [r for g in groups for r in g.responses]
        ages = [g.staleness for g in groups]
        stale = {} if max_staleness is None else {"rollout/staleness_mean": float(np.mean(ages)),
                                                  "rollout/staleness_max": float(max(ages))}
        writer.log_metrics(step, {
            "reward/mean": float(np.mean([r.rewards["overall"] for r in rs])),
            "reward/format": float(np.mean([r.rewards["format"] for r in rs])),
            "reward/iou": float(np.mean([r.rewards["iou"] for r in rs])),
            "reward/parsed": float(np.mean([r.parsed_span is not None for r in rs])),
            "data/zero_adv_groups": float(np.mean([len({r.rewards["overall"] for r in g.responses}) == 1
                                                   for g in groups])),
            "response/length_mean": float(np.mean([r.length for r in rs])), "actor/kl": 0.001 * step,
            "actor/clip_fraction": 0.01 * step, "timing_s/rollout": 1.0 + step, "timing_s/update": 0.5,
            "perf/peak_memory_mb": SMALL_PEAK_MB[step], **stale,
        })
        writer.log_eval(step, {"eval/miou": 0.1 * step, "eval/r1@0.5": 0.05 * step})
    writer.close()
    return out


def make_small_sft_run(out: str | os.PathLike, steps: int = 40) -> Path:
    """An SFT run: sft/loss falling from about 2.4 to 0.6 over `steps` steps, no rollouts, and a held-out evaluation
    at step 0 (the starting point) and at the last step (SMALL_SFT_EVAL)."""
    out = Path(out)
    rng = np.random.default_rng(1)
    writer = RunWriter(out, tensorboard=False)
    writer.start(SMALL_SFT_CONFIG, kind="sft", command=["pytest"])
    for step in range(1, steps + 1):
        loss = 0.6 + 1.8 * np.exp(-step / 10) + 0.05 * float(rng.normal())
        writer.log_metrics(step, {"sft/loss": loss, "sft/target_tokens": 120.0, "actor/lr": 1e-5,
                                  "actor/grad_norm": 1.0 / step, "timing_s/step": 0.4})
    for step, metrics in SMALL_SFT_EVAL.items():
        writer.log_eval(step, {f"eval/{k}": v for k, v in metrics.items()})
    writer.close()
    return out


SMALL_SFT_EVAL = {0: {"miou": 0.12, "r1@0.5": 0.08, "r1@0.7": 0.02}, 40: {"miou": 0.586, "r1@0.5": 0.61, "r1@0.7": 0.3}}


# (index, gt, pred or None, error) of the small evaluation folder; IoUs follow
SMALL_EVAL = [
    (0, [1.0, 4.0], [1.0, 4.0], None),
    (1, [2.0, 6.0], [3.0, 8.0], None),
    (2, [0.0, 5.0], None, None),
    (3, [5.0, 9.0], [0.0, 1.0], None),
    (4, [1.0, 3.0], None, "video file missing"),
]


def make_eval_folder(folder: str | os.PathLike) -> Path:
    """An evaluation folder (EvalWriter) of SMALL_EVAL, with metrics.json, report.md and one plot."""
    from PIL import Image

    from mmpg.runs import EvalWriter, PredictionRecord

    folder = Path(folder)
    writer = EvalWriter(folder)
    writer.start({"checkpoint": "runs/small/checkpoints/step_00000003", "protocol": "test", "step": 3,
                  "settings": {"fps": 2}})
    records = []
    for index, gt, pred, error in SMALL_EVAL:
        text = "" if error else (f"<answer>{pred[0]} to {pred[1]}</answer>" if pred else "<answer>no idea</answer>")
        records.append(PredictionRecord(index=index, sample_id=f"eval-{index}", video=f"/data/eval/{index}.mp4",
                                        duration=10.0, query=f"eval query {index}", gt_span=gt, pred_span=pred,
                                        text=text, iou=temporal_iou(pred, gt) if pred else 0.0, error=error))
    writer.append(records)
    ious = [r.iou for r in records if r.error is None]
    writer.write_metrics({"count": len(ious), "miou": float(np.mean(ious)), "r1@0.5": float(np.mean(
        [i >= 0.5 for i in ious])), "failed": 1})
    writer.write_text("report.md", "# report\n")
    plot = writer.plot_path("iou_histogram.png")
    Image.fromarray(np.full((60, 90, 3), 200, np.uint8)).save(plot)
    return folder

