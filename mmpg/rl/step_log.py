"""What a GRPO step reports: the metrics line (namespaced as verl does: reward/, response/, actor/, data/, timing_s/,
check/, alarm/, rollout/, perf/) and the rollout records of the run directory. Every metric is listed with its
meaning in docs/inspector.md ("The metrics of a GRPO step").

Contract: the metrics are over the whole global batch (rank 0 computes them from every group's `group_summary` and
the update's all-reduced sums), timings are the slowest rank's, and a metric that does not apply to a step (no
update, no self-check, another rollout engine) is left out rather than written as 0.
"""

from __future__ import annotations

import numpy as np
import torch

from mmpg.data.dataset import video_key
from mmpg.runs import GroupRecord, ResponseRecord
from mmpg.train.peak_memory import peak_memory_mb  # the GPU's tensors, or the CPU's memory above its baseline


def group_summary(g, step: int) -> dict:
    """The small, picklable facts of one group of `step` that rank 0 needs for the metrics."""
    return {
        "rewards": g.rewards,
        # the model's own tokens (multi-turn: the tool's turns between them are not the model's)
        "lengths": (g.completion_mask if g.own_mask is None else g.own_mask).sum(dim=1).tolist(),
        "truncated": [r == "length" for r in g.finish_reasons],
        "prompt_tokens": int(g.inputs["input_ids"].shape[1]),
        "gt_clamped": g.sample.raw_span is not None,
        "video": video_key(g.sample),
        "staleness": 0 if g.policy_version is None else step - 1 - g.policy_version,
    }


def step_metrics(summaries: list[dict], sums: dict, infos: list[dict], skipped_total: int, device: str) -> dict:
    """summaries: every group of the global batch; sums: the update's all-reduced sums; infos: each rank's collect
    info (skips, rounds, timing)."""
    rewards = [r for s in summaries for r in s["rewards"]]
    lengths = [n for s in summaries for n in s["lengths"]]
    overall = np.array([r["overall"] for r in rewards], dtype=np.float64)
    m: dict[str, float] = {}
    if rewards:
        m["reward/mean"], m["reward/std"] = float(overall.mean()), float(overall.std())
        for key in sorted({k for r in rewards for k in r if k != "overall"}):
            m[f"reward/{key}"] = float(np.mean([r.get(key, 0.0) for r in rewards]))
        m["response/length_mean"], m["response/length_max"] = float(np.mean(lengths)), float(max(lengths))
        m["response/truncated"] = float(np.mean([t for s in summaries for t in s["truncated"]]))
        equal = [len({r["overall"] for r in s["rewards"]}) <= 1 for s in summaries]
        m["data/zero_adv_groups"] = float(np.mean(equal))
    tokens, real = sums.get("tokens", 0.0), sums.get("real_tokens", 0.0)
    if "loss" in sums:
        m["actor/loss"] = sums["loss"]
        m["actor/kl"] = sums["kl"] / tokens if tokens else 0.0
        m["actor/clip_fraction"] = sums["clipped"] / tokens if tokens else 0.0
        m["actor/entropy"] = sums["entropy"] / real if real else 0.0
        m["actor/logprob_gap_mean"] = sums["gap"] / real if real else 0.0
        m["actor/logprob_gap_max"] = sums["gap_max"]
        m["actor/grad_norm"] = sums["grad_norm"]
        m["actor/lr"] = sums["lr"]
        m["perf/shared_prompts"] = sums.get("shared_prompts", 0.0)
        m["perf/row_tokens"] = sums.get("row_tokens", 0.0)
    else:
        m["actor/skipped_update"] = 1.0
    m["data/skipped"] = float(sum(i["skipped"] for i in infos))
    m["data/skipped_total"] = float(skipped_total)
    if any("too_long" in i for i in infos):  # rollout.engine=vllm: prompts its server could not hold (mmpg.rl.too_long)
        m["data/too_long"] = float(sum(i.get("too_long", 0) for i in infos))
    m["data/gt_clamped"] = float(sum(s.get("gt_clamped", False) for s in summaries))
    m["data/dropped_groups"] = float(sum(i["dropped_groups"] for i in infos))
    m["data/sampling_rounds"] = float(max(i["rounds"] for i in infos))
    # data/videos_*: how the step's batches got their videos (`GroundingBatch.decode_stats`), summed over data ranks
    m["data/videos_decoded"] = float(sum(i.get("videos_decoded", 0) for i in infos))
    m["data/videos_cached"] = float(sum(i.get("videos_cached", 0) for i in infos))
    for phase in ("data", "rollout", "reward", "logprob", "update", "step"):
        m[f"timing_s/{phase}"] = max(i["timing"].get(phase, 0.0) for i in infos)
    m.update({k: float(v) for k, v in sums.items() if k.startswith("check/")})  # the steps that self-checked
    if "check/grouped_vs_repeated_max" in sums:
        m["timing_s/self_check"] = max(i["timing"].get("self_check", 0.0) for i in infos)
    all_tokens = sum(s["prompt_tokens"] * len(s["lengths"]) for s in summaries) + sum(lengths)
    step_s = m["timing_s/step"]
    m["perf/tokens_per_s"] = all_tokens / step_s if step_s > 0 else 0.0
    m["perf/peak_memory_mb"] = peak_memory_mb(device)
    m["perf/videos"] = float(len({s["video"] for s in summaries if "video" in s}))
    m["perf/vision_calls"] = float(sum(i.get("vision_calls", 0) for i in infos))
    m["perf/prefix_tokens"] = float(sum(i.get("prefix_tokens", 0) for i in infos))
    stale = [s["staleness"] for s in summaries if "staleness" in s]
    if stale:  # steps between the weights that sampled a group and those it trained (rollout.max_staleness)
        m["rollout/staleness_mean"], m["rollout/staleness_max"] = float(np.mean(stale)), float(max(stale))
    return m  # non-finite values are written as null by mmpg.runs


DRIFT_STEPS = 3  # steps in a row with actor/logprob_gap_max above the bound before the drift alarm


class DriftAlarm:
    """Warns when the rollout engine and the training forward keep disagreeing: actor/logprob_gap_max (max |rollout
    logprob - training logprob| over the step's tokens) above `bound` (the dtype's self-check bound,
    `mmpg.grouping.bounds.bound_for`) for `steps` steps in a row. Such a gap found transformers 5.17's dropped
    video, and shared-prefix kernels have caused it elsewhere (verl issue 3595)."""

    def __init__(self, bound: float, steps: int = DRIFT_STEPS):
        self.bound, self.steps, self.streak = bound, steps, 0

    def update(self, step: int, metrics: dict) -> str | None:
        """Count this step; on an alarm set metrics["alarm/logprob_drift"] = 1 and return the warning line."""
        gap = metrics.get("actor/logprob_gap_max")
        if gap is None:
            return None
        self.streak = self.streak + 1 if not gap <= self.bound else 0  # NaN counts as above
        if self.streak < self.steps:
            return None
        metrics["alarm/logprob_drift"] = 1.0
        return (f"logprob drift at step {step}: actor/logprob_gap_max {gap:.3g} above {self.bound:.3g} for "
                f"{self.streak} steps in a row: the rollout engine samples from another distribution than the "
                "training forward scores (engine, kernels or versions differ); see the run's self-check and "
                "rollout.tis_cap")


def group_records(step: int, groups, first_index: int, media_keys: dict, logprobs: bool = False) -> list[GroupRecord]:
    """This rank's groups as run-directory records (group_index counts over the global batch); `logprobs`: with each
    response's token ids, behaviour logprobs and the trainer's (logging.rollout_logprobs)."""
    out = []
    for j, g in enumerate(groups):
        s = g.sample
        responses = [
            ResponseRecord(text=text, parsed_span=span, rewards=dict(r), advantage=float(a), length=int(n),
                           finish_reason=fr, turns=trajectory(g, i), **(tokens(g, i) if logprobs else {}))
            for i, (text, r, span, a, n, fr) in enumerate(zip(g.texts, g.rewards, g.spans, g.advantages.tolist(),
                                                              g.completion_mask.sum(dim=1).tolist(),
                                                              g.finish_reasons))]
        out.append(GroupRecord(step=step, group_index=first_index + j, sample_id=s.sample_id, video=s.video,
                               duration=float(s.duration), query=s.query, gt_span=[float(s.span[0]),
                                                                                    float(s.span[1])],
                               media_key=media_keys.get(s.video), policy_version=g.policy_version,
                               responses=responses))
    return out


def trajectory(g, i: int) -> list[dict] | None:
    """Row i of a multi-turn group as its record writes it (`ResponseRecord.turns`), None for one turn."""
    from mmpg.rollout.zoom import trajectory_turns

    return None if g.turns is None else trajectory_turns(g.turns[i], g.tools[i])


def tokens(g, i: int) -> dict:
    """Response i of group g: its token ids, the engine's logprobs and the trainer's (None before an update)."""
    n = int(g.completion_mask[i].sum())
    train = getattr(g, "train_logprobs", None)
    return {"token_ids": g.completion_ids[i, :n].tolist(), "logprobs": g.rollout_logprobs[i, :n].tolist(),
            "train_logprobs": train[i, :n].tolist() if train is not None else None}


def thumbnails(video, count: int) -> tuple[list[np.ndarray], list[float]]:
    """`count` evenly spaced frames of a DecodedVideo as HxWx3 uint8 arrays, and their times in seconds. Of a
    `VideoPart` (a sequence-parallel rank decodes only its frames): its own frames, at their times in the whole."""
    frames = video.frames  # [T, C, H, W] float 0..255
    t, first = frames.shape[0], getattr(video, "first_frame", 0)
    idx = sorted({round(i * (t - 1) / max(1, count - 1)) for i in range(min(count, t))})
    pics = [frames[i].permute(1, 2, 0).clamp(0, 255).to(torch.uint8).numpy() for i in idx]
    return pics, [float(video.timestamps[first + i]) for i in idx]
