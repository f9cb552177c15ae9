"""Training curves over steps, as long-format tables (step, value, series) for Gradio's line plots.

Panels (a metric a run did not log leaves its panel empty, with a note):
    reward        reward/mean and each component (reward/format, reward/accuracy, ...; tIoU has its own panel)
    tIoU          reward/iou
    length        response/length_mean, response/length_max
    KL            actor/kl
    clip fraction actor/clip_fraction
    time / phase  timing_s/rollout, reward, logprob, update, step
    evaluation    every metric of eval.jsonl (R1@m, mIoU, ...)
"""

from __future__ import annotations

import math

import pandas as pd

from mmpg.runs import metric_series

_SKIP_REWARD = {"reward/iou", "reward/std"}  # tIoU has its own panel; the spread is not a reward


def _reward_keys(keys: set[str]) -> list[str]:
    rest = sorted(k for k in keys if k.startswith("reward/") and k not in _SKIP_REWARD and k != "reward/mean")
    return (["reward/mean"] if "reward/mean" in keys else []) + rest


PANELS: list[tuple[str, str, object]] = [
    # (id, title, keys: list, or a function of the set of keys present)
    ("reward", "Reward (mean and components)", _reward_keys),
    ("iou", "tIoU (reward/iou)", ["reward/iou"]),
    ("length", "Response length (tokens)", ["response/length_mean", "response/length_max"]),
    ("kl", "KL to the reference (actor/kl)", ["actor/kl"]),
    ("clip", "Clip fraction (actor/clip_fraction)", ["actor/clip_fraction"]),
    ("timing", "Time per phase (s)", lambda keys: sorted(k for k in keys if k.startswith("timing_s/"))),
]
EVAL_PANEL = ("eval", "Evaluation during training (eval.jsonl)")
_NOT_METRICS = {"v", "step", "time"}
MAX_POINTS = 300  # per series: the browser draws every point (1,000 steps x 7 panels at 1,500 took 7.9 s)


def metric_keys(records: list[dict]) -> list[str]:
    """Every numeric metric name that appears in the records, sorted."""
    keys = set()
    for r in records:
        keys.update(k for k, v in r.items() if k not in _NOT_METRICS and isinstance(v, (int, float))
                    and not isinstance(v, bool))
    return sorted(keys)


def long_frame(records: list[dict], keys: list[str], strip: str = "", max_points: int = MAX_POINTS) -> pd.DataFrame:
    """Columns step (int), value (float), series (str: the metric name less `strip`); missing/NaN values left out.
    A series longer than `max_points` keeps every k-th point and the last one (the browser draws every point)."""
    steps, values, series = [], [], []
    for key in keys:
        s, v = metric_series(records, key)
        good = [(a, float(b)) for a, b in zip(s, v) if isinstance(b, (int, float)) and math.isfinite(float(b))]
        if len(good) > max_points:
            k = -(-len(good) // max_points)
            good = good[::k] + ([good[-1]] if (len(good) - 1) % k else [])
        steps += [a for a, _ in good]
        values += [b for _, b in good]
        series += [key[len(strip):] if strip and key.startswith(strip) else key] * len(good)
    return pd.DataFrame({"step": pd.Series(steps, dtype="int64"), "value": pd.Series(values, dtype="float64"),
                         "series": pd.Series(series, dtype="str")})


def curve_frames(metrics: list[dict], eval_metrics: list[dict]) -> dict[str, pd.DataFrame]:
    """Panel id -> long table; every panel of PANELS plus 'eval' (empty tables where nothing was logged)."""
    present = set(metric_keys(metrics))
    out = {}
    for pid, _title, keys in PANELS:
        chosen = keys(present) if callable(keys) else [k for k in keys if k in present]
        out[pid] = long_frame(metrics, chosen)
    eval_keys = [k for k in metric_keys(eval_metrics) if not k.endswith(("skipped", "count", "failed"))]
    out[EVAL_PANEL[0]] = long_frame(eval_metrics, eval_keys, strip="eval/")
    return out
