"""Training curves over steps, as long-format tables (step, value, series) for Gradio's line plots.

Every panel has a unit (its y axis) and a one-line description (its caption). Panels a run did not log, and panels
whose every value is 0 (KL at beta = 0, the clip fraction of a single update per batch), are hidden and named in one
note. Series of one panel that are identical at every step (accuracy = iou_v2 under the default reward) are drawn
once, named "a = b". Options: smoothing, an exponential moving average as TensorBoard's slider,

    s_0 = v_0,   s_t = w s_{t-1} + (1 - w) v_t        (w in [0, 1); 0: the raw values)

applied before thinning (not to the held-out evaluations: a few points, each a measurement), and a log scale
(log10 of the values; values <= 0 are left out).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import pandas as pd

from mmpg.runs import metric_series

_SKIP_REWARD = {"reward/iou", "reward/std"}  # tIoU has its own panel; the spread is a health check


def _reward_keys(keys: set[str]) -> list[str]:
    rest = sorted(k for k in keys if k.startswith("reward/") and k not in _SKIP_REWARD and k != "reward/mean")
    return (["reward/mean"] if "reward/mean" in keys else []) + rest


# a step's phases in the order they run, the data wait first and the whole step last (the legend's order); a phase
# not named here goes before the step
PHASE_ORDER = ("data", "rollout_wait", "rollout", "reward", "self_check", "logprob", "update", "weight_sync")


def _timing_keys(keys: set[str]) -> list[str]:
    phases = [k for k in keys if k.startswith("timing_s/")]
    rank = {f"timing_s/{p}": i for i, p in enumerate(PHASE_ORDER)}
    return sorted(phases, key=lambda k: (k == "timing_s/step", rank.get(k, len(rank)), k))


def _data_wait_keys(keys: set[str]) -> list[str]:
    """The data wait against the whole step; nothing for a run that does not log the wait."""
    return [k for k in ("timing_s/data", "timing_s/step") if k in keys] if "timing_s/data" in keys else []


class Panel(NamedTuple):
    id: str
    title: str
    unit: str  # the y axis title
    what: str  # one line under the panel
    keys: list[str] | Callable[[set[str]], list[str]]
    strip: str = ""  # prefix left out of the series names (keeps the legend short)


PANELS: list[Panel] = [
    Panel("reward", "Reward", "reward per response",
          "mean over the step's responses: overall (reward/mean) = format + accuracy, and each part", _reward_keys,
          "reward/"),
    Panel("iou", "tIoU", "tIoU (0-1)", "mean tIoU of the sampled spans with the truth (reward/iou)", ["reward/iou"],
          "reward/"),
    Panel("loss", "Loss", "loss per token", "GRPO's policy loss (actor/loss) or SFT's cross-entropy (sft/loss)",
          ["sft/loss", "actor/loss"]),
    Panel("signal", "Learning signal (GRPO health)", "share / reward",
          "reward std over the step's responses; share of groups whose rewards were all equal (zero advantage: "
          "no gradient from them)", ["reward/std", "data/zero_adv_groups"]),
    Panel("entropy", "Policy entropy (GRPO health)", "nats per token",
          "mean -log p of the sampled tokens; a fall toward 0 means the samples stop exploring", ["actor/entropy"],
          "actor/"),
    Panel("grad", "Gradient norm (GRPO health)", "L2 norm", "before clipping; spikes precede instabilities",
          ["actor/grad_norm"], "actor/"),
    Panel("gap", "Logprob gap, rollout vs training (GRPO health)", "nats per token",
          "|rollout logprob - training logprob| per token; a max above the dtype's bound for several steps raises "
          "the drift alarm", ["actor/logprob_gap_mean", "actor/logprob_gap_max"], "actor/"),
    Panel("staleness", "Rollout staleness (overlap)", "steps",
          "updates between the weights that sampled the step's groups and those it trained, mean and max over its "
          "groups (0: synchronous; at most rollout.max_staleness)", ["rollout/staleness_mean",
                                                                     "rollout/staleness_max"], "rollout/"),
    Panel("length", "Response length", "tokens", "mean and longest response of the step; truncation share in "
          "response/truncated", ["response/length_mean", "response/length_max", "response/truncated"], "response/"),
    Panel("kl", "KL to the reference", "nats per token", "k3 estimate per token (0 when algorithm.beta = 0)",
          ["actor/kl"], "actor/"),
    Panel("clip", "Clip fraction", "share of tokens", "tokens whose ratio was clipped (0 with one update per batch)",
          ["actor/clip_fraction"], "actor/"),
    Panel("skipped", "Skipped samples", "samples per step", "samples left out of the step: unreadable videos and, "
          "with vLLM, prompts longer than its server's max_model_len (too_long)", ["data/skipped", "data/too_long"],
          "data/"),
    Panel("timing", "Time per phase", "seconds per step", "wall time of each phase of a step (slowest rank), "
          "data: the wait for its batch", _timing_keys, "timing_s/"),
    Panel("data_wait", "Data wait (does decoding keep up?)", "seconds per step",
          "the step's wait for its batch (timing_s/data, slowest rank) beside the whole step; a large part of it: "
          "the GPUs wait for the decoders (more data.num_workers, or a frame cache)", _data_wait_keys,
          "timing_s/"),
    Panel("videos", "Videos read", "videos per step", "the step's videos read from their files (decoded) or "
          "from the frame cache (cached), all ranks", ["data/videos_decoded", "data/videos_cached"], "data/videos_"),
    Panel("frames", "Frames decoded (busiest rank)", "frames per step", "the most frames one rank decoded from "
          "files in the step; under sequence parallelism each rank decodes only its part of each video (1/sp)",
          ["data/frames_decoded_max"], "data/"),
]
EVAL_PANEL = Panel("eval", "Held-out evaluation during training", "share (0-1)",
                   "R1@m and mIoU of the policy on data.val (eval.jsonl)", [], "eval/")
SMOOTHING = ("off", "0.6", "0.9", "0.99")  # the EMA weight w
_NOT_METRICS = {"v", "step", "time"}
MAX_POINTS = 200  # per series: the browser draws every point (1,000 steps x 7 panels at 1,500 took 7.9 s)


def metric_keys(records: list[dict]) -> list[str]:
    """Every numeric metric name that appears in the records, sorted."""
    keys = set()
    for r in records:
        keys.update(k for k, v in r.items() if k not in _NOT_METRICS and isinstance(v, (int, float))
                    and not isinstance(v, bool))
    return sorted(keys)


def smooth(values: list[float], w: float) -> list[float]:
    """EMA with weight w (0: unchanged)."""
    out: list[float] = []
    for v in values:
        out.append(v if not out or w <= 0 else w * out[-1] + (1 - w) * v)
    return out


def _series(records: list[dict], key: str) -> list[tuple[int, float]]:
    s, v = metric_series(records, key)
    return [(a, float(b)) for a, b in zip(s, v) if isinstance(b, (int, float)) and math.isfinite(float(b))]


def merge_identical(named: list[tuple[str, list[tuple[int, float]]]]) -> list[tuple[str, list[tuple[int, float]]]]:
    """Series equal at every step drawn once, their names joined with ' = ' (first appearance order)."""
    out: list[tuple[str, list[tuple[int, float]]]] = []
    for name, points in named:
        twin = next((i for i, (_, p) in enumerate(out) if p == points), None)
        if twin is None:
            out.append((name, points))
        else:
            out[twin] = (f"{out[twin][0]} = {name}", points)
    return out


def long_frame(records: list[dict], keys: list[str], strip: str = "", max_points: int = MAX_POINTS,
               smoothing: float = 0.0, log: bool = False) -> pd.DataFrame:
    """Columns step (int), value (float), series (str: the metric name less `strip`); missing/NaN values left out.
    Identical series are merged, then smoothed, then put on a log10 scale if asked (values <= 0 dropped), then a
    series longer than `max_points` keeps every k-th point and the last one (the browser draws every point)."""
    named = [(k[len(strip):] if strip and k.startswith(strip) else k, _series(records, k)) for k in keys]
    steps, values, series = [], [], []
    for name, good in merge_identical([(n, p) for n, p in named if p]):
        vals = smooth([v for _, v in good], smoothing)
        good = [(s, v) for (s, _), v in zip(good, vals)]
        if log:
            good = [(s, math.log10(v)) for s, v in good if v > 0]
        if len(good) > max_points:
            k = -(-len(good) // max_points)
            good = good[::k] + ([good[-1]] if (len(good) - 1) % k else [])
        steps += [a for a, _ in good]
        values += [b for _, b in good]
        series += [name] * len(good)
    return pd.DataFrame({"step": pd.Series(steps, dtype="int64"), "value": pd.Series(values, dtype="float64"),
                         "series": pd.Series(series, dtype="str")})


def panel_keys(panel: Panel, present: set[str], eval_metrics: list[dict] | None = None) -> list[str]:
    if panel.id == EVAL_PANEL.id:
        return [k for k in metric_keys(eval_metrics or []) if not k.endswith(("skipped", "count", "failed"))]
    return panel.keys(present) if callable(panel.keys) else [k for k in panel.keys if k in present]


def curve_frames(metrics: list[dict], eval_metrics: list[dict], smoothing: float = 0.0,
                 log: bool = False) -> dict[str, pd.DataFrame]:
    """Panel id -> long table; every panel of PANELS plus 'eval' (empty tables where nothing was logged)."""
    present = set(metric_keys(metrics))
    out = {}
    for p in PANELS:
        out[p.id] = long_frame(metrics, panel_keys(p, present), p.strip, smoothing=smoothing, log=log)
    out[EVAL_PANEL.id] = long_frame(eval_metrics, panel_keys(EVAL_PANEL, present, eval_metrics), EVAL_PANEL.strip,
                                    log=log)  # a few evaluations: points in their own right, never smoothed
    return out


def folded(metrics: list[dict], eval_metrics: list[dict]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(titles of the panels with nothing logged, [(title, keys)] of the panels whose every logged value is 0)."""
    present = set(metric_keys(metrics))
    empty, zero = [], []
    for p in [*PANELS, EVAL_PANEL]:
        keys = panel_keys(p, present, eval_metrics)
        records = eval_metrics if p.id == EVAL_PANEL.id else metrics
        values = [v for k in keys for _, v in _series(records, k)]
        if not values:
            empty.append(p.title)
        elif all(v == 0 for v in values):
            zero.append((p.title, keys))
    return empty, zero
